"""End-to-end tests of balance scheduling on an Ascend host: MoE model, data parallel size 2.

Why they exist: the unit tests and the CPU online test (``tests/e2e_cpu``, fake forward) run
vLLM's real scheduler and engine cores, but only an NPU host runs the whole path with a real
model (platform plugin, expert-parallel MoE, HCCL, graph modes). The tests skip, with the reason,
where torch_npu or two NPUs are missing; ``BALANCE_E2E_REQUIRE_NPU=1`` turns the skip into an
error (set it on NPU runners, where a skip would hide a broken runner).

They use vllm-ascend's own e2e helpers (``tests/e2e/conftest.py``: ``DPVllmRunner``,
``RemoteOpenAIServer``, ``wait_until_npu_memory_free``), so they run from a vllm-ascend checkout
(the patch series puts this file in ``tests/e2e/multicard/2-cards/`` on v0.18.0,
``tests/e2e/pull_request/two_card/`` on v0.23.0).

What they assert, each able to fail only on a regression (no exact output equality between
balance off and on: balance changes which requests share a batch, and batch composition changes
NPU numerics unless batch invariance is on):

* offline, ``DPVllmRunner`` (one process per DP rank), balance off and on through the config
  switch ``additional_config={"enable_balance_scheduling": ...}``: every request finishes with
  its ``max_tokens``; JSON-mode (structured output) requests finish and their text parses and
  matches the schema; with balance on every engine core runs the gather hook and reports
  ``gated_steps > 0`` in its ``Balance scheduling stats`` line (the workload, 4x ``max_num_seqs``
  requests per rank, must close the gate under upstream's ``cap`` rule, which the tests pin), with balance off no
  engine core reports any;
* online, ``vllm serve --data-parallel-size 2 --enable-expert-parallel --additional-config
  '{"enable_balance_scheduling": true}'`` driven by ``vllm bench serve --dataset-name random``
  in bursts separated by idle gaps (each gap ends a DP wave), JSON-mode chat requests sent inside
  every burst: every request completes, JSON parses and matches the schema, gated steps > 0 on
  both ranks;
* online, dense model, DP=2 with balance on: vLLM runs dense DP ranks independently, so every
  request completes and no engine core runs the gather.

A rank that dies fails the test within seconds (all ranks are watched, and the whole process
tree of every rank and server is killed); every wait is bounded by ``BALANCE_E2E_TIMEOUT``.

Configuration (environment variables): BALANCE_E2E_MOE_MODEL, BALANCE_E2E_DENSE_MODEL,
BALANCE_E2E_NUM_PROMPTS, BALANCE_E2E_MAX_TOKENS, BALANCE_E2E_MAX_NUM_SEQS, BALANCE_E2E_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import regex as re  # vllm-ascend's pre-commit forbids `import re`

MOE_MODEL = os.environ.get("BALANCE_E2E_MOE_MODEL", "Qwen/Qwen3-30B-A3B")
DENSE_MODEL = os.environ.get("BALANCE_E2E_DENSE_MODEL", "Qwen/Qwen3-0.6B")
NUM_PROMPTS = int(os.environ.get("BALANCE_E2E_NUM_PROMPTS", "64"))
MAX_TOKENS = int(os.environ.get("BALANCE_E2E_MAX_TOKENS", "64"))
# Small, so every rank reaches its cap (NUM_PROMPTS / DP_SIZE waiting requests each).
MAX_NUM_SEQS = int(os.environ.get("BALANCE_E2E_MAX_NUM_SEQS", "8"))
TIMEOUT_S = float(os.environ.get("BALANCE_E2E_TIMEOUT", "1800"))
DP_SIZE = 2
NUM_JSON = 4
WAVES = 3
IDLE_GAP_S = 5.0
# Logged by each MoE DP engine core that runs the per-step balance gather.
ENGINE_HOOK_LOG = "this DP engine core is BalanceDPEngineCoreProc"
STATS_RE = re.compile(
    r"Balance scheduling stats: dp_rank=(\d+) engine_steps=(\d+) gathers=(\d+) "
    r"gated_steps=(\d+)"
)
JSON_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


def _skip_reason() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed: these tests need an Ascend NPU host with 2 NPUs"
    # Counted in a child process so this pytest process never initialises the NPU runtime.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, torch_npu; print(torch.npu.device_count())"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return f"torch_npu cannot initialise: {probe.stderr.strip().splitlines()[-1:]}"
    count = int(probe.stdout.strip().splitlines()[-1])
    if count < DP_SIZE:
        return f"needs {DP_SIZE} NPUs, found {count}"
    return None


SKIP_REASON = _skip_reason() if __name__ not in ("__main__", "__mp_main__") else None
if SKIP_REASON and os.environ.get("BALANCE_E2E_REQUIRE_NPU") == "1":
    raise RuntimeError(f"BALANCE_E2E_REQUIRE_NPU=1 but {SKIP_REASON}")
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def _upstream() -> Any:
    """vllm-ascend's e2e helpers (its tests/e2e/conftest.py), imported only where the tests run."""
    try:
        from tests.e2e import conftest
    except ImportError as error:
        raise RuntimeError(
            "run this file from a vllm-ascend checkout: it uses tests/e2e/conftest.py "
            "(DPVllmRunner, RemoteOpenAIServer, wait_until_npu_memory_free)"
        ) from error
    return conftest


@pytest.fixture(autouse=True)
def _engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stats line is INFO; CI jobs often run with VLLM_LOGGING_LEVEL=ERROR.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("HCCL_BUFFSIZE", os.environ.get("HCCL_BUFFSIZE", "1024"))
    monkeypatch.setenv(
        "ASCEND_RT_VISIBLE_DEVICES", os.environ.get("ASCEND_RT_VISIBLE_DEVICES", ",".join(map(str, range(DP_SIZE))))
    )
    # The config switch alone decides (vllm-ascend 0.23 deprecates the variable).
    monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
    # Upstream's rule, whose gate must close in this short workload: the default (adaptive) closes it only once its
    # fit is sure a prefill step costs every rank more than a decode step, which a few hundred steps may not show.
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_GATE_RULE", "cap")
    _upstream().wait_until_npu_memory_free(target_free_percentage=0.95)(lambda: None)()


# ---------------------------------------------------------------------------- checks
def final_stats(log: str) -> dict[int, dict[str, int]]:
    """The last ``Balance scheduling stats`` line of each DP rank (logged at engine shutdown)."""
    stats: dict[int, dict[str, int]] = {}
    for match in STATS_RE.finditer(log):
        rank, steps, gathers, gated = (int(g) for g in match.groups())
        stats[rank] = {"engine_steps": steps, "gathers": gathers, "gated_steps": gated}
    return stats


def check_gate(log: str, balance: bool) -> dict[int, dict[str, int]]:
    stats = final_stats(log)
    if balance:
        assert log.count(ENGINE_HOOK_LOG) == DP_SIZE, "balance on: not every engine core runs the gather"
        assert set(stats) == set(range(DP_SIZE)), f"balance on: a rank reported no stats: {stats}"
        assert all(s["gated_steps"] > 0 for s in stats.values()), (
            f"balance on: the gate never closed on some rank although every rank had "
            f"{NUM_PROMPTS // DP_SIZE} requests for {MAX_NUM_SEQS} slots: {stats}"
        )
    else:
        assert ENGINE_HOOK_LOG not in log and not stats, "balance off, yet an engine core gated"
    return stats


def check_json(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(JSON_SCHEMA["required"]) <= set(value), value
    assert isinstance(value["city"], str) and isinstance(value["population"], int), value


def kill_tree(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM ``pid`` (vLLM front-ends stop their engine cores in order), then SIGKILL all."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    root.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)


# --------------------------------------------------------------------------- offline
def prompts(count: int) -> list[str]:
    topics = ["the sea", "a mountain", "an old library", "the first snow", "a busy market"]
    return [
        f"Write a long, detailed story about {topics[i % len(topics)]}, part {i}." * (1 + i % 4) for i in range(count)
    ]


class RankWatchdog:
    """Fails a ``DPVllmRunner`` run within seconds when any DP rank process dies.

    ``DPVllmRunner`` waits for its ranks one after the other (up to its request timeout each);
    when one rank dies the others block in a collective. The watchdog polls every rank process
    and, on the first unexpected exit, kills every rank's process tree: the runner's pending
    pipe reads then fail at once.
    """

    def __init__(self, runner: Any) -> None:
        self.processes = list(runner._dp_processes)  # the rank processes DPVllmRunner started
        assert len(self.processes) == DP_SIZE, "DPVllmRunner no longer exposes its rank processes"
        self.died: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes) if p.exitcode is not None]
            if dead:
                self.died = [f"DP rank {rank} exited with {code}" for rank, code in dead]
                for proc in self.processes:
                    if proc.pid is not None:
                        kill_tree(proc.pid, timeout=5)
                return

    def __enter__(self) -> RankWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def run_offline(balance: bool) -> tuple[list[Any], list[Any]]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    runner_cls = _upstream().DPVllmRunner
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    json_mode = SamplingParams(
        max_tokens=256, temperature=0.0, structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA)
    )
    json_prompts = [f"Describe city number {i} as JSON with its name and population." for i in range(NUM_JSON)]
    with (
        runner_cls(
            MOE_MODEL,
            data_parallel_size=DP_SIZE,
            enable_expert_parallel=True,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=4096,
            additional_config={"enable_balance_scheduling": balance},
            shutdown_timeout=60,
            dp_start_timeout=TIMEOUT_S,
            dp_request_timeout=TIMEOUT_S,
        ) as runner,
        RankWatchdog(runner) as watchdog,
    ):
        try:
            outputs = runner.generate(prompts(NUM_PROMPTS), plain)
            json_outputs = runner.generate(json_prompts, json_mode)
        except Exception as error:
            raise AssertionError(f"{watchdog.died or 'a DP rank failed'}: {error}") from error
    return list(zip(prompts(NUM_PROMPTS), outputs)), list(zip(json_prompts, json_outputs))


@pytest.mark.parametrize("balance", [False, True], ids=["balance-off", "balance-on"])
def test_moe_dp2_offline(balance: bool, capfd: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    outputs, json_outputs = run_offline(balance)
    elapsed = time.monotonic() - started
    captured = capfd.readouterr()
    log = captured.out + captured.err

    # DPVllmRunner returns (prompt + output ids, prompt + output text) per request; generate
    # returns only when every request of every rank has finished.
    assert len(outputs) == NUM_PROMPTS
    for prompt, (_, texts) in outputs:
        assert texts[0].startswith(prompt) and len(texts[0]) > len(prompt), texts[0][:200]
    for prompt, (_, texts) in json_outputs:
        check_json(texts[0][len(prompt) :])
    stats = check_gate(log, balance)
    print(
        f"\n[balance e2e offline] {MOE_MODEL} DP={DP_SIZE} balance={'on' if balance else 'off'}: "
        f"{NUM_PROMPTS}+{NUM_JSON} requests in {elapsed:.1f} s; stats {stats}"
    )


# ---------------------------------------------------------------------------- online
def _metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def _chat_json(base_url: str, index: int, answers: list[Any]) -> None:
    body = {
        "model": MOE_MODEL,
        "max_tokens": 256,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": f"City {index}: name and population as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": JSON_SCHEMA}},
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answers.append(json.loads(response.read()))
    except Exception as error:  # the test fails on it below
        answers.append({"error": repr(error)})


def _send_json_into_burst(base_url: str, wave: int, answers: list[Any]) -> None:
    """Waits until the burst runs (more than one request running), then sends JSON requests."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and _metric(base_url, "vllm:num_requests_running") < 2:
        time.sleep(0.05)
    threads = [threading.Thread(target=_chat_json, args=(base_url, wave * 100 + i, answers)) for i in range(NUM_JSON)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)


def _bench_burst(model: str, base_url: str, wave: int, result_dir: Path) -> dict[str, Any]:
    name = f"bench-{wave}.json"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        "512",
        "--random-output-len",
        str(MAX_TOKENS),
        "--random-range-ratio",
        "0.5",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--max-concurrency",
        str(3 * DP_SIZE * MAX_NUM_SEQS // 2),
        "--ignore-eos",
        "--seed",
        str(wave),
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        name,
        "--trust-remote-code",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, timeout=5)
        raise AssertionError(f"burst {wave} did not finish within {TIMEOUT_S:.0f} s") from None
    assert proc.returncode == 0, f"vllm bench serve exited with {proc.returncode}"
    return json.loads((result_dir / name).read_text())


def logged_server(log_path: Path) -> type:
    """vllm-ascend's ``RemoteOpenAIServer``, its output kept in ``log_path``, its whole tree stopped."""

    class LoggedServer(_upstream().RemoteOpenAIServer):  # type: ignore[misc,name-defined]
        def _start_server(self, model: str, server_cmd: list[str], env_dict: dict[str, str] | None) -> None:
            env = {**os.environ, **(env_dict or {})}
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

        def _terminate_server(self) -> None:
            kill_tree(self.proc.pid, timeout=60)

    return LoggedServer


def serve_args(port: int, *extra: str) -> list[str]:
    return [
        "--data-parallel-size",
        str(DP_SIZE),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-model-len",
        "4096",
        "--trust-remote-code",
        # Engine cores get time to stop in order and log their stats (0, the default, kills them
        # at once on vLLM 0.23).
        "--shutdown-timeout",
        "60",
        "--port",
        str(port),
        "--additional-config",
        json.dumps({"enable_balance_scheduling": True}),
        *extra,
    ]


def test_moe_dp2_online_waves(tmp_path: Path) -> None:
    from vllm.utils.network_utils import get_open_port

    log_path = tmp_path / "serve.log"
    port = get_open_port()
    answers: list[Any] = []
    results = []
    with logged_server(log_path)(
        MOE_MODEL,
        serve_args(port, "--enable-expert-parallel"),
        server_host="127.0.0.1",
        server_port=port,
        auto_port=False,
        max_wait_seconds=TIMEOUT_S,
    ) as server:
        base_url = server.url_root
        for wave in range(WAVES):
            if wave:
                time.sleep(IDLE_GAP_S)  # every engine goes idle: the DP wave ends
            sender = threading.Thread(target=_send_json_into_burst, args=(base_url, wave, answers))
            sender.start()
            results.append(_bench_burst(MOE_MODEL, base_url, wave, tmp_path))
            sender.join(TIMEOUT_S)
    log = log_path.read_text(errors="replace")

    for wave, result in enumerate(results):
        assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), f"burst {wave}: {result}"
    assert len(answers) == WAVES * NUM_JSON
    for answer in answers:
        assert "error" not in answer, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        check_json(choice["message"]["content"])
    stats = check_gate(log, balance=True)
    print(
        f"\n[balance e2e online] {MOE_MODEL} DP={DP_SIZE}: {WAVES} bursts of {NUM_PROMPTS} + "
        f"{NUM_JSON} JSON requests completed; stats {stats}"
    )


def test_dense_dp2_serves_with_balance_on(tmp_path: Path) -> None:
    """Dense DP ranks are independent in vLLM (no lockstep): stock engine cores, no gather."""
    from vllm.utils.network_utils import get_open_port

    log_path = tmp_path / "serve.log"
    port = get_open_port()
    with logged_server(log_path)(
        DENSE_MODEL,
        serve_args(port),
        server_host="127.0.0.1",
        server_port=port,
        auto_port=False,
        max_wait_seconds=TIMEOUT_S,
    ) as server:
        result = _bench_burst(DENSE_MODEL, server.url_root, 0, tmp_path)
    log = log_path.read_text(errors="replace")
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result
    assert ENGINE_HOOK_LOG not in log and not final_stats(log), "dense DP ran the MoE gather"
