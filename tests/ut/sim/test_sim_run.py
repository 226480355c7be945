"""Short simulations end to end on real vLLM schedulers (tiny sizes: seconds)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import simulate_dp
from dpsim.cluster import LockstepCluster, sim_request
from dpsim.costmodel import profile_from_dict
from dpsim.metrics import SUMMARY_KEYS
from dpsim.settings import SimSettings
from dpsim.simulation import run
from dpsim.workload import RequestShape

from dpsim.cluster import CapMinusOneScheduler
from vllm_ascend.core.balance_scheduler import BalanceScheduler

PROFILE = profile_from_dict(
    {"step_overhead_ms": 20, "decode_ms_per_request": 1, "prefill_ms_per_token": 0.05})
TINY = SimSettings(dp_size=2, max_num_seqs=4, max_num_batched_tokens=256, num_requests=16,
                   concurrency=8, prompt_tokens=60, output_tokens=24, output_spread=0.5,
                   router="round-robin")
TINY_ARGS = ["--dp-size", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
             "--num-requests", "12", "--concurrency", "8", "--prompt-tokens", "60",
             "--output-tokens", "24", "--output-spread", "0.5", "--no-progress"]


def test_compare_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    status = simulate_dp.main(TINY_ARGS + ["--compare", "--jobs", "1", "--json", str(out),
                                           "--plot", str(plot)])
    assert status == 0
    data = json.loads(out.read_text())
    assert set(data) == {"off", "on"}
    for summary in data.values():
        assert set(SUMMARY_KEYS) <= set(summary)
        assert summary["finished"] == 12
        assert summary["output_tok_s"] > 0 and summary["tpot_mean_ms"] > 0
    assert data["off"]["gated_rank_steps"] == 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "output tok/s" in table and "balance off" in table and "balance on" in table
    assert "paper" not in table  # the paper's figures are for the preset's workload only


def test_paper_columns_only_for_the_preset_workload() -> None:
    preset = simulate_dp.PRESETS["rfc-dsv31"]
    assert simulate_dp.same_workload(dataclasses.replace(preset.settings, gate="cap-1"), preset)
    assert not simulate_dp.same_workload(dataclasses.replace(preset.settings, dp_size=8), preset)


def test_parallel_compare_matches_sequential(tmp_path: Path) -> None:
    """--jobs 2 forks the runs; the figures are the same as in one process."""
    results = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"{jobs}.json"
        assert simulate_dp.main(TINY_ARGS + ["--compare", "--jobs", jobs, "--json", str(out)]) == 0
        results[jobs] = {name: {k: v for k, v in s.items() if k != "sim_wall_s"}
                         for name, s in json.loads(out.read_text()).items()}
    assert results["1"] == results["2"]


def test_symmetric_workload_shows_no_effect(tiny_model: Path) -> None:
    """Identical requests, all sent at once, evenly routed: every rank is the same, so the gate
    changes nothing (the effect needs asymmetry between ranks)."""
    symmetric = dataclasses.replace(TINY, output_spread=0.0, concurrency=8, num_requests=16)
    off = run(symmetric, PROFILE, balance=False, model_dir=tiny_model).summary
    on = run(symmetric, PROFILE, balance=True, model_dir=tiny_model).summary
    strip = {"sim_wall_s", "gated_rank_steps"}
    assert {k: v for k, v in off.items() if k not in strip} == \
        {k: v for k, v in on.items() if k not in strip}


def test_asymmetric_workload_batches_admissions(tiny_model: Path) -> None:
    """With output-length spread, balance on admits in fewer steps and stalls decode less."""
    off = run(TINY, PROFILE, balance=False, model_dir=tiny_model).summary
    on = run(TINY, PROFILE, balance=True, model_dir=tiny_model).summary
    assert off["finished"] == on["finished"] == TINY.num_requests
    assert on["gated_rank_steps"] > 0
    assert on["admission_steps"] < off["admission_steps"]
    assert on["stalled_decode_steps"] < off["stalled_decode_steps"]


@pytest.mark.parametrize("gate", ["cap", "cap-1"])
def test_gate_rule_reaches_the_schedulers(tiny_model: Path, gate: str) -> None:
    cluster = LockstepCluster(tiny_model, dp_size=2, max_num_seqs=4, max_num_batched_tokens=256,
                              max_model_len=200, balance=True, gate=gate)
    expected = BalanceScheduler if gate == "cap" else CapMinusOneScheduler
    assert all(type(s) is expected for s in cluster.schedulers)
    assert cluster.schedulers[0].balance_gate_threshold == (4 if gate == "cap" else 3)


def test_lockstep_step_emulates_the_gather(tiny_model: Path) -> None:
    cluster = LockstepCluster(tiny_model, dp_size=3, max_num_seqs=4, max_num_batched_tokens=256,
                              max_model_len=200, balance=True, gate="cap")
    for index in range(4):
        cluster.schedulers[0].add_request(sim_request(str(index), RequestShape(30, 5), 0.0))
    cluster.schedulers[2].add_request(sim_request("9", RequestShape(300 // 3, 5), 0.0))
    work = cluster.schedule()
    assert [w.admitted for w in work] == [4, 0, 1]
    assert work[0].prefill_tokens == 120 and work[1].prefill_tokens == 0
    produced, finished = cluster.finish()
    assert sorted(produced) == ["0", "1", "2", "3", "9"] and finished == []
    # What balance_gather would have left on every rank: everyone's len(running).
    for scheduler in cluster.schedulers:
        assert [int(t.item()) for t in scheduler.balance_queue] == [4, 0, 1]
    assert cluster.gate_closed()  # rank 0 is at its cap
    work = cluster.schedule()
    assert [w.decode_requests for w in work] == [4, 0, 1]
    cluster.finish()


def test_balance_off_leaves_the_queue_alone(tiny_model: Path) -> None:
    cluster = LockstepCluster(tiny_model, dp_size=2, max_num_seqs=4, max_num_batched_tokens=256,
                              max_model_len=200, balance=False, gate="cap")
    cluster.schedulers[0].add_request(sim_request("0", RequestShape(10, 3), 0.0))
    cluster.schedule()
    cluster.finish()
    assert not cluster.gate_closed()
    assert not any(hasattr(s, "balance_queue") for s in cluster.schedulers)  # vLLM's own class
