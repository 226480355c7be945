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
"""The balance gate and vLLM's own prefill throttle (``--prefill-schedule-interval``) compose.

vLLM >= 0.24 passes ``schedule(throttle_prefills=...)`` from the DP engine core on steps that are not
cadence-aligned. The mixin forwards it untouched, so a step admits a new request only when both say
so: the gate open and the throttle off. With the gate open, a throttled step is exactly vLLM's.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from offline_vllm import build_scheduler, emulate_gather, fake_model_output, make_request, make_vllm_config, step
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ascend.core.balance_scheduler import BalanceScheduler

CAP = 4

pytestmark = pytest.mark.skipif(
    "throttle_prefills" not in inspect.signature(Scheduler.schedule).parameters,
    reason="this vLLM's Scheduler.schedule() has no throttle_prefills parameter (added in vLLM 0.24)",
)


def _decoding_plus_one_waiting(scheduler_cls: type, config: Any) -> Any:
    """A scheduler with one request past its prefill (decoding) and one new request waiting: the
    state in which vLLM's throttle defers new prefills."""
    scheduler = build_scheduler(scheduler_cls, config)
    if isinstance(scheduler, BalanceScheduler):
        emulate_gather([scheduler], [0, 0])
    scheduler.add_request(make_request("decoding", num_prompt_tokens=8, max_tokens=20))
    step(scheduler)
    assert not scheduler.requests["decoding"].is_prefill_chunk
    scheduler.add_request(make_request("new", num_prompt_tokens=8, max_tokens=4))
    return scheduler


def _admitted(output: Any) -> list[str]:
    return [r.req_id for r in output.scheduled_new_reqs]


@pytest.fixture
def config(tiny_model: Path) -> Any:
    return make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2)


@pytest.mark.parametrize(
    "gate_closed, throttle, admitted",
    [(False, False, True), (False, True, False), (True, False, False), (True, True, False)],
    ids=["both-open", "throttle-only", "gate-only", "both"],
)
def test_a_step_admits_only_when_neither_gate_nor_throttle_says_no(
    balance_on: None, config: Any, gate_closed: bool, throttle: bool, admitted: bool
) -> None:
    scheduler = _decoding_plus_one_waiting(BalanceScheduler, config)
    emulate_gather([scheduler], [CAP, 0] if gate_closed else [0, 0])
    output = scheduler.schedule(throttle)
    assert _admitted(output) == (["new"] if admitted else [])
    # Running requests keep decoding either way.
    assert output.num_scheduled_tokens["decoding"] == 1
    assert scheduler.balance_gated_steps == int(gate_closed)


@pytest.mark.parametrize("throttle", [True, False])
def test_with_the_gate_open_a_step_is_vllms_including_its_throttle(
    balance_on: None, config: Any, throttle: bool
) -> None:
    stock = _decoding_plus_one_waiting(Scheduler, config)
    balanced = _decoding_plus_one_waiting(BalanceScheduler, config)
    for _ in range(3):
        expected, got = stock.schedule(throttle_prefills=throttle), balanced.schedule(throttle_prefills=throttle)
        assert (_admitted(got), got.num_scheduled_tokens) == (_admitted(expected), expected.num_scheduled_tokens)
        # The throttle's own state (vLLM's "was the last releasing step capacity-bound") evolves alike.
        assert balanced.prefill_capacity_bound == stock.prefill_capacity_bound
        for scheduler, output in ((stock, expected), (balanced, got)):
            scheduler.update_from_output(output, fake_model_output(scheduler, output))
        emulate_gather([balanced], [0, 0])
    assert balanced.balance_gated_steps == 0


def test_a_gated_step_leaves_the_throttles_state_alone(balance_on: None, config: Any) -> None:
    """A gated step skips the admission block, so vLLM's record of the last prefill-releasing step
    (``prefill_capacity_bound``) is not overwritten by a step that released nothing."""
    scheduler = _decoding_plus_one_waiting(BalanceScheduler, config)
    scheduler.prefill_capacity_bound = True
    emulate_gather([scheduler], [CAP, 0])
    scheduler.schedule(False)
    assert scheduler.prefill_capacity_bound is True
    emulate_gather([scheduler], [0, 0])
    assert _admitted(scheduler.schedule(False)) == ["new"]
    assert scheduler.prefill_capacity_bound is False
