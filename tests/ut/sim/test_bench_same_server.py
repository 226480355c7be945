#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""The real-engine bench's ``--same-server`` arms, switched on one balanced server by the step trace.

Two servers of one configuration ran identical batches up to 25 % apart, so the bench can compare arms on one server:
the step trace (``tests/e2e_cpu/real_forward/balance_real_forward/step_trace.py``) switches the gate rule and vLLM's
prefill interval between runs. A switch that did nothing would compare an arm with itself and report 0 %, so each
arm is checked here on a real ``BalanceScheduler``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from offline_vllm import build_scheduler, fake_model_output, make_request, make_vllm_config

from vllm_ascend.core.balance_rule import RULE_ENV
from vllm_ascend.core.balance_scheduler import BalanceScheduler, BalanceSchedulingMixin

ROOT = Path(__file__).resolve().parents[3]
CAP = 4


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def step_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load("bench_step_trace", ROOT / "tests/e2e_cpu/real_forward/balance_real_forward/step_trace.py")
    monkeypatch.setenv(module.ARM_FILE_ENV, str(tmp_path / "arm.json"))
    return module


def balanced_scheduler(model: Path) -> BalanceScheduler:
    return build_scheduler(BalanceScheduler, make_vllm_config(model, max_num_seqs=CAP, dp_size=2))


def gathered_a_rank_at_its_cap(scheduler: BalanceScheduler) -> None:
    """Rank 0 at its cap, rank 1 with a free slot that would admit a waiting request; each reports a finished 20 ms
    step (the rows a gather leaves)."""
    scheduler._balance_rows[:] = scheduler._balance_rows.new_tensor([[CAP, 0, 0, 20_000], [CAP - 1, 1, 0, 20_000]])


def test_bench_arms_map_to_a_gate_and_an_interval(step_trace: ModuleType) -> None:
    arms = ("off", "off-b", "balance", "cap", "interval2", "balance+interval2")
    settings = {arm: step_trace.same_server_arm(arm) for arm in arms}
    assert {arm: (s["gate"], s["interval"]) for arm, s in settings.items()} == {
        "off": ("off", 1), "off-b": ("off", 1), "balance": ("adaptive", 1), "cap": ("cap", 1),
        "interval2": ("off", 2), "balance+interval2": ("adaptive", 2),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("arm", "closed", "observed"),
    [("off", False, 0), ("interval2", False, 0), ("cap", True, 0), ("balance", False, 1)],
)
def test_each_arm_decides_the_gate_its_own_way(
    step_trace: ModuleType,
    tiny_moe_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arm: str,
    closed: bool,
    observed: int,
) -> None:
    monkeypatch.delenv(RULE_ENV, raising=False)  # the server's rule: the default, adaptive
    scheduler = balanced_scheduler(tiny_moe_model)
    hold = scheduler._balance_hold
    engine = SimpleNamespace(prefill_schedule_interval=1)
    step_trace._state["engine"] = engine
    (tmp_path / "arm.json").write_text(json.dumps(step_trace.same_server_arm(arm)))
    assert step_trace._read_arm()["arm"] == arm
    assert engine.prefill_schedule_interval == (2 if "interval2" in arm else 1)
    gathered_a_rank_at_its_cap(scheduler)
    scheduler._balance_closed = not closed
    step_trace._armed_update(BalanceSchedulingMixin.balance_update)(scheduler)
    assert scheduler.balance_gate_closed() is closed
    # Only the adaptive arm moves the adaptive rule's state (it has not fitted yet, so it does not hold).
    assert scheduler._balance_hold is hold and hold.steps == observed


def test_a_rank_that_schedules_nothing_switches_its_arm_at_the_gather(
    step_trace: ModuleType, tiny_moe_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank without requests runs dummy batches and never calls ``schedule()``, but it gathers: the arm the bench
    wrote between runs must be in force at its next gather, or the ranks' adaptive states drift apart."""
    monkeypatch.delenv(RULE_ENV, raising=False)
    scheduler = balanced_scheduler(tiny_moe_model)
    step_trace._state["engine"] = None
    arm_file = tmp_path / "arm.json"
    arm_file.write_text(json.dumps(step_trace.same_server_arm("off")))
    assert step_trace._read_arm()["gate"] == "off"  # the previous run's arm, read at a schedule()
    arm_file.write_text(json.dumps(step_trace.same_server_arm("balance")))
    os.utime(arm_file, ns=(1, step_trace._state["arm_mtime"] + 1))  # a new modification time, however coarse the clock
    gathered_a_rank_at_its_cap(scheduler)
    step_trace._armed_update(BalanceSchedulingMixin.balance_update)(scheduler)
    assert scheduler._balance_hold.steps == 1  # learned from this gather: the adaptive arm, no schedule() between


def test_emulated_graph_mode_delays_a_forward_with_a_prefill_only(
    step_trace: ModuleType, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--prefill-penalty-ms``: a worker's forward waits the penalty when its batch prefills, not when it decodes."""
    slept: list[float] = []
    monkeypatch.setattr(step_trace.time, "sleep", slept.append)
    forward = step_trace._penalised_forward(lambda runner, output: output.total_num_scheduled_tokens, 0.07)
    scheduler = balanced_scheduler(tiny_moe_model)
    scheduler.add_request(make_request("a", 12, 4))
    prefill = scheduler.schedule()
    assert forward(None, prefill) == 12 and slept == [0.07]
    scheduler.update_from_output(prefill, fake_model_output(scheduler, prefill))
    decode = scheduler.schedule()
    assert forward(None, decode) == 1 and slept == [0.07]


def _run_of(step_ms: Any, steps: int, cap: int = 32) -> dict[str, Any]:
    """A bench run whose trace has ``steps`` two-rank steps: rank 0 prefills every fourth step, rank 1 every fifth
    (256-2048 tokens), each step lasting ``step_ms(prefill tokens of the group)``. Every 40 steps rank 1 admits a
    request while rank 0 is at its cap with one of its own waiting, which it admits as it leaves its cap the step
    after: a hold would have aligned them."""
    records = []
    for it in range(steps):
        prefill = [256 * (1 + it % 7) * (it % 4 == 0), 256 * (1 + it % 3) * (it % 5 == 0)]
        running, waiting = {10: ([cap, cap - 1], [1, 1]), 11: ([cap - 1, cap], [1, 0])}.get(
            it % 40, ([cap - 2] * 2, [0, 0])
        )
        for rank in range(2):
            dt = step_ms(prefill) / 1000 * (1 + 0.01 * ((it * 7 + rank) % 5))
            row = {"running": running[rank], "waiting": waiting[rank], "prefill_tokens": prefill[rank], "dt": dt}
            records.append({"it": it, "rank": rank, **row})
    return {"regime": "closed-32-fixed", "arm": "off", "rep": 0, "max_num_seqs": cap, "engine": {"records": records}}


def test_the_rule_replayed_on_measured_steps_holds_only_for_a_fixed_extra_beyond_a_decode_step() -> None:
    """``bench_engine.replay_rule`` feeds the product's adaptive rule a run's measured steps: an engine whose prefill
    step costs every rank 300 ms more than its tokens (graph mode) makes it hold; one whose extra is 10 ms beside a
    40 ms decode step (eager) does not."""
    bench = load("bench_engine_replay", ROOT / "scripts/bench_engine.py")
    graph = _run_of(lambda p: 40 + 300 * any(p) + 0.1 * max(p) + 0.05 * sum(p), 400)
    eager = _run_of(lambda p: 40 + 10 * any(p) + 0.1 * max(p) + 0.05 * sum(p), 400)
    (held,), (not_held,) = bench.replay_rule([graph]), bench.replay_rule([eager])
    assert held.startswith("closed-32-fixed off rep 0: holding in ") and "holding in 0 of" not in held, held
    assert "fixed extra 30" in held and "saving 2" in held, held
    assert "holding in 0 of 400 steps" in not_held and "saving 0.0 ms" in not_held, not_held


def _row(arm: str, tok_s: float, tpot: float, ttft: float) -> dict[str, Any]:
    paired = {"output_throughput": tok_s, "mean_tpot_ms": tpot, "mean_ttft_ms": ttft, "mean_e2el_ms": 0.0}
    return {"regime": "closed-32-spread", "arm": arm, "n": 6, "paired": paired}


def test_the_bar_holds_every_arm_but_off_to_all_three_bounds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``bench_engine.bar_verdicts``: tok/s at least 0.98 x off, TTFT at most +10 %, TPOT no worse than off, each
    bound inclusive and each miss named; ``--bar-of`` counts, per arm, the regime runs inside it."""
    bench = load("bench_engine_bar", ROOT / "scripts/bench_engine.py")
    rows = [
        _row("off", 0.0, 0.0, 0.0),
        _row("off-b", -0.02, 0.0, 0.10),
        _row("balance", -0.021, 0.001, 0.101),
        _row("cap", 0.05, -0.01, 0.2),
    ]
    assert bench.bar_verdicts(rows) == [
        "closed-32-spread off-b (6 pairs): inside",
        "closed-32-spread balance (6 pairs): outside: tok/s -2.1%, TTFT ms +10.1%, TPOT ms +0.1%",
        "closed-32-spread cap (6 pairs): outside: TTFT ms +20.0%",
    ]
    summaries = []
    for name, summary_rows in (("a.json", rows), ("b.json", [_row("off", 0, 0, 0), _row("off-c", -0.03, 0, 0)])):
        summaries.append(tmp_path / name)
        summaries[-1].write_text(json.dumps({"args": {"prefill_penalty_ms": "300.0"}, "rows": summary_rows}))
    bench.bar_of(summaries)
    totals = capsys.readouterr().out.splitlines()[-3:]
    assert totals == [
        "off-<tag>: inside the bar in 1 of 2 regime runs",
        "balance: inside the bar in 0 of 1 regime runs",
        "cap: inside the bar in 0 of 1 regime runs",
    ], totals


def test_the_bar_reads_each_bound_s_interval_from_the_pairs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """With six or more pairs each bound's distribution-free 95 % interval for the median is read as shown (wholly
    inside), unresolved (across the bound) or against (wholly outside); below six there is none, and ``--bar-of``
    counts the runs with a bound against only among those with intervals."""
    bench = load("bench_engine_intervals", ROOT / "scripts/bench_engine.py")
    assert bench.median_interval([0.05, 0.01, 0.04, 0.02, 0.03]) is None
    assert bench.median_interval([0.06, 0.01, 0.04, 0.02, 0.03, 0.05]) == (0.01, 0.06)  # the extremes: 96.9 %
    assert bench.median_interval([x / 100 for x in range(12, 0, -1)]) == (0.03, 0.10)  # 3rd of 12 each side: 96.1 %
    row = _row("balance", -0.03, -0.01, 0.02)
    row["pairs"] = {
        "output_throughput": [-0.05, -0.04, -0.03, -0.03, -0.025, -0.021],  # every pair below -2 %
        "mean_tpot_ms": [-0.04, -0.02, -0.01, -0.01, 0.0, 0.03],  # across 0
        "mean_ttft_ms": [-0.1, 0.0, 0.02, 0.02, 0.05, 0.10],  # inside +10 %, the bound inclusive
    }
    inside, against, line = bench.bar_verdict(row)
    assert (inside, against) == (False, True)
    assert line == (
        "closed-32-spread balance (6 pairs): outside: tok/s -3.0%; 95 % intervals: tok/s [-5.0%, -2.1%] against, "
        "TTFT ms [-10.0%, +10.0%] shown, TPOT ms [-4.0%, +3.0%] unresolved"
    ), line
    row["pairs"]["output_throughput"][-1] = 0.01
    assert bench.bar_verdict(row)[:2] == (False, False)  # the median still misses, its interval no longer
    assert bench.bar_verdict(_row("balance", 0.0, 0.0, 0.0))[:2] == (True, None)  # no pairs: a summary before stop 47
    summary = tmp_path / "c.json"
    summary.write_text(json.dumps({"args": {}, "rows": [_row("off", 0, 0, 0), row, _row("balance", -0.03, 0, 0)]}))
    bench.bar_of([summary])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "balance: inside the bar in 0 of 2 regime runs; wholly outside a bound in 0 of the 1 with intervals"
    )
