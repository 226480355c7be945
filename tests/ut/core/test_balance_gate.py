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
"""The balance gate on real vLLM schedulers: when it closes, what it keeps, what it never does."""

from __future__ import annotations

import ast
import inspect
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from offline_vllm import build_scheduler, emulate_gather, make_request, make_vllm_config, step
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ascend.core import balance_scheduler as balance_module
from vllm_ascend.core.balance_scheduler import (
    BalanceAsyncScheduler,
    BalanceScheduler,
    balance_scheduler_class,
)
from vllm_ascend_balance.patch_balance_schedule import balance_scheduling_flag, decide

CAP = 4


def gathered(scheduler: Any, counts: list[int]) -> None:
    """What balance_gather would have left on this rank after the previous step."""
    emulate_gather([scheduler], counts)


def new_ids(output: Any) -> list[str]:
    return [r.req_id for r in output.scheduled_new_reqs]


def trace(scheduler: Any, arrivals: dict[int, list[Any]], steps: int) -> list[tuple]:
    """Per step: admitted ids, scheduled tokens, preempted ids, finished ids."""
    seen = []
    for index in range(steps):
        for request in arrivals.get(index, []):
            scheduler.add_request(request)
        output, engine_outputs = step(scheduler)
        finished = sorted(
            o.request_id for eo in engine_outputs.values() for o in eo.outputs if o.finish_reason is not None
        )
        seen.append(
            (new_ids(output), dict(output.num_scheduled_tokens), sorted(output.preempted_req_ids or ()), finished)
        )
    return seen


def random_arrivals(seed: int, count: int = 24) -> dict[int, list[Any]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[Any]] = {}
    for i in range(count):
        arrivals.setdefault(rng.randrange(20), []).append(
            make_request(f"r{seed}-{i}", num_prompt_tokens=rng.randrange(4, 120), max_tokens=rng.randrange(1, 12))
        )
    return arrivals


@pytest.fixture
def config(tiny_model: Path) -> Any:
    return make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2)


# ---- the switch ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, False)])
def test_flag_values(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool) -> None:
    if value is None:
        monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", value)
    assert balance_scheduling_flag() is expected


@pytest.mark.parametrize("value", ["true", "2", "", " 1", "on"])
def test_bad_flag_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", value)
    with pytest.raises(ValueError, match=r"VLLM_ASCEND_BALANCE_SCHEDULING=.*accepted values"):
        balance_scheduling_flag()


@pytest.mark.parametrize("flag", ["0", "yes"])
def test_the_class_decides_not_the_switches(monkeypatch: pytest.MonkeyPatch, config: Any, flag: str) -> None:
    """The decision is made once, by the wiring; a balanced class gates whatever the switches say now."""
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", flag)
    scheduler = build_scheduler(BalanceScheduler, config)
    gathered(scheduler, [0, CAP])
    assert scheduler.balance_gate_closed()


# ---- construction ---------------------------------------------------------------------------


def test_constructor_takes_vllm_arguments_positionally_too(balance_on: None, config: Any) -> None:
    keyword_built = build_scheduler(BalanceScheduler, config)
    names = list(inspect.signature(Scheduler.__init__).parameters)[1:5]
    assert names == ["vllm_config", "kv_cache_config", "structured_output_manager", "block_size"]
    positional = BalanceScheduler(config, keyword_built.kv_cache_config, keyword_built.structured_output_manager, 16)
    assert isinstance(positional, Scheduler) and len(positional.balance_queue) == 2


def test_balance_queue_is_one_int32_cpu_tensor_per_rank(balance_on: None, tiny_model: Path) -> None:
    scheduler = build_scheduler(BalanceScheduler, make_vllm_config(tiny_model, dp_size=3))
    assert len(scheduler.balance_queue) == 3
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" and t.shape == (1,) for t in scheduler.balance_queue)


def test_balanced_classes_wrap_what_vllm_would_use() -> None:
    assert balance_scheduler_class(Scheduler) is BalanceScheduler
    assert balance_scheduler_class(AsyncScheduler) is BalanceAsyncScheduler
    assert balance_scheduler_class(BalanceScheduler) is BalanceScheduler
    assert issubclass(BalanceAsyncScheduler, AsyncScheduler)


# ---- the gate --------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler_cls", [BalanceScheduler, BalanceAsyncScheduler])
def test_gate_freezes_admission_while_any_rank_is_at_cap(
    balance_on: None, tiny_model: Path, scheduler_cls: type
) -> None:
    config = make_vllm_config(
        tiny_model, max_num_seqs=CAP, dp_size=2, async_scheduling=scheduler_cls is BalanceAsyncScheduler
    )
    scheduler = build_scheduler(scheduler_cls, config)
    first = [make_request(f"a{i}", max_tokens=50) for i in range(2)]
    for request in first:
        scheduler.add_request(request)
    assert new_ids(step(scheduler)[0]) == ["a0", "a1"]

    later = [make_request(f"b{i}", max_tokens=50) for i in range(3)]
    for request in later:
        scheduler.add_request(request)
    gathered(scheduler, [2, CAP])  # the other rank is at its cap
    for _ in range(3):
        output, _ = step(scheduler)
        assert new_ids(output) == []
        # Running requests keep decoding while the gate is closed.
        assert set(output.num_scheduled_tokens) == {"a0", "a1"}
    assert [r.request_id for r in scheduler.waiting] == ["b0", "b1", "b2"]  # FCFS kept
    assert scheduler.balance_gated_steps == 3
    assert scheduler.pause_state == PauseState.UNPAUSED

    gathered(scheduler, [2, CAP - 1])  # no rank at cap any more
    output, _ = step(scheduler)
    assert new_ids(output) == ["b0", "b1"]  # local cap 4 allows two more, in order
    assert [r.request_id for r in scheduler.waiting] == ["b2"]


def test_the_threshold_is_the_cap_and_a_subclass_may_move_it(config: Any) -> None:
    class CloseOneEarlier(BalanceScheduler):  # how the simulator measures the reverted cap-1 rule
        @property
        def balance_gate_threshold(self) -> int:
            return self.max_num_running_reqs - 1

    scheduler = build_scheduler(BalanceScheduler, config)
    assert scheduler.balance_gate_threshold == CAP
    gathered(scheduler, [0, CAP - 1])
    assert not scheduler.balance_gate_closed()
    earlier = build_scheduler(CloseOneEarlier, config)
    earlier.add_request(make_request("a"))
    gathered(earlier, [0, CAP - 1])
    assert earlier.balance_gate_closed()
    assert new_ids(step(earlier)[0]) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_open_gate_schedules_exactly_like_stock_vllm(tiny_model: Path, seed: int, async_scheduling: bool) -> None:
    def run(scheduler_cls: type, counts: list[int]) -> list[tuple]:
        config = make_vllm_config(
            tiny_model, max_num_seqs=CAP, dp_size=2, num_blocks=40, async_scheduling=async_scheduling
        )
        scheduler = build_scheduler(scheduler_cls, config)
        if hasattr(scheduler, "balance_queue"):
            gathered(scheduler, counts)
        return trace(scheduler, random_arrivals(seed), steps=60)

    stock_cls = AsyncScheduler if async_scheduling else Scheduler
    ours_cls = BalanceAsyncScheduler if async_scheduling else BalanceScheduler
    stock = run(stock_cls, [])
    assert run(ours_cls, [0, CAP - 1]) == stock  # gate open
    assert sum(len(t[3]) for t in stock) == 24  # every request finished


def test_dp_size_one_warns_and_never_gathers(balance_on: None, tiny_model: Path, mocker: Any) -> None:
    all_gather = mocker.patch.object(balance_module.dist, "all_gather")
    warning_once = mocker.patch.object(balance_module.logger, "warning_once")
    scheduler = build_scheduler(BalanceScheduler, make_vllm_config(tiny_model, dp_size=1))
    scheduler.balance_gather(dp_group=None)
    all_gather.assert_not_called()
    warning_once.assert_called_once()
    assert "no effect" in warning_once.call_args.args[0]


# ---- pause states ------------------------------------------------------------------------------


def _running_and_waiting(config: Any) -> Any:
    scheduler = build_scheduler(BalanceScheduler, config)
    scheduler.add_request(make_request("run", max_tokens=50))
    step(scheduler)
    scheduler.add_request(make_request("wait", max_tokens=50))
    return scheduler


@pytest.mark.parametrize("gate_closed", [False, True])
def test_paused_all_schedules_nothing(balance_on: None, config: Any, gate_closed: bool) -> None:
    scheduler = _running_and_waiting(config)
    gathered(scheduler, [CAP if gate_closed else 0, 0])
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    output, _ = step(scheduler)
    assert output.total_num_scheduled_tokens == 0
    assert scheduler.pause_state == PauseState.PAUSED_ALL
    assert scheduler.balance_gated_steps == 0  # a real pause is never "overridden" by the gate


@pytest.mark.parametrize("gate_closed", [False, True])
def test_paused_new_schedules_running_only(balance_on: None, config: Any, gate_closed: bool) -> None:
    scheduler = _running_and_waiting(config)
    gathered(scheduler, [CAP if gate_closed else 0, 0])
    scheduler.set_pause_state(PauseState.PAUSED_NEW)
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"run"} and new_ids(output) == []
    assert scheduler.pause_state == PauseState.PAUSED_NEW  # still paused after the step
    scheduler.set_pause_state(PauseState.UNPAUSED)
    assert new_ids(step(scheduler)[0]) == ([] if gate_closed else ["wait"])


def test_a_pause_set_during_a_gated_step_is_kept(balance_on: None, config: Any) -> None:
    scheduler = _running_and_waiting(config)
    gathered(scheduler, [0, CAP])
    seen_inside: list[PauseState] = []
    original_new_step = scheduler.kv_cache_manager.new_step_starts

    def pause_mid_step() -> None:  # vLLM pauses only between steps; a plugin could do it inside one
        seen_inside.append(scheduler.pause_state)
        scheduler.set_pause_state(PauseState.PAUSED_ALL)
        original_new_step()

    scheduler.kv_cache_manager.new_step_starts = pause_mid_step
    step(scheduler)
    assert seen_inside == [PauseState.PAUSED_NEW]  # the gate, as the seam guard allows
    assert scheduler.pause_state == PauseState.PAUSED_ALL


def test_vllm_changes_the_pause_state_only_between_steps() -> None:
    """Why the gate restores UNPAUSED only from its own PAUSED_NEW: nothing that runs inside schedule() pauses."""
    import vllm.v1.engine.core as engine_core_module

    tree = ast.parse(inspect.getsource(engine_core_module))
    callers = {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for call in ast.walk(function)
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "set_pause_state"
    }
    assert callers and callers.isdisjoint({"step", "step_with_batch_queue", "schedule"}), callers


def test_gate_state_is_restored_when_schedule_raises(balance_on: None, config: Any) -> None:
    scheduler = _running_and_waiting(config)
    gathered(scheduler, [CAP, 0])

    def fail() -> None:
        raise RuntimeError("boom")

    scheduler.kv_cache_manager.new_step_starts = fail
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.schedule()
    assert scheduler._pause_state == PauseState.UNPAUSED


# ---- forwarding and foreign classes -------------------------------------------------------------


def test_schedule_arguments_are_forwarded_untouched(balance_on: None, config: Any) -> None:
    received: list[tuple] = []

    class ThrottlingScheduler(Scheduler):  # type: ignore[misc,valid-type]
        def schedule(self, throttle_prefills: bool = False, *rest: Any, **extra: Any) -> Any:
            received.append((throttle_prefills, rest, extra))
            return super().schedule()

    scheduler = build_scheduler(balance_scheduler_class(ThrottlingScheduler), config)
    scheduler.schedule(True, "x", key=1)
    gathered(scheduler, [CAP, 0])
    scheduler.schedule(True)
    assert received == [(True, ("x",), {"key": 1}), (True, (), {})]


class EagerScheduler(Scheduler):  # type: ignore[misc,valid-type]
    """Admits the oldest waiting request before vLLM's schedule(), whatever the pause state."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.waiting:
            self.running.append(self.waiting.pop_request())
        return super().schedule(*args, **kwargs)


def test_a_class_that_ignores_the_seam_is_refused(balance_on: None, config: Any) -> None:
    with pytest.raises(
        RuntimeError, match=r"(?s)cannot gate BalanceEagerScheduler.*admission outside the UNPAUSED guard"
    ):
        build_scheduler(balance_scheduler_class(EagerScheduler), config)


def test_vllm_ascends_dynamic_batch_scheduler_is_refused(balance_on: None, config: Any) -> None:
    try:
        from vllm_ascend.core.scheduler_dynamic_batch import SchedulerDynamicBatch
    except ImportError:
        pytest.skip("this line's vllm-ascend has no SchedulerDynamicBatch (removed on main)")
    with pytest.raises(RuntimeError, match=r"SchedulerDynamicBatch.*outside the UNPAUSED guard"):
        build_scheduler(balance_scheduler_class(SchedulerDynamicBatch), config)


def test_pd_disaggregated_role_is_refused_by_the_decision(balance_on: None, tiny_model: Path) -> None:
    from vllm.config import KVTransferConfig

    for role in ("kv_producer", "kv_consumer"):
        config = make_vllm_config(
            tiny_model, dp_size=2, kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role=role)
        )
        with pytest.raises(ValueError, match=f"kv_role='{role}'.*PD-mixed"):
            decide(config)


def test_ray_dp_backend_is_served_by_the_decision(balance_on: None, tiny_model: Path) -> None:
    """Ray's MoE DP actors run the gather (the Ray route, tests/ut/engine/test_engine_route.py): not refused."""
    config = make_vllm_config(tiny_model, dp_size=2)
    config.parallel_config.data_parallel_backend = "ray"
    assert decide(config)
