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
"""The balance gather in vLLM's data-parallel engine loop, without copying the loop.

For MoE models with DP > 1, vLLM runs one ``DPEngineCoreProc`` per rank. Its ``run_busy_loop``
calls ``_has_global_unfinished_reqs()`` exactly once per non-idle iteration on every rank, in
lockstep (ranks without work run a dummy batch), and all ranks skip it together when all are idle.
That call is therefore the one place where a collective can run every active step without
deadlocking: the gather cannot go inside ``schedule()`` (a drained rank stops scheduling) nor
before the loop's own synchronisation (ranks at a wave boundary diverge). The subclass extends
only that method, so the gather follows whatever the installed vLLM's loop does
(``balance_seam`` checks the loop still has that shape).

The gather runs after the step's ``update_from_output``, so ``balance_queue`` holds each rank's
``len(running)`` at the end of the previous step when the next ``schedule()`` reads it.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import logger
from vllm.v1.engine.core import DPEngineCoreProc

from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """vLLM's ``DPEngineCoreProc`` plus one ``balance_gather`` per active loop iteration.

    Constructor arguments are exactly ``DPEngineCoreProc``'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Logged before construction so every engine-core process states which class it runs,
        # even when a later start-up step fails.
        logger.info(
            "Balance scheduling: this DP engine core is %s (one balance_gather per active engine step).",
            type(self).__qualname__,
        )
        self.balance_gathers = 0
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler, BalanceSchedulingMixin):
            # Without a balance scheduler the gate never closes: refuse instead of running
            # silently unbalanced.
            raise RuntimeError(
                f"{type(self).__qualname__} needs a balance scheduler, but vLLM built "
                f"{type(self.scheduler).__module__}.{type(self.scheduler).__qualname__}; is the "
                "ascend_balance_scheduling plugin excluded by VLLM_PLUGINS?"
            )

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        global_unfinished = super()._has_global_unfinished_reqs(local_unfinished)
        # Every rank reaches this line once per active iteration, so the collective matches up.
        self.scheduler.balance_gather(self.dp_group)
        self.balance_gathers += 1
        return global_unfinished

    def shutdown(self) -> None:
        # What the gate did, for operators and end-to-end tests (they assert it closed).
        if isinstance(getattr(self, "scheduler", None), BalanceSchedulingMixin):
            logger.info(
                "Balance scheduling stats: dp_rank=%d engine_steps=%d gathers=%d gated_steps=%d",
                self.dp_rank,
                self.scheduler.balance_steps,
                self.balance_gathers,
                self.scheduler.balance_gated_steps,
            )
