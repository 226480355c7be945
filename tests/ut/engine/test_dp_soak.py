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
"""A short run of scripts/dp_soak.py (real processes, gloo group, hook, schedulers) and its
failure detection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dp_soak
import pytest


def test_short_soak_finishes_everything_with_equal_gathers(balance_on: None, tiny_moe_model: Path) -> None:
    summary = dp_soak.run_soak(dp=2, requests=40, seed=1, scenario="all", timeout=240, model_dir=tiny_moe_model)
    assert summary["ok"], "\n".join(summary["problems"])
    assert summary["submitted"] == summary["finished"] == 40
    assert not summary["hung"] and summary["max_step_skew"] == 0
    first, second = summary["gathers_per_rank"]
    assert first == second > 0
    assert set(summary["scenarios"]) == {"uneven", "idle-rank", "waves", "blocked", "random"}
    # The gate did close: the run exercised frozen admission, not just an open gate.
    assert sum(sum(s["gated_steps_per_rank"]) for s in summary["scenarios"].values()) > 0


def test_watchdog_kills_and_reports_a_run_past_its_timeout(balance_on: None, tiny_moe_model: Path) -> None:
    # Rank 1 never joins the DP group, so rank 0 waits for it in vLLM's group set-up: the run
    # cannot finish however fast the machine is.
    summary = dp_soak.run_soak(
        dp=2, requests=4, seed=1, scenario="uneven", timeout=2, model_dir=tiny_moe_model, stall_rank=1
    )
    assert summary["hung"] and not summary["ok"]
    for rank in (0, 1):
        assert f"dp-soak-rank{rank} still running at the timeout (killed)" in summary["problems"]


def test_stock_ranks_are_refused_and_nothing_hangs(
    balance_on: None, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_AGREEMENT_TIMEOUT_S", "3")
    summary = dp_soak.run_soak(
        dp=3, requests=4, seed=1, scenario="uneven", timeout=90, model_dir=tiny_moe_model, stock_ranks=(1,)
    )
    assert summary["ok"] and summary["refused"] and not summary["hung"], summary["problems"]
    assert sorted(summary["refusals"]) == [0, 2]
    assert all("DP rank(s) [1] did not announce it" in line for line in summary["refusals"].values())
    assert summary["seconds_to_last_exit"] < 90


def _rank(
    gathers: int, submitted: list[str], finished: list[str], digest: str = "d", waves: list[int] | None = None
) -> dict[str, Any]:
    data = {
        "submitted": submitted,
        "finished": finished,
        "gathers": gathers,
        "wave_steps": waves or [gathers],
        "digest": digest,
        "own_slot_mismatches": 0,
        "gate_violations": [],
        "gated_steps": 0,
        "balance_gated_steps": 0,
        "dummy_steps": 0,
        "left_in_scheduler": 0,
    }
    return {"scenarios": {"s": data}}


def test_summary_accepts_a_clean_run() -> None:
    summary = dp_soak.summarize([_rank(5, ["a"], ["a"]), _rank(5, [], [])], ["s"], [])
    assert summary["ok"] and summary["finished"] == 1


@pytest.mark.parametrize(
    "results, hung, problem",
    [
        ([_rank(5, ["a"], []), _rank(5, [], [])], [], "never finished"),
        ([_rank(5, ["a"], ["a", "a"]), _rank(5, [], [])], [], "finished twice"),
        ([_rank(5, ["a"], ["a"]), _rank(6, [], [], waves=[5])], [], "unequal gathers"),
        ([_rank(5, ["a"], ["a"]), _rank(5, [], [], digest="x")], [], "different balance_queue"),
        ([_rank(5, ["a"], ["a"]), _rank(5, [], [], waves=[2, 3])], [], "different numbers of waves"),
        ([_rank(5, ["a"], ["a"]), None], ["dp-soak-rank1"], "still running at the timeout"),
        ([_rank(5, ["a"], ["a"]), {"error": "Traceback: boom"}], [], "rank 1 failed"),
    ],
)
def test_summary_reports_each_failure(results: list[Any], hung: list[str], problem: str) -> None:
    summary = dp_soak.summarize(results, ["s"], hung)
    assert not summary["ok"]
    assert any(problem in p for p in summary["problems"]), summary["problems"]


@pytest.mark.parametrize(
    "results, problem",
    [
        (
            [{"error": "x\nRuntimeError: Balance scheduling: DP rank 0 ...", "ended": 1.0}, {"ended": 2.0}],
            "stock rank 1 did not fail",
        ),
        (
            [{"error": "x\nRuntimeError: connection reset", "ended": 1.0}, {"error": "y", "ended": 2.0}],
            "balanced rank 0 was not refused",
        ),
        ([None, {"error": "y", "ended": 2.0}], "rank 0 wrote no result"),
    ],
)
def test_mismatch_summary_reports_each_failure(results: list[Any], problem: str) -> None:
    summary = dp_soak.summarize_mismatch(results, [1], [])
    assert not summary["ok"]
    assert any(problem in p for p in summary["problems"]), summary["problems"]


def test_cli_exit_code_follows_the_summary(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for ok, code in ((True, 0), (False, 1)):
        monkeypatch.setattr(dp_soak, "run_soak", lambda *a, ok=ok, **k: {"ok": ok})
        assert dp_soak.main(["--dp", "2", "--requests", "4"]) == code
    assert capsys.readouterr().out.count('"ok"') == 2
    seen: list[Any] = []
    monkeypatch.setattr(dp_soak, "run_soak", lambda *a, **k: seen.append(k) or {"ok": True})
    assert dp_soak.main(["--dp", "4", "--stock-ranks", "1,3"]) == 0
    assert seen[0]["stock_ranks"] == (1, 3)
