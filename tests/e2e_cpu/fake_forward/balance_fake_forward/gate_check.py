"""Test instrumentation: did any DP rank admit a request in a step its balance gate closed?

Loaded as a vLLM general plugin (every process, before the engine core builds its scheduler), it
wraps ``BalanceSchedulingMixin.schedule`` — the one place every balanced scheduler class goes
through — and compares the gate's decision for the step (read just before, as the mixin reads
it) with what the step scheduled: a request in ``scheduled_new_reqs`` is an admission.

It logs one line per closed stretch of steps, when the gate opens again (and per offending step
at once), so the test reads independent evidence from the engine log:

    Balance gate check: dp_rank=0 closed_steps=12 admitted_while_closed=0

With balance scheduling off no balanced scheduler exists, so nothing is wrapped or logged.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.balance_gate_check")
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin

    inner = BalanceSchedulingMixin.schedule

    @functools.wraps(inner)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        closed = self.balance_gate_closed()
        output = inner(self, *args, **kwargs)
        stats = self.__dict__.setdefault("_gate_check", {"closed": 0, "admitted": 0, "was_closed": False})
        if closed:
            stats["closed"] += 1
            admitted = [r.req_id for r in output.scheduled_new_reqs]
            if admitted:
                stats["admitted"] += len(admitted)
                logger.error(
                    "Balance gate check: dp_rank=%d admitted %s while the gate was closed (balance_queue %s)",
                    _rank(self),
                    admitted,
                    [int(t) for t in self.balance_queue],
                )
        elif stats["was_closed"]:
            logger.info(
                "Balance gate check: dp_rank=%d closed_steps=%d admitted_while_closed=%d",
                _rank(self),
                stats["closed"],
                stats["admitted"],
            )
        stats["was_closed"] = closed
        return output

    BalanceSchedulingMixin.schedule = schedule  # type: ignore[method-assign]


def _rank(scheduler: Any) -> int:
    return int(scheduler.vllm_config.parallel_config.data_parallel_rank)
