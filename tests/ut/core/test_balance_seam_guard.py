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
"""Guard tests: fail loudly, with a message naming the seam, when the installed vLLM moves it.

Balance scheduling copies no vLLM code; it relies on a few properties of the installed vLLM.
Each test here pins one of them by inspecting upstream's source, so a vLLM upgrade that breaks
one is caught here rather than as a scheduler that silently stops balancing.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin
from vllm_ascend.core.balance_seam import CAP_COUNTS, inspect_schedule, schedule_seam, schedule_shape

# Methods of vLLM's Scheduler that read ``_pause_state`` directly. Code among them that runs
# *inside* schedule() sees the gate's transient PAUSED_NEW; a new reader must be reviewed.
KNOWN_PAUSE_STATE_READERS = {
    "__init__",
    "schedule",
    "pause_state",
    "set_pause_state",
    "get_num_unfinished_requests",
}


def _methods_reading(cls: type, attribute: str) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef)
    readers = set()
    for node in class_def.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(isinstance(n, ast.Attribute) and n.attr == attribute for n in ast.walk(node)):
                readers.add(node.name)
    return readers


def test_pause_state_has_the_three_states_the_gate_uses() -> None:
    assert {s.name for s in PauseState} >= {"UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"}, (
        "vLLM's PauseState lost a member the balance gate relies on"
    )


@pytest.mark.parametrize("scheduler_cls", [Scheduler, AsyncScheduler])
def test_admission_only_under_the_unpaused_guard(scheduler_cls: type) -> None:
    problems = schedule_seam(scheduler_cls).problems
    assert not problems, (
        "SEAM MOVED: vLLM's schedule() no longer keeps all waiting-request admission under "
        "`self._pause_state == PauseState.UNPAUSED`, so the balance gate (a transient "
        "PAUSED_NEW) would not stop admissions. Revisit vllm_ascend/core/balance_seam.py:\n" + "\n".join(problems)
    )


def test_upstream_schedule_has_admission_sites_to_guard() -> None:
    shape = inspect_schedule(Scheduler)
    # 0.18.0 has peeks/pops of the waiting queues, the queue selector and running.append.
    assert shape.admissions >= 3, (
        f"SEAM MOVED: only {shape.admissions} admission sites found in "
        "Scheduler.schedule(); admission may have moved into a helper the check cannot see"
    )


def test_pause_state_readers_are_the_reviewed_ones() -> None:
    readers = _methods_reading(Scheduler, "_pause_state")
    assert readers == KNOWN_PAUSE_STATE_READERS, (
        f"SEAM MOVED: methods of vLLM's Scheduler reading _pause_state changed: new "
        f"{sorted(readers - KNOWN_PAUSE_STATE_READERS)}, gone "
        f"{sorted(KNOWN_PAUSE_STATE_READERS - readers)}. A new reader called during schedule() "
        "would observe the gate's transient PAUSED_NEW: review it and update the README."
    )


def test_the_check_detects_an_unguarded_admission() -> None:
    class AdmitsWithoutGuard(Scheduler):  # type: ignore[misc,valid-type]
        def schedule(self):  # type: ignore[no-untyped-def]
            request = self.waiting.pop_request()
            self.running.append(request)
            return super().schedule()

    problems = schedule_seam(AdmitsWithoutGuard).problems
    assert len([p for p in problems if "outside the UNPAUSED guard" in p]) == 2, problems


def test_the_check_detects_paused_new_given_another_meaning() -> None:
    class SpecialCasesPausedNew(Scheduler):  # type: ignore[misc,valid-type]
        def schedule(self):  # type: ignore[no-untyped-def]
            if self._pause_state == PauseState.PAUSED_NEW:
                self.running.clear()
            return super().schedule()

    problems = schedule_seam(SpecialCasesPausedNew).problems
    assert problems and "unexpected way" in problems[0]


def test_the_check_detects_admission_moved_out_of_schedule() -> None:
    class AdmitsInAHelper(Scheduler):  # type: ignore[misc,valid-type]
        def schedule(self):  # type: ignore[no-untyped-def]
            return self._schedule_everything()

    problems = schedule_seam(AdmitsInAHelper).problems
    assert problems and "does not call super().schedule()" in problems[0]


def test_the_mixin_itself_is_skipped_and_delegates() -> None:
    assert "schedule" in BalanceSchedulingMixin.__dict__
    assert inspect_schedule(BalanceSchedulingMixin).delegates_to_super


def test_engine_core_loads_plugins_before_resolving_the_scheduler_class() -> None:
    """The activation seam: our vllm.general_plugins entry point must run first."""
    source = textwrap.dedent(inspect.getsource(EngineCore.__init__))
    plugins_at = source.find("load_general_plugins()")
    resolve_at = source.find("get_scheduler_cls()")
    assert 0 <= plugins_at < resolve_at, (
        "SEAM MOVED: EngineCore.__init__ no longer loads general plugins before "
        "get_scheduler_cls(); the balance plugin would be too late to wrap the class"
    )


def test_scheduler_class_is_resolved_through_scheduler_config() -> None:
    assert callable(SchedulerConfig.__dict__.get("get_scheduler_cls")), (
        "SEAM MOVED: SchedulerConfig.get_scheduler_cls is gone; the plugin wraps it"
    )


# ---- the admission cap, and vLLM >= 0.32's shape (KV-holding requests drained under PAUSED_NEW) --------------

SCHEDULE = inspect.getsource(Scheduler.schedule)
MODULE = inspect.getsource(scheduler_module)
CAP = inspect_schedule(Scheduler).cap
needs_held_cap = pytest.mark.skipif(
    CAP is None or not CAP.held_at_zero, reason="vLLM < 0.32: every admission is under the UNPAUSED guard"
)


def replaced(text: str, old: str, new: str) -> str:
    assert old in text, f"test fixture out of date: {old!r} not found"
    return text.replace(old, new)


def test_the_admission_cap_is_one_known_count_and_attribute() -> None:
    assert CAP is not None and CAP.count in CAP_COUNTS, CAP
    assert CAP.attribute in ("max_num_running_reqs", "max_num_active_reqs")
    # Up to 0.31 the cap is also the model runner's slot count (asserted at the end of schedule()): never held at 0.
    assert CAP.held_at_zero == (CAP.attribute == "max_num_active_reqs")


def test_an_unknown_count_is_refused() -> None:
    problems = schedule_shape(replaced(SCHEDULE, CAP.count, f"{CAP.count} + 1"), MODULE).problems
    assert any("not one known cap" in p for p in problems), problems


@needs_held_cap
def test_kv_holding_admission_is_accepted_only_behind_the_held_cap() -> None:
    assert schedule_shape(SCHEDULE, MODULE).problems == []
    # A new admission path outside the loop, inside the block PAUSED_NEW enters.
    altered = replaced(
        SCHEDULE,
        "            while token_budget > 0:\n",
        "            self.running.append(self.kv_holding_waiting.pop_request())\n            while token_budget > 0:\n",
    )
    problems = schedule_shape(altered, MODULE).problems
    assert len([p for p in problems if "outside the UNPAUSED guard" in p]) == 2, problems


@needs_held_cap
def test_a_cap_read_elsewhere_is_not_held_and_the_shape_is_refused() -> None:
    module = MODULE + "\n\ndef _elsewhere(self):\n    return self.max_num_active_reqs\n"
    shape = schedule_shape(SCHEDULE, module)
    assert shape.cap is not None and not shape.cap.held_at_zero
    assert any("outside the UNPAUSED guard" in p for p in shape.problems), shape.problems


@needs_held_cap
def test_a_cap_test_that_zero_would_not_stop_is_refused() -> None:
    altered = replaced(SCHEDULE, ">= self.max_num_active_reqs", "== self.max_num_active_reqs")
    module = replaced(MODULE, ">= self.max_num_active_reqs", "== self.max_num_active_reqs")
    shape = schedule_shape(altered, module)
    assert shape.cap is not None and not shape.cap.held_at_zero and shape.problems
