"""End-to-end tests of balance scheduling on an Ascend host: data parallel size 2, real NPUs.

Why they exist: the unit tests run real vLLM schedulers on CPU, but only an NPU host runs the
whole path (platform plugin, DP engine cores in lockstep, the per-step gather over the DP group,
structured output, real models). These tests skip, with the reason, anywhere torch_npu or two NPUs
are missing, so they are collected on every machine and run on Ascend runners.

What they assert on an NPU:

* MoE model, offline ``vllm.LLM``, one process per DP rank, balance scheduling on vs off on the
  same prompts: every request finishes (a request that is never scheduled shows as a rank that
  does not finish within the timeout); the greedy token ids of every prompt are identical;
  the JSON-mode request's output parses as JSON; the "on" run logs that the balanced scheduler
  was selected and that each engine core runs the gather hook, the "off" run logs neither. The output throughput of both runs is printed.
* Dense model, ``vllm serve --data-parallel-size 2`` with balance scheduling on (vLLM serves
  dense DP only online): the server must start and answer every completion request.

Configuration (environment variables): BALANCE_E2E_MOE_MODEL, BALANCE_E2E_DENSE_MODEL,
BALANCE_E2E_NUM_PROMPTS, BALANCE_E2E_MAX_TOKENS, BALANCE_E2E_MAX_NUM_SEQS, BALANCE_E2E_TIMEOUT;
BALANCE_E2E_REQUIRE_NPU=1 turns the skip into a collection error (set it on NPU runners).

Each DP rank runs this file as a script (``python <this file> rank <config.json>``) so that every
run gets fresh processes: the flag is read at construction and the NPUs are released at exit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

MOE_MODEL = os.environ.get("BALANCE_E2E_MOE_MODEL", "Qwen/Qwen3-30B-A3B")
DENSE_MODEL = os.environ.get("BALANCE_E2E_DENSE_MODEL", "Qwen/Qwen3-0.6B")
NUM_PROMPTS = int(os.environ.get("BALANCE_E2E_NUM_PROMPTS", "64"))
MAX_TOKENS = int(os.environ.get("BALANCE_E2E_MAX_TOKENS", "64"))
# Small, so the ranks reach the cap and the gate actually closes during the run.
MAX_NUM_SEQS = int(os.environ.get("BALANCE_E2E_MAX_NUM_SEQS", "8"))
TIMEOUT_S = int(os.environ.get("BALANCE_E2E_TIMEOUT", "1800"))
DP_SIZE = 2
FLAG = "VLLM_ASCEND_BALANCE_SCHEDULING"
# Logged once per engine process by the wiring when it returns the balanced scheduler class.
SELECTED_LOG = "Balance scheduling: using"
# Logged by each MoE DP engine core that runs the per-step balance gather.
ENGINE_HOOK_LOG = "Balance scheduling: this DP engine core is BalanceDPEngineCoreProc"
JSON_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
HERE = Path(__file__).resolve()


def _skip_reason() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed: these tests need an Ascend NPU host with 2 NPUs"
    # Counted in a child process so this pytest process never initialises the NPU runtime.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, torch_npu; print(torch.npu.device_count())"],
        capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return f"torch_npu cannot initialise: {probe.stderr.strip().splitlines()[-1:]}"
    count = int(probe.stdout.strip().splitlines()[-1])
    if count < DP_SIZE:
        return f"needs {DP_SIZE} NPUs, found {count}"
    return None


# Not in the DP rank processes this file also runs as (nor in their spawned children).
SKIP_REASON = _skip_reason() if __name__ not in ("__main__", "__mp_main__") else None
if SKIP_REASON and os.environ.get("BALANCE_E2E_REQUIRE_NPU") == "1":
    # Set on Ascend CI runners: there a skip would hide a broken runner or install.
    raise RuntimeError(f"BALANCE_E2E_REQUIRE_NPU=1 but {SKIP_REASON}")
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


# ----------------------------------------------------------------------------- workload
def prompts(count: int) -> list[dict[str, Any]]:
    """Deterministic prompts of varied length and output length, one of them JSON-mode.

    Varied max_tokens make the ranks finish requests at different steps, so the number of running
    requests differs between ranks and the gate has something to balance.
    """
    topics = ["the sea", "a mountain", "rain", "a library", "trains", "bees", "winter", "a clock"]
    items = []
    for i in range(count):
        topic = topics[i % len(topics)]
        text = f"Write {1 + i % 5} sentences about {topic}. " + "Be precise. " * (i % 7)
        items.append({"index": i, "prompt": text, "max_tokens": 8 + (i * 13) % MAX_TOKENS})
    items.append({"index": count, "json": True, "max_tokens": 256,
                  "prompt": "Return a JSON object describing one large city: its name as "
                            "'city' and its population as 'population'."})
    return items


def run_rank(config: dict[str, Any]) -> None:
    """One DP rank of the offline SPMD run: generate its share, write the outputs as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    rank, dp_size = config["rank"], config["dp_size"]
    mine = [p for p in prompts(config["num_prompts"]) if p["index"] % dp_size == rank]
    params = [SamplingParams(
        temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=not p.get("json"),
        structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA) if p.get("json") else None)
        for p in mine]
    llm = LLM(model=config["model"], max_num_seqs=config["max_num_seqs"],
              max_model_len=2048, enable_expert_parallel=True, trust_remote_code=True,
              seed=0)
    start = time.perf_counter()
    outputs = llm.generate([p["prompt"] for p in mine], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    results = {str(p["index"]): {"token_ids": list(o.outputs[0].token_ids),
                                 "text": o.outputs[0].text,
                                 "finish_reason": o.outputs[0].finish_reason,
                                 "json": bool(p.get("json"))}
               for p, o in zip(mine, outputs)}
    Path(config["out"]).write_text(json.dumps({"elapsed_s": elapsed, "results": results}))
    # Lets the DP engines leave their busy loop before the process exits.
    time.sleep(5)


# ------------------------------------------------------------------------------ drivers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(balance: bool) -> dict[str, str]:
    env = dict(os.environ)
    env[FLAG] = "1" if balance else "0"
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the "balanced class selected" line is at INFO
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    env.setdefault("ASCEND_RT_VISIBLE_DEVICES", ",".join(str(i) for i in range(DP_SIZE)))
    env.setdefault("HCCL_BUFFSIZE", "1024")
    return env


def run_offline_dp(model: str, balance: bool, workdir: Path) -> dict[str, Any]:
    """Runs every DP rank of one offline run; returns the merged outputs and the log."""
    port = _free_port()
    procs = []
    for rank in range(DP_SIZE):
        config = {"rank": rank, "dp_size": DP_SIZE, "model": model, "num_prompts": NUM_PROMPTS,
                  "max_num_seqs": MAX_NUM_SEQS, "out": str(workdir / f"rank{rank}.json")}
        config_file = workdir / f"rank{rank}.config.json"
        config_file.write_text(json.dumps(config))
        env = _base_env(balance)
        env.update({"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank),
                    "VLLM_DP_SIZE": str(DP_SIZE), "VLLM_DP_MASTER_IP": "127.0.0.1",
                    "VLLM_DP_MASTER_PORT": str(port)})
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(HERE), "rank", str(config_file)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + TIMEOUT_S
    failures = []
    for rank, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failures.append(f"rank {rank} did not finish within {TIMEOUT_S}s "
                            "(a request that is never scheduled looks like this)")
        log.close()
        if proc.returncode not in (0, None):
            failures.append(f"rank {rank} exited with {proc.returncode}")
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = "\n".join((workdir / f"rank{r}.log").read_text(errors="replace")
                     for r in range(DP_SIZE))
    assert not failures, "; ".join(failures) + "\n--- logs (tail) ---\n" + logs[-20000:]
    merged: dict[str, Any] = {}
    elapsed = 0.0
    for rank in range(DP_SIZE):
        data = json.loads((workdir / f"rank{rank}.json").read_text())
        merged.update(data["results"])
        elapsed = max(elapsed, data["elapsed_s"])
    return {"results": merged, "elapsed_s": elapsed, "log": logs}


def _throughput(run: dict[str, Any]) -> float:
    tokens = sum(len(r["token_ids"]) for r in run["results"].values())
    return tokens / run["elapsed_s"]


# -------------------------------------------------------------------------------- tests
def test_moe_dp2_balance_on_matches_off(tmp_path: Path) -> None:
    runs = {}
    for balance in (False, True):
        workdir = tmp_path / ("on" if balance else "off")
        workdir.mkdir()
        runs[balance] = run_offline_dp(MOE_MODEL, balance, workdir)

    expected = {str(p["index"]) for p in prompts(NUM_PROMPTS)}
    for balance, run in runs.items():
        label = "on" if balance else "off"
        assert set(run["results"]) == expected, f"balance {label}: missing outputs"
        unfinished = [i for i, r in run["results"].items()
                      if r["finish_reason"] not in ("stop", "length")]
        assert not unfinished, f"balance {label}: unfinished requests {unfinished}"
        json_out = [r for r in run["results"].values() if r["json"]]
        assert len(json_out) == 1 and json_out[0]["finish_reason"] == "stop", json_out
        parsed = json.loads(json_out[0]["text"])
        assert {"city", "population"} <= set(parsed), parsed
    assert SELECTED_LOG in runs[True]["log"], "balance on: the balanced scheduler was not selected"
    assert SELECTED_LOG not in runs[False]["log"], "balance off: a balanced scheduler was selected"
    assert runs[True]["log"].count(ENGINE_HOOK_LOG) == DP_SIZE, "balance on: gather hook missing"
    assert ENGINE_HOOK_LOG not in runs[False]["log"], "balance off: the gather hook ran"

    diverged = [i for i in sorted(expected, key=int)
                if runs[True]["results"][i]["token_ids"] != runs[False]["results"][i]["token_ids"]]
    assert not diverged, (
        f"greedy outputs differ for prompts {diverged}; first: "
        f"off={runs[False]['results'][diverged[0]]['text']!r} "
        f"on={runs[True]['results'][diverged[0]]['text']!r}")

    off, on = _throughput(runs[False]), _throughput(runs[True])
    print(f"\n[balance e2e] {MOE_MODEL} DP={DP_SIZE} max_num_seqs={MAX_NUM_SEQS} "
          f"prompts={NUM_PROMPTS + 1}: output throughput off={off:.1f} tok/s, "
          f"on={on:.1f} tok/s, on/off={on / off:.3f}")


def _post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_healthy(base: str, server: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited with {server.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(5)
    raise AssertionError(f"vllm serve did not become healthy within {TIMEOUT_S}s")


def test_dense_dp2_serves_with_balance_on(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", DENSE_MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", str(DP_SIZE),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "2048"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=_base_env(balance=True), stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        _wait_healthy(base, server, time.monotonic() + TIMEOUT_S)
        work = prompts(NUM_PROMPTS)[:-1]

        def complete(item: dict[str, Any]) -> dict[str, Any]:
            return _post_json(f"{base}/v1/completions", {
                "model": DENSE_MODEL, "prompt": item["prompt"], "max_tokens": item["max_tokens"],
                "temperature": 0.0, "ignore_eos": True}, timeout=TIMEOUT_S)

        with ThreadPoolExecutor(max_workers=4 * MAX_NUM_SEQS) as pool:
            answers = list(pool.map(complete, work))
        lengths = [a["usage"]["completion_tokens"] for a in answers]
        assert lengths == [item["max_tokens"] for item in work]
        assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert SELECTED_LOG in log_path.read_text(errors="replace"), (
        "balance on: the balanced scheduler was not selected by the server's engines")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "rank":
        run_rank(json.loads(Path(sys.argv[2]).read_text()))
    else:
        sys.exit(f"usage: {sys.argv[0]} rank CONFIG_JSON (run by the tests, one per DP rank)")
