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

import functools
import time
from collections.abc import Callable
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

from vllm_ascend.core.balance_rule import COLUMNS, ROW, AdaptiveHold, gate_rule
from vllm_ascend.core.balance_seam import CAP_COUNTS, refuse_if, schedule_seam

# The gate's counts ride to the front-end (balance_metrics) under this key prefix in SchedulerStats'
# running_lora_adapters: a dict[str, int] that vLLM's typed message carries and, without LoRA, nothing else reads.
STATS_PREFIX = "vllm_ascend_balance:"
_STATS_KEYS = [STATS_PREFIX + k for k in ("steps", "gated_steps", "waiting_gated_steps", "gate_closed", "gate_rule")]


class BalanceSchedulingMixin:
    """Adds the balance gate to any vLLM scheduler class (``Scheduler``, ``AsyncScheduler``...).

    Put it first in the bases, before the scheduler class; the constructor takes exactly the
    arguments of the class it is mixed into and forwards them untouched.
    """

    # Step durations (the adaptive rule's input); the simulator sets its simulated clock.
    balance_clock: Callable[[], float] = staticmethod(time.monotonic)
    # The last finished step's prefill tokens and microseconds, when this rank last scheduled or updated, the gate's
    # three counts as of the last make_stats, and the gate: class defaults (immutable, only ever rebound), as vLLM's own
    # tests call update_from_output on schedulers whose __init__ they bypass.
    _balance_step, _balance_marks, _balance_sent, _balance_closed = (0, 0), (0.0, 0.0), (0, 0, 0), False
    # Provided by vLLM's Scheduler.
    vllm_config: VllmConfig
    _pause_state: PauseState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        seam = schedule_seam(type(self), skip=(BalanceSchedulingMixin,))
        refuse_if(
            seam.problems,
            f"Balance scheduling cannot gate {type(self).__qualname__}: its schedule() does not honour the pause-state "
            "seam the gate relies on",
            "Use a scheduler class that does, or switch balance scheduling off.",
        )
        assert seam.cap is not None  # a sound seam admits requests, under a cap
        self._balance_cap = seam.cap
        # vLLM >= 0.32 drains KV-holding requests under PAUSED_NEW, before its cap test: a gated step holds it at 0.
        self._balance_held_caps = (seam.cap.attribute,) if seam.cap.held_at_zero else ()
        super().__init__(*args, **kwargs)
        # One row per DP rank (balance_rule.ROW), gathered in one collective; balance_queue is, as upstream, one
        # int32 CPU tensor per rank holding its count: views of the rows' first column. Write in place (all_gather
        # does), never rebind the list's items.
        self._balance_rows = rows = torch.zeros(self.parallel_config.data_parallel_size, len(ROW), dtype=torch.int32)
        self.balance_queue: list[torch.Tensor] = [row[:1] for row in rows]
        self._balance_gather_into = list(rows.split(1))  # all_gather's output list, made once
        # The rows as one flat view, read each step without torch (its dispatcher is cold after a step; see below).
        self._balance_flat = memoryview(rows.numpy().reshape(-1))
        self._balance_hold = AdaptiveHold(len(rows)) if gate_rule(self.vllm_config) == "adaptive" else None
        # balance_waiting_gated_steps: gated steps with a request waiting (vLLM's own count).
        self.balance_steps = self.balance_gated_steps = self.balance_waiting_gated_steps = 0
        if len(self.balance_queue) == 1:
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

    def balance_row(self) -> list[int]:
        """This rank's gathered values (``balance_rule.ROW``); the finished step is reported once."""
        step, self._balance_step = self._balance_step, (0, 0)
        return [self.balance_count(), self.get_request_counts()[1], *step]

    def balance_gather(self, dp_group: ProcessGroup) -> None:
        """All-gather every rank's ``balance_row()``, then decide the gate for the next step (``balance_update``).

        Collective: every rank of ``dp_group`` must call it the same number of times (the DP
        engine loop does, once per active step). No-op with DP size 1.
        """
        if len(self.balance_queue) == 1:
            return
        local = torch.tensor([self.balance_row()], dtype=torch.int32)
        dist.all_gather(self._balance_gather_into, local, group=dp_group)
        self.balance_update()

    def balance_update(self) -> None:
        """Decide the gate for the next step from the gathered rows, the same on every rank: closed while some rank
        is at the threshold (``cap``), and, with the ``adaptive`` rule, until its hold has idled what aligning saves.
        Decided here, once per gather, so that the step reads a bool (a torch op in the step costs more than it
        seems: the step's own work evicts torch's dispatcher from the caches)."""
        flat, cap, hold = self._balance_flat, self.balance_gate_threshold, self._balance_hold
        self._balance_closed = hold.update(flat, cap) if hold else max(flat[COLUMNS[0]]) >= cap  # cap: counts only

    def balance_gate_closed(self) -> bool:
        """True when this step must admit no new request (``balance_update`` decided it)."""
        return self._balance_closed

    def update_from_output(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        # With a batch queue the step began when the one before it finished, not when it was scheduled.
        now, began = self.balance_clock(), max(self._balance_marks)
        # Decode requests schedule one token each plus their drafts; the rest is prefill.
        drafts = sum(map(len, scheduler_output.scheduled_spec_decode_tokens.values()))
        prefill = scheduler_output.total_num_scheduled_tokens - len(scheduler_output.num_scheduled_tokens) - drafts
        self._balance_step = (prefill, max(int((now - began) * 1e6), 1))
        self._balance_marks = (self._balance_marks[0], now)
        return super().update_from_output(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self.balance_steps, self._balance_marks = self.balance_steps + 1, (self.balance_clock(), self._balance_marks[1])
        # A real pause already does at least what the gate would: never override it.
        if self._pause_state != PauseState.UNPAUSED or not self._balance_closed:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.balance_gated_steps += 1
        self.balance_waiting_gated_steps += self.get_request_counts()[1] > 0
        # Set directly: set_pause_state is the public "real pause" API (and logs in newer vLLM).
        self._pause_state = PauseState.PAUSED_NEW
        held = {cap: getattr(self, cap) for cap in self._balance_held_caps}
        vars(self).update(dict.fromkeys(held, 0))
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            vars(self).update(held)
            if self._pause_state == PauseState.PAUSED_NEW:
                self._pause_state = PauseState.UNPAUSED

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        """vLLM's stats, plus the gate's counts since the previous stats (each stats reaches exactly one front-end),
        its state for the next step and the rule in force (``balance_metrics`` reads them)."""
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None:
            now = (self.balance_steps, self.balance_gated_steps, self.balance_waiting_gated_steps)
            # The rule in force: 0 cap, 1 adaptive and holding, 2 adaptive and not (ints: a bool would not decode).
            rule = self._balance_hold and 2 - bool(self._balance_hold.holding) or 0
            values = (*(n - sent for n, sent in zip(now, self._balance_sent)), int(self._balance_closed), rule)
            stats.running_lora_adapters.update(zip(_STATS_KEYS, values))
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
