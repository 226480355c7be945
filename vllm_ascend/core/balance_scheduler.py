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
"""Balance scheduling for data-parallel serving, as a mixin over the installed vLLM scheduler.

Every DP rank of a MoE model steps in lockstep, so one rank's prefill stalls all of them. With
balance scheduling each rank keeps ``balance_queue``: every rank's ``balance_count()`` (what vLLM's
admission cap compares: ``len(running)``, plus paused streaming sessions from vLLM 0.27) as gathered
at the end of the previous step (``balance_gather``, called by the DP engine loop). While any rank
is at its cap (``max_num_seqs``, or ``max_num_active_seqs`` where vLLM >= 0.31 sets it), no rank
admits new waiting requests; running requests are scheduled as usual. Admissions therefore happen
together and decode stays steady.

Nothing of vLLM's ``schedule()`` is copied: the gate reaches the admission block through its
existing guard, ``self._pause_state == PauseState.UNPAUSED``. A gated step runs the inherited
``schedule()`` with the state transiently set to ``PAUSED_NEW`` and, on vLLM >= 0.32 (which admits
KV-holding requests under ``PAUSED_NEW``), its admission cap held at 0 (``balance_seam`` says why that
is exactly "admit nothing new", and refuses classes where it is not). vLLM's engine changes the pause
state only between steps, so code running inside a gated step sees ``PAUSED_NEW``; a pause set
during the step other than ``PAUSED_NEW`` is kept when the step ends.

The class is the decision: a balanced class always gates, vLLM's own classes never do. Which one
a process builds is decided once, by the wiring (``patch_balance_schedule``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.config import VllmConfig
from vllm.logger import logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import SchedulerStats

from vllm_ascend.core.balance_seam import CAP_COUNTS, refusal, schedule_seam

# The gate's counts ride to the front-end (balance_metrics) under this key prefix in SchedulerStats'
# running_lora_adapters: a dict[str, int] that vLLM's typed message carries and, without LoRA, nothing else reads.
STATS_PREFIX = "vllm_ascend_balance:"


class BalanceSchedulingMixin:
    """Adds the balance gate to any vLLM scheduler class (``Scheduler``, ``AsyncScheduler``...).

    Put it first in the bases, before the scheduler class; the constructor takes exactly the
    arguments of the class it is mixed into and forwards them untouched.
    """

    # The hook for "which gate rule is in force" (vllm:balance_gate_rule): 0 is "cap" (balance_gate_threshold below).
    balance_gate_rule = 0
    # Provided by vLLM's Scheduler.
    vllm_config: VllmConfig
    running: list[Any]
    max_num_running_reqs: int
    _pause_state: PauseState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        seam = schedule_seam(type(self), skip=(BalanceSchedulingMixin,))
        if seam.problems:
            raise refusal(
                f"Balance scheduling cannot gate {type(self).__qualname__}: its schedule() does not honour the "
                "pause-state seam the gate relies on",
                seam.problems,
                "Use a scheduler class that does, or switch balance scheduling off.",
            )
        assert seam.cap is not None  # a sound seam admits requests, under a cap
        self._balance_cap = seam.cap
        super().__init__(*args, **kwargs)
        dp_size = self.vllm_config.parallel_config.data_parallel_size
        # One int32 CPU tensor per DP rank, as upstream (callers index and all_gather into it),
        # each a view of one buffer so the per-step gate check is a single max(), whatever the
        # DP size. Write counts in place (all_gather does), never rebind the list's items.
        self._balance_counts = torch.zeros(dp_size, dtype=torch.int32)
        self.balance_queue: list[torch.Tensor] = list(self._balance_counts.split(1))
        self.balance_steps = 0
        self.balance_gated_steps = 0
        # Gated steps with a request waiting (vLLM's own count); the three counts as of the last make_stats.
        self.balance_waiting_gated_steps, self._balance_sent = 0, (0, 0, 0)
        if dp_size == 1:
            # Also each engine of a dense model: vLLM runs its DP ranks as independent engines.
            logger.warning_once(
                "Balance scheduling has no effect with data_parallel_size=1 (nothing to balance; dense models run "
                "each DP rank as an independent engine); the scheduler runs as stock vLLM."
            )

    @property
    def balance_gate_threshold(self) -> int:
        """Count at which a rank closes the gate for every rank: vLLM's own admission cap (upstream's rule since
        vllm-ascend PR #8674: the cap itself; ``max_num_seqs`` unless vLLM >= 0.31 sets ``max_num_active_seqs``)."""
        return getattr(self, self._balance_cap.attribute)

    def balance_count(self) -> int:
        """What vLLM's admission compares with its cap: ``len(running)``, plus paused streams on vLLM >= 0.27."""
        return CAP_COUNTS[self._balance_cap.count](self)

    def balance_gather(self, dp_group: ProcessGroup) -> None:
        """All-gather every rank's ``balance_count()`` into ``balance_queue``.

        Collective: every rank of ``dp_group`` must call it the same number of times (the DP
        engine loop does, once per active step). No-op with DP size 1.
        """
        if len(self.balance_queue) == 1:
            return
        local = torch.tensor([self.balance_count()], dtype=torch.int32)
        dist.all_gather(self.balance_queue, local, group=dp_group)

    def balance_gate_closed(self) -> bool:
        """True when this step must admit no new request (some rank was at the threshold)."""
        return int(self._balance_counts.max()) >= self.balance_gate_threshold

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self.balance_steps += 1
        # A real pause already does at least what the gate would: never override it.
        if self._pause_state != PauseState.UNPAUSED or not self.balance_gate_closed():
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.balance_gated_steps += 1
        self.balance_waiting_gated_steps += self.get_request_counts()[1] > 0
        # Set directly: set_pause_state is the public "real pause" API (and logs in newer vLLM).
        self._pause_state = PauseState.PAUSED_NEW
        cap = self._balance_cap.attribute if self._balance_cap.held_at_zero else None
        cap_value = getattr(self, cap) if cap else None
        if cap:  # vLLM >= 0.32 drains KV-holding requests under PAUSED_NEW; a cap of 0 admits nothing
            setattr(self, cap, 0)
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if cap:
                setattr(self, cap, cap_value)
            if self._pause_state == PauseState.PAUSED_NEW:
                self._pause_state = PauseState.UNPAUSED

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        """vLLM's stats, plus the gate's counts since the previous stats (each stats reaches exactly one front-end),
        its state for the next step and the rule in force (``balance_metrics`` reads them)."""
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None:
            now = (self.balance_steps, self.balance_gated_steps, self.balance_waiting_gated_steps)
            values = [n - sent for n, sent in zip(now, self._balance_sent)]
            values += [int(self.balance_gate_closed()), self.balance_gate_rule]  # int: a bool would not decode
            keys = ("steps", "gated_steps", "waiting_gated_steps", "gate_closed", "gate_rule")
            stats.running_lora_adapters.update(zip((STATS_PREFIX + key for key in keys), values))
            self._balance_sent = now
        return stats


class BalanceScheduler(BalanceSchedulingMixin, Scheduler):
    """vLLM's ``Scheduler`` with balance scheduling; constructor arguments exactly vLLM's."""


class BalanceAsyncScheduler(BalanceSchedulingMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (the default with async scheduling) with balance scheduling."""


@functools.cache
def balance_scheduler_class(base: type) -> type:
    """The balanced version of ``base`` (whatever vLLM's config resolved), created once."""
    if issubclass(base, BalanceSchedulingMixin):
        return base
    known = {Scheduler: BalanceScheduler, AsyncScheduler: BalanceAsyncScheduler}
    namespace = {"__module__": __name__, "__doc__": f"{base.__qualname__} with balance scheduling."}
    return known.get(base) or type(f"Balance{base.__name__}", (BalanceSchedulingMixin, base), namespace)
