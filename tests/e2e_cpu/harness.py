"""Runs a real ``vllm serve`` (DP=2, expert parallel, fake forward) on CPU and drives it.

The server is vLLM's, unmodified: API server, DP coordinator, ZMQ, two ``DPEngineCoreProc``
processes with the real scheduler and this project's hook; only the model forward is fake (the
``balance_fake_forward`` plugins next to this file, put on ``PYTHONPATH``, never installed). Load
comes from ``drive_waves.py``: vLLM's own benchmark client (``vllm bench serve --dataset-name
random``) in bursts, with JSON-mode chat requests (``response_format`` ``json_schema``) inside.

Every process the harness starts runs in its own session (process group), so stopping reaches the
whole tree (``kill_tree``: SIGTERM to the leader, whose shutdown lets the engines log their balance
statistics, then SIGTERM and SIGKILL to the group). Every wait is bounded; the bounds are generous
(a 2-core machine shared with other jobs starts a server in 25-200 s) and only a hang reaches them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
PLUGIN_PATH = HERE / "fake_forward"
PLUGINS = "ascend_balance_scheduling,balance_fake_forward,balance_gate_check"
# vLLM's CPU build (the v0.32.0-cpu line) runs the real model: its own CPU platform, the gate check, and the test-only
# fixes of real_forward/ instead of the fake forward.
REAL_FORWARD_PATH = HERE / "real_forward"
REAL_FORWARD_PLUGINS = "ascend_balance_scheduling,balance_gate_check,balance_real_forward"
# vllm-ascend main's documented form, accepted on every line.
# Upstream's gate rule: the tests check that the gate closes on every rank and admits nothing while closed, which it
# does under any load (the adaptive rule holds only where it measured a saving; scripts/bench_engine.py runs that).
BALANCE_ON = [
    "--additional-config",
    json.dumps({"scheduler_config": {"enable_balance_scheduling": True, "balance_gate_rule": "cap"}}),
]

STARTUP_TIMEOUT_S = float(os.environ.get("BALANCE_E2E_STARTUP_TIMEOUT", "420"))
REQUEST_TIMEOUT_S = 300.0
DRIVER_STARTUP_S = 180.0  # importing vLLM's benchmark client on a busy 2-core machine
STOP_TIMEOUT_S = 60.0

STATS_RE = re.compile(
    r"Balance scheduling stats: dp_rank=(\d+) engine_steps=(\d+) gathers=(\d+) "
    r"gated_steps=(\d+)"
)
CHECK_RE = re.compile(
    r"Balance gate check: dp_rank=(\d+) closed_steps=(\d+) "
    r"admitted_while_closed=(\d+)"
)
VIOLATION_RE = re.compile(r"Balance gate check: dp_rank=\d+ admitted .*")
ENGINE_HOOK_LOG = "this DP engine core is BalanceDPEngineCoreProc"

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(real_forward: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_ASCEND_BALANCE_SCHEDULING", None)  # the config switch alone decides
    paths = (PLUGIN_PATH, REAL_FORWARD_PATH) if real_forward else (PLUGIN_PATH,)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*map(str, paths), env.get("PYTHONPATH")) if p)
    env.update(
        {
            "VLLM_PLUGINS": REAL_FORWARD_PLUGINS if real_forward else PLUGINS,
            "VLLM_LOGGING_LEVEL": "INFO",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # vLLM's benchmark client keeps idle connections 60 s, the server only 5 s by default: a request sent on
            # a connection the server is closing fails ("Server disconnected"; seen in the real-engine bench).
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
            "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    return env


def kill_tree(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """Stops ``proc`` and every process it started; returns what was still alive at the end.

    SIGTERM to the leader first: vLLM's API server then shuts its engine cores down in order
    (each logs its balance statistics). A signal to the whole group at once would reach the
    engine cores twice (directly and from the API server) and the second one kills them before
    they log. Then SIGTERM, then SIGKILL, to the whole process group, for whatever is left.
    """
    try:
        members = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        members = [proc.pid]
    steps = (
        (lambda sig: os.kill(proc.pid, sig), signal.SIGTERM, timeout),
        (lambda sig: os.killpg(proc.pid, sig), signal.SIGTERM, 10.0),
        (lambda sig: os.killpg(proc.pid, sig), signal.SIGKILL, 10.0),
    )
    for send, sig, wait_s in steps:
        if not _alive(members):
            break
        with contextlib.suppress(ProcessLookupError):
            send(sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _alive(members):
            proc.poll()  # reap the leader, so it does not linger as a zombie
            time.sleep(0.2)
    proc.poll()
    return [f"pid {p}" for p in _alive(members)]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@dataclass
class Server:
    """One ``vllm serve`` process tree, its log, and the port it serves on."""

    model: Path
    log_path: Path
    args: list[str]
    real_forward: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0
    leftovers: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        self.log_path.write_text(f"$ {' '.join(cmd)}\n")
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=server_env(self.real_forward) | self.extra_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._started = started

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = self._started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited with {self.proc.returncode} during start-up; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        self.startup_s = time.monotonic() - self._started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise AssertionError(f"vllm serve not healthy within {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            self.leftovers = kill_tree(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 8000) -> str:
        return self.log()[-chars:]

    def __enter__(self) -> Server:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---- load -------------------------------------------------------------------------------------
@dataclass
class Wave:
    """One burst: ``vllm bench serve`` random requests plus JSON-mode chat requests within it."""

    num_prompts: int = 32
    max_concurrency: int = 12
    input_len: int = 48
    output_len: int = 64
    json_requests: int = 3


def run_waves(
    server: Server,
    waves: list[Wave],
    idle_gap_s: float,
    min_running: int,
    workdir: Path,
    schema: dict[str, Any] = CITY_SCHEMA,
) -> dict[str, Any]:
    """Runs ``drive_waves.py`` against ``server`` (bounded); returns what it recorded."""
    plan = {
        "base_url": server.base_url,
        "model": str(server.model),
        "schema": schema,
        "waves": [asdict(w) for w in waves],
        "idle_gap_s": idle_gap_s,
        "min_running": min_running,
        "timeout_s": REQUEST_TIMEOUT_S,
    }
    plan_path, out_path, log_path = (workdir / n for n in ("plan.json", "waves.json", "waves.log"))
    plan_path.write_text(json.dumps(plan))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    bound = DRIVER_STARTUP_S + len(waves) * (REQUEST_TIMEOUT_S + idle_gap_s)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "drive_waves.py"), str(plan_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            kill_tree(proc, timeout=5)
            raise AssertionError(
                f"the waves did not finish within {bound:.0f} s (a hang at a "
                f"wave boundary looks like this); server log tail:\n"
                f"{server.log_tail()}"
            ) from None
    assert proc.returncode == 0, (
        f"drive_waves.py exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-6000:]}"
    )
    return json.loads(out_path.read_text())


def greedy_completions(server: Server, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt alone (one request in flight, so no batch can change it), temperature 0: the texts."""
    texts = []
    for prompt in prompts:
        body = {"model": str(server.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        request = urllib.request.Request(
            f"{server.base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            texts.append(json.loads(response.read())["choices"][0]["text"])
    return texts


def json_request(server: Server, index: int, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    from drive_waves import chat_json

    return chat_json(server.base_url, str(server.model), CITY_SCHEMA, index, timeout)


# ---- /metrics ------------------------------------------------------------------------------------------
BALANCE_METRIC = "vllm:balance_"
SETTLE_S, SETTLE_BOUND_S = 1.0, 60.0


def scrape(server: Server) -> str:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        return response.read().decode()


def balance_values(text: str) -> dict[str, dict[int, float]]:
    """``{sample name: {engine: value}}`` of the balance metrics, parsed with prometheus_client's parser (which
    raises on a malformed exposition)."""
    from drive_waves import sampled_values

    return {
        name: {int(engine): value for engine, value in per_engine.items()}
        for name, per_engine in sampled_values(text).items()
        if name.startswith(BALANCE_METRIC)
    }


def settled_scrape(server: Server) -> str:
    """A scrape once the balance metrics stopped moving (the front-end records each engine's last stats
    asynchronously); bounded."""
    deadline, previous = time.monotonic() + SETTLE_BOUND_S, None
    while True:
        text = scrape(server)
        current = balance_values(text)
        if current == previous or time.monotonic() > deadline:
            return text
        previous = current
        time.sleep(SETTLE_S)


# The scrape after the run against each engine's shutdown line: equal but for steps whose stats never left the
# engine (a last schedule() after the final stats message), at most this many per engine.
METRICS_BOUND_STEPS = 2
DASHBOARD = HERE.parents[1] / "docs" / "grafana-balance-scheduling.json"


def dashboard_metric_names() -> set[str]:
    """Every metric name the Grafana dashboard's queries use."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {name for p in panels for t in p.get("targets", []) for name in re.findall(r"vllm:[a-z_:]+", t["expr"])}


def check_balance_metrics(
    metrics: str, client: dict, stats: dict[int, dict[str, int]], balance: bool, dp_size: int
) -> dict[int, dict]:
    """The /metrics checks of one run: with balance off no balance metric; on, per engine, the scrape after the run
    against the engine's shutdown line (where it survived), the gated-steps counter moving during the run (``client``'s
    scrapes), and every metric the dashboard queries present. Returns the final balance values per engine."""
    final = balance_values(metrics)  # parses the whole exposition: raises if malformed
    if not balance:
        assert final == {} and "vllm:balance_" not in metrics, f"balance off, yet balance metrics: {final}"
        return {}
    per_engine = {e: {n.removeprefix("vllm:balance_"): v[e] for n, v in final.items()} for e in range(dp_size)}
    for engine, logged in stats.items():
        seen = per_engine[engine]
        for metric, key in (("steps_total", "engine_steps"), ("gated_steps_total", "gated_steps")):
            assert 0 <= logged[key] - seen[metric] <= METRICS_BOUND_STEPS, (engine, metric, seen, logged)
        assert 0 < seen["waiting_gated_steps_total"] <= seen["gated_steps_total"], seen
        assert seen["gate_rule"] == 0, seen
    # During the run: the gated-steps counter of every engine took at least 3 distinct values while sampled.
    for engine in range(dp_size):
        moving = {s["values"].get("vllm:balance_gated_steps_total", {}).get(str(engine)) for s in client["series"]}
        assert len(moving - {None}) >= 3, f"engine {engine}: gated steps did not move during the run"
    from prometheus_client.parser import text_string_to_metric_families

    names = {s.name for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert not dashboard_metric_names() - names, f"dashboard metrics not scraped: {dashboard_metric_names() - names}"
    return per_engine


# ---- what the engines logged ---------------------------------------------------------------------
def final_stats(log: str) -> dict[int, dict[str, int]]:
    """The last ``Balance scheduling stats`` line of each DP rank (the one logged at shutdown)."""
    stats: dict[int, dict[str, int]] = {}
    for match in STATS_RE.finditer(log):
        rank, steps, gathers, gated = (int(g) for g in match.groups())
        stats[rank] = {"engine_steps": steps, "gathers": gathers, "gated_steps": gated}
    return stats


def gate_checks(log: str) -> dict[int, dict[str, int]]:
    """The last gate-check summary of each DP rank (see ``balance_fake_forward.gate_check``)."""
    checks: dict[int, dict[str, int]] = {}
    for match in CHECK_RE.finditer(log):
        rank, closed, admitted = (int(g) for g in match.groups())
        checks[rank] = {"closed_steps": closed, "admitted_while_closed": admitted}
    return checks


def gate_violations(log: str) -> list[str]:
    return VIOLATION_RE.findall(log)


class Watchdog:
    """Ends a stuck run: kills ``server`` after ``seconds`` so every blocking call returns."""

    def __init__(self, server: Server, seconds: float) -> None:
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire, args=(server,))
        self._timer.daemon = True

    def _fire(self, server: Server) -> None:
        self.fired = True
        server.stop()

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
