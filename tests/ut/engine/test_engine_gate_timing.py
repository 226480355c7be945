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
"""When the gate reads the gathered counts, across real DP ranks and the real engine hook.

Two ranks (threads of this process, each with its own BalanceScheduler and
``BalanceDPEngineCoreProc``) share a real gloo group built by vLLM's
``stateless_init_torch_distributed_process_group`` (what ``DPEngineCoreProc`` uses), and step
through the DP busy loop (``soak.rank.busy_loop_iteration``), so every gather is the hook's.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from offline_vllm import build_scheduler, make_request, make_vllm_config
from soak.fakes import FakeExecutor
from soak.rank import busy_loop_iteration, make_engine_core
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.v1.engine import EngineCoreRequestType

from vllm_ascend.core.balance_scheduler import BalanceScheduler

CAP = 4
DP = 2


class RecordingExecutor(FakeExecutor):
    """Also records what each step's schedule() saw and admitted (steps without a model
    execution, e.g. an empty rank's dummy batch, admitted nothing)."""

    def __init__(self, scheduler: Any, steps: int) -> None:
        super().__init__(scheduler)
        self.step = 0
        self.seen: list[list[int] | None] = [None] * steps
        self.admitted: list[list[str]] = [[] for _ in range(steps)]

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        # balance_queue is unchanged between schedule() and here (the gather comes later).
        self.seen[self.step] = [int(t.item()) for t in self.scheduler.balance_queue]
        self.admitted[self.step] = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        return super().execute_model(scheduler_output, non_block)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(config: Any, arrivals: dict[int, dict[int, list[Any]]], steps: int) -> list[dict[str, Any]]:
    """Run ``steps`` busy-loop iterations on DP ranks; ``arrivals[rank][step]`` are added
    before that step. Returns per rank what schedule() saw/admitted and len(running) after."""
    port = _free_port()
    records: list[dict[str, Any]] = [{} for _ in range(DP)]
    errors: list[BaseException] = []
    schedulers = [build_scheduler(BalanceScheduler, config) for _ in range(DP)]

    def rank_main(rank: int) -> None:
        try:
            group = stateless_init_torch_distributed_process_group("127.0.0.1", port, rank, DP, backend="gloo")
            executor = RecordingExecutor(schedulers[rank], steps)
            core = make_engine_core(config, schedulers[rank], executor, group, rank)
            core._handle_client_request(EngineCoreRequestType.START_DP_WAVE, (0, -1))
            running_after = []
            for step in range(steps):
                executor.step = step
                for request in arrivals.get(rank, {}).get(step, []):
                    core._handle_client_request(EngineCoreRequestType.ADD, (request, 0))
                assert busy_loop_iteration(core)
                running_after.append(len(core.scheduler.running))
            records[rank] = {"seen": executor.seen, "admitted": executor.admitted, "running_after": running_after}
        except BaseException as error:  # noqa: BLE001 - re-raised in the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(DP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "ranks hung"
    if errors:
        raise errors[0]
    return records


@pytest.fixture
def config(tiny_moe_model: Path) -> Any:
    return make_vllm_config(tiny_moe_model, max_num_seqs=CAP, dp_size=DP)


def test_gate_sees_previous_step_counts_and_freezes_all_ranks_until_below_cap(balance_on: None, config: Any) -> None:
    arrivals = {
        # Rank 1 fills to its cap at step 0; "a3" finishes after 10 tokens (at step 9).
        1: {
            0: [make_request(f"a{i}", max_tokens=40) for i in range(3)] + [make_request("a3", max_tokens=10)],
            2: [make_request("a4", max_tokens=40)],
        },
        0: {2: [make_request("b0", max_tokens=5), make_request("b1", max_tokens=5)]},
    }
    rank0, rank1 = run_ranks(config, arrivals, steps=13)
    # Every schedule() saw exactly the counts after the previous step's update (the gather of
    # the previous iteration): never older, never this step's.
    for rank in (rank0, rank1):
        scheduled = [step for step, seen in enumerate(rank["seen"]) if seen is not None]
        assert len(scheduled) >= 11
        for step in scheduled:
            previous = [0, 0] if step == 0 else [rank0["running_after"][step - 1], rank1["running_after"][step - 1]]
            assert rank["seen"][step] == previous, step
    assert rank1["admitted"][0] == ["a0", "a1", "a2", "a3"]
    assert rank1["running_after"][:10] == [4] * 9 + [3]
    # Rank 1 at cap from step 1 to step 9: no admission on any rank, though both have waiting.
    for step in range(1, 10):
        assert rank0["admitted"][step] == [] and rank1["admitted"][step] == [], step
    # Step 10 saw rank 1 below cap: both ranks admit, although rank 1 is back at its cap
    # by the end of this very step (the gate does not see the current step's counts).
    assert rank0["admitted"][10] == ["b0", "b1"]
    assert rank1["admitted"][10] == ["a4"]
    assert rank1["running_after"][10] == CAP
    # ... and from the next step on the gate is closed again.
    assert rank0["seen"][11] == [2, CAP] and rank0["admitted"][11] == []
