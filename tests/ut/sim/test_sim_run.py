"""Short simulations end to end on real vLLM schedulers (tiny sizes: seconds)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import simulate_dp
from dpsim.cluster import (
    CapMinusOneAsyncScheduler,
    CapMinusOneScheduler,
    LockstepCluster,
    scheduler_class,
    sim_request,
)
from dpsim.costmodel import profile_from_dict
from dpsim.metrics import SUMMARY_KEYS
from dpsim.settings import OFF_ON, POLICIES, SimSettings
from dpsim.simulation import run
from dpsim.workload import RequestShape
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ascend.core.balance_scheduler import BalanceAsyncScheduler, BalanceScheduler

PROFILE = profile_from_dict({"step_overhead_ms": 20, "decode_ms_per_request": 1, "prefill_ms_per_token": 0.05})
OFF, ON = OFF_ON
TINY = SimSettings(
    gate="cap",  # the gate's mechanics: upstream's rule closes from the counts alone
    dp_size=2,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    num_requests=16,
    concurrency=8,
    prompt_tokens=60,
    output_tokens=24,
    output_spread=0.5,
    router="round-robin",
)
TINY_ARGS = [
    "--dp-size",
    "2",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "256",
    "--num-requests",
    "12",
    "--concurrency",
    "8",
    "--prompt-tokens",
    "60",
    "--output-tokens",
    "24",
    "--output-spread",
    "0.5",
    "--no-progress",
    "--set",
    "prefill_ms_per_token=0.05",
    "--set",
    "step_overhead_ms=20",
    "--set",
    "decode_ms_per_request=1",
]


def test_compare_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    status = simulate_dp.main(TINY_ARGS + ["--compare", "--jobs", "1", "--json", str(out), "--plot", str(plot)])
    assert status == 0
    data = json.loads(out.read_text())
    assert set(data) == {"off", "on"}
    for summary in data.values():
        assert set(SUMMARY_KEYS) <= set(summary)
        assert summary["finished"] == 12
        assert summary["output_tok_s"] > 0 and summary["tpot_mean_ms"] > 0
        assert summary["profile"]["num_speculative_tokens"] == 3  # the preset's, kept
    assert data["off"]["gated_rank_steps"] == 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    out_text = capsys.readouterr().out
    assert "output tok/s" in out_text and "balance off" in out_text and "balance on" in out_text
    assert "paper" not in out_text  # the paper's figures are for the preset's workload only
    assert "wall time" in out_text


def test_compare_policies_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "policies.json", tmp_path / "policies.png"
    status = simulate_dp.main(
        TINY_ARGS + ["--compare-policies", "--jobs", "1", "--json", str(out), "--plot", str(plot)]
    )
    assert status == 0
    data = json.loads(out.read_text())
    assert list(data) == [arm.name for arm in POLICIES]
    assert data["off"]["deferred_rank_steps"] == data["on"]["deferred_rank_steps"] == 0
    assert data["interval-2"]["gated_rank_steps"] == 0
    assert data["interval-4"]["deferred_rank_steps"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    header = capsys.readouterr().out.splitlines()[1]
    for label in ("balance off", "balance on", "interval 2", "interval 4", "balance on + interval 2"):
        assert label in header


def test_sweep_prints_one_line_per_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    assert simulate_dp.main(TINY_ARGS + ["--sweep", "acceptance_rate_spread=0,0.3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [entry["value"] for entry in data] == ["0", "0.3"]
    assert data[1]["on"]["profile"]["acceptance_rate_spread"] == 0.3
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("acceptance_rate_spread"))
    assert "tok/s on vs off" in lines[header]
    assert [lines[header + 2].split()[0], lines[header + 3].split()[0]] == ["0", "0.3"]


def test_bad_sweep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        simulate_dp.main(["--sweep", "nope=1,2"])
    assert exc_info.value.code == 2 and "unknown parameter 'nope'" in capsys.readouterr().err


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
        results[jobs] = {
            name: {k: v for k, v in s.items() if k not in {"sim_wall_s", "sim_cpu_s"}}
            for name, s in json.loads(out.read_text()).items()
        }
    assert results["1"] == results["2"]


def test_symmetric_workload_shows_no_effect(tiny_model: Path) -> None:
    """Identical requests, all sent at once, evenly routed, no MTP, no noise: every rank is the
    same, so the gate changes nothing (the effect needs asymmetry between ranks)."""
    symmetric = dataclasses.replace(TINY, output_spread=0.0, concurrency=8, num_requests=16)
    off = run(symmetric, PROFILE, OFF, model_dir=tiny_model).summary
    on = run(symmetric, PROFILE, ON, model_dir=tiny_model).summary
    strip = {"sim_wall_s", "sim_cpu_s", "gated_rank_steps"}
    assert {k: v for k, v in off.items() if k not in strip} == {k: v for k, v in on.items() if k not in strip}


def test_asymmetric_workload_batches_admissions(tiny_model: Path) -> None:
    """With output-length spread, balance on admits in fewer steps and stalls decode less."""
    off = run(TINY, PROFILE, OFF, model_dir=tiny_model).summary
    on = run(TINY, PROFILE, ON, model_dir=tiny_model).summary
    assert off["finished"] == on["finished"] == TINY.num_requests
    assert on["gated_rank_steps"] > 0
    assert on["admission_steps"] < off["admission_steps"]
    assert on["stalled_decode_steps"] < off["stalled_decode_steps"]


def test_first_wave_ttft_is_split_from_the_rest(tiny_model: Path) -> None:
    summary = run(TINY, PROFILE, OFF, model_dir=tiny_model).summary
    assert summary["first_wave_requests"] == TINY.concurrency
    mean = (summary["ttft_first_wave_ms"] * 8 + summary["ttft_later_ms"] * 8) / 16
    assert mean == pytest.approx(summary["ttft_mean_ms"])


def test_one_function_chooses_the_class() -> None:
    assert scheduler_class(False, False) is Scheduler
    assert scheduler_class(False, True) is AsyncScheduler
    assert scheduler_class(True, False) is BalanceScheduler
    assert scheduler_class(True, True) is BalanceAsyncScheduler
    assert scheduler_class(True, False, "cap-1") is CapMinusOneScheduler
    assert scheduler_class(True, True, "cap-1") is CapMinusOneAsyncScheduler
    with pytest.raises(ValueError, match="unknown gate rule"):
        scheduler_class(True, False, "cap-2")


@pytest.mark.parametrize("gate, threshold", [("cap", 4), ("cap-1", 3)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gate_rule_reaches_the_schedulers(tiny_model: Path, gate: str, threshold: int, async_scheduling: bool) -> None:
    cluster = LockstepCluster(
        tiny_model,
        dp_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=200,
        balance=True,
        gate=gate,
        async_scheduling=async_scheduling,
    )
    assert all(type(s) is scheduler_class(True, async_scheduling, gate) for s in cluster.schedulers)
    assert cluster.schedulers[0].balance_gate_threshold == threshold
    cluster.schedulers[1].balance_queue[0].fill_(threshold)
    cluster.schedulers[1].balance_update()
    assert cluster.schedulers[1].balance_gate_closed()


def test_lockstep_step_emulates_the_gather(tiny_model: Path) -> None:
    cluster = LockstepCluster(
        tiny_model, dp_size=3, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=200, balance=True, gate="cap"
    )
    for index in range(4):
        cluster.schedulers[0].add_request(sim_request(str(index), RequestShape(30, 5), 0.0))
    cluster.schedulers[2].add_request(sim_request("9", RequestShape(300 // 3, 5), 0.0))
    batch = cluster.schedule(step_counter=0)
    assert [w.admitted for w in batch.work] == [4, 0, 1]
    assert batch.work[0].prefill_tokens == 120 and batch.work[1].prefill_tokens == 0
    assert batch.outputs[1] is None  # rank 1 has nothing: a dummy batch
    produced, finished = cluster.finish(batch, lambda request_id, drafts: 0)
    assert sorted(r for r, _ in produced) == ["0", "1", "2", "3", "9"] and finished == []
    cluster.gather()
    # What balance_gather would have left on every rank: everyone's len(running).
    for scheduler in cluster.schedulers:
        assert [int(t.item()) for t in scheduler.balance_queue] == [4, 0, 1]
    assert cluster.gate_closed()  # rank 0 is at its cap
    batch = cluster.schedule(step_counter=1)
    assert [w.decode_requests for w in batch.work] == [4, 0, 1]
    cluster.finish(batch, lambda request_id, drafts: 0)


def test_balance_off_is_vllms_own_scheduler(tiny_model: Path) -> None:
    cluster = LockstepCluster(
        tiny_model, dp_size=2, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=200, balance=False
    )
    assert all(type(s) is Scheduler for s in cluster.schedulers)
    cluster.schedulers[0].add_request(sim_request("0", RequestShape(10, 3), 0.0))
    cluster.finish(cluster.schedule(0), lambda request_id, drafts: 0)
    cluster.gather()
    assert not cluster.gate_closed() and cluster.gated_steps() == 0


def test_recalibrating_sweep_refits_each_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--sweep ... --recalibrate fits the costs on the baseline row again for every value."""
    preset = simulate_dp.Preset(
        description="tiny",
        settings=dataclasses.replace(TINY, num_requests=12),
        paper={"off": {"tpot_mean_ms": 60.0, "ttft_mean_ms": 300.0}},
        calibrate_on=("tpot_mean_ms",),
    )
    monkeypatch.setitem(simulate_dp.PRESETS, "tiny", preset)
    out = tmp_path / "sweep.json"
    status = simulate_dp.main(
        [
            "--preset",
            "tiny",
            "--no-progress",
            "--jobs",
            "1",
            "--sweep",
            "step_noise_cv=0,0.1",
            "--recalibrate",
            "--set",
            "step_overhead_ms=20",
            "--set",
            "decode_ms_per_request=1",
            "--set",
            "prefill_ms_per_token=0.05",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    data = json.loads(out.read_text())
    for entry in data:
        assert entry["off"]["tpot_mean_ms"] == pytest.approx(60.0, rel=0.01)
    fitted = [entry["off"]["profile"]["prefill_ms_per_token"] for entry in data]
    assert fitted[0] != fitted[1] and all(f != 0.05 for f in fitted)
    assert "fitted costs" in capsys.readouterr().out
