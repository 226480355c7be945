"""Online serving with balance scheduling, end to end on CPU: real ``vllm serve``, fake forward.

What runs: vLLM's own server (``vllm serve <tiny MoE> --data-parallel-size 2
--enable-expert-parallel``: API server, DP coordinator, ZMQ, two ``DPEngineCoreProc`` engine
cores with the real scheduler and this project's hook), switched on only by
``--additional-config '{"scheduler_config": {"enable_balance_scheduling": true}}'``. Only the model forward is fake
(``fake_forward/``: a CPU platform plugin whose worker samples token ids, the grammar bitmask
honoured). vLLM's benchmark client (``vllm bench serve --dataset-name random``, bounded
concurrency above DP x ``max_num_seqs``, so ranks reach their cap) sends several bursts separated
by idle gaps (each gap ends a DP wave; upstream's deadlocks were at wave boundaries), with
JSON-mode chat requests (``response_format`` ``json_schema``) sent during every burst.

It would fail on: a request that never finishes (a hang at a wave boundary, a JSON-mode request
stuck in ``WAITING_FOR_FSM``), a gate that never closes with balance on (gated steps per rank,
from the engines' ``Balance scheduling stats`` line at shutdown), a rank admitting while the gate
is closed (``gate_check`` instrumentation), a config switch that does not reach the engines
(balance on must run ``BalanceDPEngineCoreProc`` on both ranks, off must not), and any process
left behind.

``/metrics`` is checked in the same runs (no server of its own): scraped during the bursts (``drive_waves``'s
sampler) and after them, parsed with prometheus_client's parser. With balance on (two API servers, so vLLM's
multiprocess collector serves the sum of both) the gate's counters move during the run and, per engine, equal the
engines' own shutdown stats line within ``METRICS_BOUND_STEPS``; every query of the Grafana dashboard names a metric
of the scrape. With balance off no ``vllm:balance_`` metric exists. ``BALANCE_E2E_ARTIFACTS=<dir>`` keeps the scrape
and the sampled series there (docs/metrics.md's sample and plot come from such a run).

Every wait is bounded; a watchdog kills the server tree if a run exceeds its bound.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from pathlib import Path

import jsonschema
import pytest
from harness import (
    BALANCE_ON,
    CITY_SCHEMA,
    ENGINE_HOOK_LOG,
    Server,
    Watchdog,
    Wave,
    check_balance_metrics,
    final_stats,
    free_port,
    gate_checks,
    gate_violations,
    json_request,
    run_waves,
    settled_scrape,
)
from tiny_model import write_tiny_moe_model

DP_SIZE = 2
MAX_NUM_SEQS = 4
ENGINE_ARGS = [
    "--enable-expert-parallel",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-model-len",
    "512",
    "--block-size",
    "16",
    "--enforce-eager",
    # A grace period for the engine cores when the server stops, so each logs its stats line
    # (with the default 0, vLLM 0.23 kills them at once).
    "--shutdown-timeout",
    "30",
]
SERVE_ARGS = ["--data-parallel-size", str(DP_SIZE), *ENGINE_ARGS]
# Balance on runs two API servers: its metrics must add up across them (vLLM's multiprocess collector).
API_SERVERS = {False: "1", True: "2"}
# Concurrency 12 > DP x max_num_seqs = 8: with balance on the gate must close in every burst.
WAVES = [Wave(), Wave(num_prompts=24, max_concurrency=10), Wave()]
IDLE_GAP_S = 3.0
# JSON-mode requests go out once this many requests run (above the client's ready check).
MIN_RUNNING = MAX_NUM_SEQS
RUN_BOUND_S = 900.0  # start-up plus every wave (measured up to 260 s under load); only a hang gets near it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_model(tmp_path_factory.mktemp("tiny-moe"))


def _serve_waves(model: Path, workdir: Path, balance: bool) -> tuple[Server, dict, float, str]:
    args = SERVE_ARGS + ["--api-server-count", API_SERVERS[balance]] + (BALANCE_ON if balance else [])
    server = Server(model, workdir / "serve.log", args)
    started = time.monotonic()
    with Watchdog(server, RUN_BOUND_S) as watchdog:
        try:
            with server:
                client = run_waves(server, WAVES, IDLE_GAP_S, MIN_RUNNING, workdir)
                metrics = settled_scrape(server)
        except Exception as error:
            if watchdog.fired:
                raise AssertionError(
                    f"run exceeded {RUN_BOUND_S:.0f} s and was killed; log tail:\n{server.log_tail()}"
                ) from error
            raise
    return server, client, time.monotonic() - started, metrics


@pytest.mark.parametrize("balance", [False, True], ids=["balance-off", "balance-on"])
def test_online_waves(model_dir: Path, tmp_path: Path, balance: bool) -> None:
    server, client, wall_s, metrics = _serve_waves(model_dir, tmp_path, balance)
    log = server.log()
    label = "on" if balance else "off"
    if artifacts := os.environ.get("BALANCE_E2E_ARTIFACTS"):
        version = importlib.metadata.version("vllm")
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        (Path(artifacts) / f"scrape-balance-{label}-v{version}.txt").write_text(metrics)
        (Path(artifacts) / f"series-balance-{label}-v{version}.json").write_text(json.dumps(client["series"]))

    assert not server.leftovers, f"processes left after stopping the server: {server.leftovers}"
    assert len(client["bench"]) == len(WAVES)
    for wave, result in zip(WAVES, client["bench"]):
        assert (result["completed"], result["failed"]) == (wave.num_prompts, 0), (
            f"balance {label}: a burst did not complete every request: {result['completed']} "
            f"completed, {result['failed']} failed of {wave.num_prompts}"
        )
    assert not client["json_errors"], client["json_errors"]
    answers = client["json"]
    assert len(answers) == sum(w.json_requests for w in WAVES)
    # Sent into a running burst, not before or after it.
    assert all(n >= MIN_RUNNING for n in client["running_when_sent"]), client["running_when_sent"]
    for answer in answers:
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", f"JSON-mode output cut short: {choice}"
        jsonschema.validate(json.loads(choice["message"]["content"]), CITY_SCHEMA)

    stats, checks = final_stats(log), gate_checks(log)
    assert not gate_violations(log), f"a rank admitted while the gate was closed: {gate_violations(log)}"
    if balance:
        assert log.count(ENGINE_HOOK_LOG) == DP_SIZE, "not every engine core runs the gather hook"
        assert set(stats) == set(range(DP_SIZE)), f"missing shutdown stats line: {stats}"
        gated = {rank: s["gated_steps"] for rank, s in stats.items()}
        assert all(g > 0 for g in gated.values()), f"the gate never closed on some rank: {stats}"
        # The instrumentation saw the gate close (and no admission) on every rank, too.
        assert set(checks) == set(range(DP_SIZE)), f"gate check saw no closed stretch: {checks}"
        assert all(c["admitted_while_closed"] == 0 for c in checks.values()), checks
    else:
        assert ENGINE_HOOK_LOG not in log and "Balance scheduling: using" not in log, (
            "balance off, yet a balanced scheduler or engine core was built"
        )
        assert stats == {} and checks == {}, "balance off, yet some rank gated a step"
    scraped = check_balance_metrics(metrics, client, stats, balance, DP_SIZE)

    requests = sum(w.num_prompts + w.json_requests for w in WAVES)
    per_rank = (
        ", ".join(f"rank {r}: {s['gated_steps']} gated of {s['engine_steps']} steps" for r, s in sorted(stats.items()))
        or "no gated steps (stock engines)"
    )
    print(
        f"\n[online e2e] balance {label}: start-up {server.startup_s:.1f} s, {requests} "
        f"requests in {len(WAVES)} waves all completed ({len(answers)} JSON-mode), {per_rank}; "
        f"run {wall_s:.1f} s; /metrics: {len(client['series'])} scrapes during the run, after it "
        + (
            ", ".join(
                f"engine {e}: {int(v['gated_steps_total'])} gated of {int(v['steps_total'])}"
                for e, v in scraped.items()
            )
            or "no balance metrics"
        )
    )


MISMATCH_BOUND_S = 300.0
HANG_S = 90.0


def test_mismatched_switch_fails_fast(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two external-LB ranks of one DP group, balance on in one and off in the other.

    They must refuse to serve (a rank exits with an error naming the switch) instead of hanging: the balanced
    rank's start-up agreement check (issue 11) does not hear from the stock rank within its bound. Before that
    check, both started and the first request to the balanced rank never completed.
    """
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_AGREEMENT_TIMEOUT_S", "20")
    common = ENGINE_ARGS + [
        "--data-parallel-size",
        str(DP_SIZE),
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(free_port()),
    ]
    ranks = [
        Server(model_dir, tmp_path / "rank0.log", common + ["--data-parallel-rank", "0"] + BALANCE_ON),
        Server(model_dir, tmp_path / "rank1.log", common + ["--data-parallel-rank", "1"]),
    ]
    try:
        for server in ranks:
            server.start()
        deadline = time.monotonic() + MISMATCH_BOUND_S
        exited = []
        while time.monotonic() < deadline and not exited:
            exited = [s for s in ranks if s.proc is not None and s.proc.poll() not in (None, 0)]
            if not exited and all(_healthy(s) for s in ranks):
                # Both serve: a request to each must complete, or this is the hang.
                for rank, server in enumerate(ranks):
                    try:
                        with Watchdog(server, HANG_S):
                            json_request(server, rank, timeout=HANG_S)
                    except OSError as error:
                        raise AssertionError(
                            f"rank {rank} left a request unanswered for {HANG_S:.0f} s (hung): {error!r}"
                        ) from error
                break
            time.sleep(1)
        assert exited, "ranks with different balance switches both served"
        assert any("enable_balance_scheduling" in s.log() for s in exited), (
            "a rank failed, but not naming the balance switch"
        )
    finally:
        for server in ranks:
            server.stop()
        assert not [p for s in ranks for p in s.leftovers], "processes left after the test"


def _healthy(server: Server) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
