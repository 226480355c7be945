"""vLLM's ``--prefill-schedule-interval`` (DP prefill cadence), reproduced on a v0.18 scheduler.

vLLM 0.24+ can admit prefills only on every N-th engine step, aligned across DP ranks (vLLM PR
#44558). The installed vLLM 0.18 has no such option, so the rule is reproduced here from vLLM
0.27.1 (read in the wheel, not copied):

* ``vllm/v1/engine/core.py``, ``DPEngineCoreProc._should_throttle_prefills``: a step is
  *throttled* when ``interval > 1`` and ``step_counter % interval != 0``. ``step_counter`` is the
  DP engine loop's counter, identical on every rank: +1 per busy-loop iteration (in
  ``_has_global_unfinished_reqs``), reset to 0 when a wave ends (all ranks idle), so the first
  step after idle admits.
* ``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule(throttle_prefills)``: a throttled
  step *defers prefills* only if the rank is not capacity-bound and at least one running request
  is decoding (not ``is_prefill_chunk``). A deferred step (a) skips running requests that are
  mid-prefill (``is_prefill_chunk``: chunked-prefill continuations wait too, not only new
  requests) and (b) admits no waiting request that needs prefill compute. After every step that
  is not deferred and runs the admission block, ``prefill_capacity_bound = bool(waiting)``: a
  rank that could not drain its waiting queue stops deferring until it does (the PR's
  saturation guard).

On v0.18 a deferred step is realised through two seams: (b) is the ``PAUSED_NEW`` pause state the
balance gate uses (the admission block does not run), and (a) hides the mid-prefill requests
from ``running`` for the duration of ``schedule()`` and puts them back in place afterwards.
Differences from 0.27.1, none of which this simulator exercises: 0.27.1's deferred admission
loop still admits a request whose prompt is (all but one token) cached or loaded remotely
(no prefix caching or KV connector here), and its preemption could pick a hidden request (the KV
cache is sized so nothing is preempted).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.sched.interface import PauseState

# DPEngineCoreProc syncs "anyone unfinished?" across ranks when step_counter hits a multiple of
# this (vllm/v1/engine/core.py, _has_global_unfinished_reqs, 0.18 and 0.27.1 alike).
WAVE_CHECK_STEPS = 32


def should_throttle(step_counter: int, interval: int) -> bool:
    """``DPEngineCoreProc._should_throttle_prefills`` of vLLM 0.27.1, on the step counter."""
    return interval > 1 and step_counter % interval != 0


class PrefillCadence:
    """The per-rank half of the rule: the saturation guard and what a deferred step skips."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"prefill schedule interval must be >= 1, got {interval}")
        self.interval = interval
        self.capacity_bound = False  # Scheduler.prefill_capacity_bound in 0.27.1
        self.deferred_steps = 0

    def defers(self, step_counter: int, scheduler: Any) -> bool:
        """Whether this rank's next ``schedule()`` defers prefills (0.27.1's ``defer_prefills``)."""
        return (
            should_throttle(step_counter, self.interval)
            and not self.capacity_bound
            and any(not request.is_prefill_chunk for request in scheduler.running)
        )

    def after_step(self, scheduler: Any, deferred: bool, admission_block_ran: bool) -> None:
        """Update the guard as 0.27.1 does at the end of the admission block."""
        if not deferred and admission_block_ran:
            self.capacity_bound = bool(scheduler.waiting)


@contextmanager
def deferred_prefills(scheduler: Any) -> Iterator[None]:
    """Run one ``schedule()`` as 0.27.1 runs a deferred step (see the module docstring)."""
    if scheduler._pause_state != PauseState.UNPAUSED:
        raise RuntimeError("a deferred step needs an unpaused scheduler")
    before = list(scheduler.running)
    hidden = {id(r) for r in before if r.is_prefill_chunk}
    scheduler.running[:] = [r for r in before if id(r) not in hidden]
    scheduler._pause_state = PauseState.PAUSED_NEW
    try:
        yield
    finally:
        scheduler._pause_state = PauseState.UNPAUSED
        kept = {id(r) for r in scheduler.running}
        if len(kept) > len(before) or not kept <= {id(r) for r in before}:
            raise RuntimeError("a deferred step admitted a request (the PAUSED_NEW seam moved)")
        # Back in their places; a request the step preempted stays out.
        scheduler.running[:] = [r for r in before if id(r) in hidden or id(r) in kept]
