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
"""Features of vLLM's scheduler that balance scheduling inherits instead of re-implementing.

vllm-ascend's copy of ``schedule()`` re-synced each of these by hand (PauseState, structured
output, remote-KV promotion, streaming input, Mamba split, encoder-cache free, connector stats,
preemption) and lost some (the released copy never admits a JSON-mode request). Here each one is
exercised on a real vLLM scheduler with balance ON, with the gate open (must match stock vLLM)
and closed (the request must wait, not be lost, and be admitted in order once the gate opens).
Pause-state tests live in test_balance_gate.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fake_remote_kv
import pytest
from offline_vllm import (
    build_scheduler,
    emulate_gather,
    fake_model_output,
    make_json_request,
    make_request,
    make_vllm_config,
    step,
)
from vllm.config import KVTransferConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from vllm_ascend.core.balance_scheduler import BalanceScheduler

CAP = 4
CLOSED, OPEN = [CAP, 0], [0, 0]
# A JSON-mode request waiting for its grammar (renamed in vLLM 0.23).
WAITING_FOR_GRAMMAR = (
    getattr(RequestStatus, "WAITING_FOR_FSM", None) or RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
)


def set_gate(scheduler: Any, counts: list[int]) -> None:
    emulate_gather([scheduler], counts)


def admitted(output: Any) -> list[str]:
    return [r.req_id for r in output.scheduled_new_reqs]


def waiting_ids(scheduler: Any) -> list[str]:
    """Every waiting request in the order vLLM takes them: skipped first (up to 0.30), KV-holding first (>= 0.31)."""
    first = getattr(scheduler, "skipped_waiting", None) or getattr(scheduler, "kv_holding_waiting", ())
    return [r.request_id for r in [*first, *scheduler.waiting]]


@pytest.fixture
def balanced(balance_on: None, tiny_model: Path) -> Any:
    return build_scheduler(BalanceScheduler, make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2))


# ---- structured output (JSON mode): WAITING_FOR_FSM (0.23: ..._GRAMMAR) --------------------------------------


def _wait_for_grammar(request: Any) -> None:
    deadline = time.monotonic() + 60
    while request.structured_output_request.grammar is None:
        assert time.monotonic() < deadline, "grammar did not compile"
        time.sleep(0.02)


def test_json_mode_request_is_admitted_with_the_gate_open(balanced: Any) -> None:
    request = make_json_request(balanced.vllm_config, "json")
    assert request.status == WAITING_FOR_GRAMMAR
    balanced.structured_output_manager.grammar_init(request)
    balanced.add_request(request)
    _wait_for_grammar(request)
    # schedule() only: the fake model's token is not valid JSON (vLLM 0.23's grammar rejects it).
    output = balanced.schedule()
    assert admitted(output) == ["json"] and request.status == RequestStatus.RUNNING


def test_json_mode_request_waits_while_gated_then_keeps_its_place(balanced: Any) -> None:
    request = make_json_request(balanced.vllm_config, "json")
    balanced.structured_output_manager.grammar_init(request)
    balanced.add_request(request)
    balanced.add_request(make_request("plain"))
    _wait_for_grammar(request)
    set_gate(balanced, CLOSED)
    for _ in range(2):
        assert admitted(step(balanced)[0]) == []
    assert waiting_ids(balanced) == ["json", "plain"]
    set_gate(balanced, OPEN)
    assert admitted(step(balanced)[0]) == ["json", "plain"]


# ---- remote KV: WAITING_FOR_REMOTE_KVS -> WAITING (or PREEMPTED) --------------------------------


@pytest.fixture
def remote_kv(balance_on: None, tiny_model: Path) -> Any:
    fake_remote_kv.register()
    config = make_vllm_config(
        tiny_model,
        max_num_seqs=CAP,
        dp_size=2,
        kv_transfer_config=(
            KVTransferConfig(
                kv_connector=fake_remote_kv.NAME,
                kv_role="kv_both",
                kv_connector_extra_config={"matched_tokens": 32, "is_async": True},
            )
        ),
    )
    return build_scheduler(BalanceScheduler, config)


def _finish_receiving(scheduler: Any, output: Any, req_id: str) -> None:
    runner_output = fake_model_output(scheduler, output)
    runner_output.kv_connector_output = KVConnectorOutput(finished_recving={req_id})
    scheduler.update_from_output(output, runner_output)


@pytest.mark.parametrize(
    "preempted_before, promoted_to", [(False, RequestStatus.WAITING), (True, RequestStatus.PREEMPTED)]
)
def test_remote_kv_request_is_promoted_only_when_the_gate_opens(
    remote_kv: Any, preempted_before: bool, promoted_to: RequestStatus, mocker: Any
) -> None:
    request = make_request("remote", num_prompt_tokens=40)
    remote_kv.add_request(request)
    output = remote_kv.schedule()  # gate open: the async load starts
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert remote_kv.connector.allocated == ["remote"]
    if preempted_before:
        request.num_preemptions = 1  # e.g. preempted earlier and now resuming from remote KV
    _finish_receiving(remote_kv, output, "remote")

    set_gate(remote_kv, CLOSED)
    output = remote_kv.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # not promoted, not lost
    assert waiting_ids(remote_kv) == ["remote"]
    remote_kv.update_from_output(output, fake_model_output(remote_kv, output))

    set_gate(remote_kv, OPEN)
    promote = mocker.spy(remote_kv, "_update_waiting_for_remote_kv")
    output = remote_kv.schedule()
    promote.assert_called_once_with(request)  # promoted in this very step, as stock vLLM does
    resumed = sorted(output.scheduled_cached_reqs.resumed_req_ids)
    if promoted_to == RequestStatus.PREEMPTED and not hasattr(remote_kv, "kv_holding_waiting"):
        assert admitted(output) == [] and resumed == ["remote"]  # up to 0.30: resumed, not new
    else:
        assert admitted(output) + resumed == ["remote"]
    assert output.num_scheduled_tokens["remote"] == 40 - 32  # only the locally missing tokens
    assert request.status == RequestStatus.RUNNING


def test_vllms_paused_new_admits_kv_holding_requests_and_the_gate_does_not(remote_kv: Any) -> None:
    """vLLM >= 0.32 drains KV-holding waiting requests under PAUSED_NEW: the gate also holds the admission cap at 0."""
    if not hasattr(remote_kv, "kv_holding_waiting"):
        pytest.skip("no KV-holding waiting queue before vLLM 0.31: PAUSED_NEW admits nothing")
    request = make_request("remote", num_prompt_tokens=40)
    remote_kv.add_request(request)
    _finish_receiving(remote_kv, remote_kv.schedule(), "remote")
    assert waiting_ids(remote_kv) == ["remote"] and list(remote_kv.kv_holding_waiting) == [request]
    set_gate(remote_kv, CLOSED)
    assert "remote" not in step(remote_kv)[0].num_scheduled_tokens  # the gate admits nothing
    set_gate(remote_kv, OPEN)
    remote_kv.set_pause_state(PauseState.PAUSED_NEW)  # vLLM's own pause: the mixin steps aside
    assert "remote" in step(remote_kv)[0].num_scheduled_tokens


def test_connector_prefix_cache_stats_are_recorded_on_admission(balance_on: None, tiny_model: Path) -> None:
    fake_remote_kv.register()
    config = make_vllm_config(
        tiny_model,
        max_num_seqs=CAP,
        dp_size=2,
        kv_transfer_config=(
            KVTransferConfig(
                kv_connector=fake_remote_kv.NAME,
                kv_role="kv_both",
                kv_connector_extra_config={"matched_tokens": 32, "is_async": False},
            )
        ),
    )
    scheduler = build_scheduler(BalanceScheduler, config)
    scheduler.add_request(make_request("hit", num_prompt_tokens=48))
    set_gate(scheduler, CLOSED)
    scheduler.schedule()
    stats = scheduler.make_stats().connector_prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)  # nothing admitted
    set_gate(scheduler, OPEN)
    output = scheduler.schedule()
    assert admitted(output) == ["hit"] and output.num_scheduled_tokens["hit"] == 48 - 32
    stats = scheduler.make_stats().connector_prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 48, 32)


# ---- streaming input: WAITING_FOR_STREAMING_REQ ----------------------------------------------


def test_streaming_input_session_resumes_only_when_the_gate_opens(balanced: Any) -> None:
    first = make_request("stream", num_prompt_tokens=8, max_tokens=1, resumable=True)
    balanced.add_request(first)
    step(balanced)  # prefill + the one token of this chunk: the session waits for more input
    session = balanced.requests["stream"]
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert balanced.get_num_unfinished_requests() == 0  # waiting for input is not work

    set_gate(balanced, CLOSED)
    balanced.add_request(
        make_request("stream", num_prompt_tokens=6, max_tokens=1, resumable=True)
    )  # the next input chunk arrives
    assert session.status == RequestStatus.WAITING
    output, _ = step(balanced)
    assert not output.num_scheduled_tokens and waiting_ids(balanced) == ["stream"]

    set_gate(balanced, OPEN)
    output, _ = step(balanced)
    assert "stream" in output.num_scheduled_tokens


# ---- Mamba block-aligned split -------------------------------------------------------------


def test_mamba_block_aligned_split_is_applied_on_admission(tiny_model: Path) -> None:
    def chunks(scheduler_cls: type) -> list[int]:
        scheduler = build_scheduler(
            scheduler_cls, make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2, max_num_batched_tokens=40)
        )
        # A hybrid (Mamba) model sets this from its KV-cache groups; none can be built on CPU.
        scheduler.need_mamba_block_aligned_split = True
        scheduler.add_request(make_request("hybrid", num_prompt_tokens=100, max_tokens=1))
        return [step(scheduler)[0].num_scheduled_tokens.get("hybrid", 0) for _ in range(4)]

    stock = chunks(Scheduler)
    assert stock[:2] == [32, 32]  # 40-token budget, aligned down to 16-token blocks
    assert chunks(BalanceScheduler) == stock


# ---- encoder cache freed when KV allocation fails -----------------------------------------------


def test_encoder_cache_is_freed_when_kv_allocation_fails(balance_on: None, tiny_model: Path, mocker: Any) -> None:
    scheduler = build_scheduler(
        BalanceScheduler, make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2, num_blocks=4)
    )  # 64 KV tokens in all
    # A multimodal model would size these from its encoder; the tiny text model has none.
    scheduler.max_num_encoder_input_tokens = 100
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=100)
    free = mocker.spy(scheduler.encoder_cache_manager, "free")
    image = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img0", mm_position=PlaceholderRange(offset=2, length=10)
    )
    scheduler.add_request(make_request("mm", num_prompt_tokens=100, mm_features=[image]))
    output = scheduler.schedule()
    assert admitted(output) == [] and not output.scheduled_encoder_inputs
    assert [call.args[0].request_id for call in free.call_args_list] == ["mm"]
    assert waiting_ids(scheduler) == ["mm"]


# ---- preemption returns the preempted request's token budget ------------------------------------


def test_preemption_matches_stock_vllm(tiny_model: Path) -> None:
    def run(scheduler_cls: type) -> list[tuple]:
        scheduler = build_scheduler(
            scheduler_cls,
            make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2, num_blocks=9, max_num_batched_tokens=64),
        )
        for i in range(4):
            scheduler.add_request(make_request(f"p{i}", num_prompt_tokens=30, max_tokens=20))
        seen = []
        for _ in range(120):
            output, _ = step(scheduler)
            seen.append(
                (
                    admitted(output),
                    sorted(output.preempted_req_ids or ()),
                    dict(output.num_scheduled_tokens),
                    output.total_num_scheduled_tokens,
                )
            )
            if not scheduler.requests:
                break
        assert not scheduler.requests  # everything finished
        return seen

    stock = run(Scheduler)
    assert any(preempted for _, preempted, _, _ in stock), "scenario must preempt"
    assert all(total <= 64 for *_, total in stock)  # budget respected after preemption
    assert run(BalanceScheduler) == stock
