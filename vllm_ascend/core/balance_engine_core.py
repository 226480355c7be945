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
``balance_count()`` at the end of the previous step when the next ``schedule()`` reads it.

Every rank of the DP group must run the gather, or the collectives pair up wrongly and every rank hangs. With
several nodes (or external load balancing) each rank decides alone, so before the model loads each balanced rank
publishes its settings in the DP group's key-value store and waits, bounded, for every other rank's: a rank that
does not run balance scheduling never publishes (a collective would pair with its first ``all_reduce`` and hang
exactly as a mismatch does), and a missing or different entry is a clear error on every balanced rank.

The three overrides are one mixin over vLLM's own classes: the multiprocess ``DPEngineCoreProc``, and Ray's MoE DP
engine actor ``DPMoEEngineCoreActor`` (a ``DPEngineCoreProc`` too, running the same busy loop), which Ray pickles by
reference: every Ray node needs this package installed.
"""

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import logger
from vllm.v1.engine.core import DPEngineCoreProc, DPMoEEngineCoreActor

from vllm_ascend.core import balance_rule, balance_scheduler, balance_seam
from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin

AGREEMENT_TIMEOUT_ENV = "VLLM_ASCEND_BALANCE_AGREEMENT_TIMEOUT_S"
_AGREEMENT_KEY = "vllm_ascend_balance_scheduling/rank"
_STATS_LINE = "Balance scheduling stats: dp_rank=%d engine_steps=%d gathers=%d gated_steps=%d"


class BalanceDPEngineMixin:
    """One ``balance_gather`` per active loop iteration, the start-up agreement and the stats line, over a vLLM
    class whose busy loop is ``DPEngineCoreProc``'s (``self.scheduler``, ``dp_rank``, ``dp_group``, ``dp_store`` are
    that class's). Constructor arguments are exactly that class's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Logged before construction so every engine-core process states which class it runs,
        # even when a later start-up step fails.
        logger.info("Balance scheduling: this DP engine core is %s.", type(self).__qualname__)
        self.balance_gathers = 0
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler, BalanceSchedulingMixin):
            # Without a balance scheduler the gate never closes: refuse instead of running
            # silently unbalanced.
            raise RuntimeError(
                f"{type(self).__qualname__} needs a balance scheduler, but vLLM built {type(self.scheduler)}; is the "
                "ascend_balance_scheduling plugin excluded by VLLM_PLUGINS?"
            )

    def _init_data_parallel(self, vllm_config: VllmConfig) -> None:
        super()._init_data_parallel(vllm_config)
        # vLLM calls this before the model loads: a disagreeing group fails in seconds, not at its first step.
        agree_across_dp_group(self.dp_store, self.dp_rank, vllm_config)

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        global_unfinished = super()._has_global_unfinished_reqs(local_unfinished)
        # Every rank reaches this line once per active iteration, so the collective matches up.
        self.scheduler.balance_gather(self.dp_group)
        self.balance_gathers += 1
        return global_unfinished

    def shutdown(self) -> None:
        # What the gate did, for operators and end-to-end tests (they assert it closed).
        if isinstance(scheduler := getattr(self, "scheduler", None), BalanceSchedulingMixin):
            counts = (scheduler.balance_steps, self.balance_gathers, scheduler.balance_gated_steps)
            logger.info(_STATS_LINE, self.dp_rank, *counts)
        super().shutdown()


class BalanceDPEngineCoreProc(BalanceDPEngineMixin, DPEngineCoreProc):
    """vLLM's multiprocess DP engine core, balanced."""


class BalanceDPMoEEngineCoreActor(BalanceDPEngineMixin, DPMoEEngineCoreActor):
    """vLLM's Ray MoE DP engine actor, balanced (the Ray route binds it where vLLM's launcher imports the actor)."""


def balance_settings(vllm_config: VllmConfig) -> dict[str, Any]:
    """What every rank of a DP group must share: the caps the gate compares with (``max_num_seqs``, and vLLM >=
    0.31's ``max_num_active_seqs``, which lowers the admission cap when set), the gate rule, and the code of the
    gate and the gather (two ranks of different package versions but the same code agree)."""
    paths = (balance_scheduler.__file__, balance_rule.__file__, balance_seam.__file__, __file__)
    return {
        "cap": vllm_config.scheduler_config.max_num_seqs,
        "active_cap": getattr(vllm_config.scheduler_config, "max_num_active_seqs", None),
        "rule": balance_rule.gate_rule(vllm_config),
        "code": hashlib.sha256(b"".join(Path(path).read_bytes() for path in paths)).hexdigest()[:12],
    }


def agree_across_dp_group(store: Any, rank: int, vllm_config: VllmConfig) -> None:
    """Publish this rank's settings under its own key and wait (bounded) until every rank's match them."""
    size, mine = vllm_config.parallel_config.data_parallel_size, balance_settings(vllm_config)
    raw_timeout = os.environ.get(AGREEMENT_TIMEOUT_ENV, "60")
    try:
        timeout_s = float(raw_timeout)
    except ValueError:
        raise ValueError(f"{AGREEMENT_TIMEOUT_ENV}={raw_timeout!r} is not a number of seconds.") from None
    store.set(f"{_AGREEMENT_KEY}{rank}", json.dumps(mine))
    keys = [f"{_AGREEMENT_KEY}{peer}" for peer in range(size)]
    _wait_for(store, keys, timeout_s)
    theirs = {peer: json.loads(store.get(key)) for peer, key in enumerate(keys) if store.check([key])}
    missing = [peer for peer in range(size) if peer not in theirs]
    differ = {peer: {k: v for k, v in s.items() if v != mine.get(k)} for peer, s in theirs.items() if s != mine}
    store.set(f"{_AGREEMENT_KEY}{rank}/read", "1")
    if not (missing or differ):
        logger.info("Balance scheduling: all %d DP ranks agree on %s.", size, mine)
        return
    if rank == 0:
        # Rank 0 hosts the store: leaving before every announced peer has read it would cut their check short.
        _wait_for(store, [f"{_AGREEMENT_KEY}{peer}/read" for peer in theirs], timeout_s)
    why = (
        f"DP rank(s) {missing} did not announce it within {timeout_s:g} s ({AGREEMENT_TIMEOUT_ENV} sets the wait). "
        "Every rank must run it, or none: the same switch ('enable_balance_scheduling' in additional_config or "
        "VLLM_ASCEND_BALANCE_SCHEDULING), the same package, and 'ascend_balance_scheduling' in VLLM_PLUGINS if set, on "
        "every node"
        if missing
        else f"DP rank(s) differ: {differ} ('cap' is max_num_seqs, 'active_cap' max_num_active_seqs, 'rule' the gate "
        "rule, 'code' a digest of the balance scheduling code). Use the same --max-num-seqs, --max-num-active-seqs, "
        "balance_gate_rule and package on every node"
    )
    raise RuntimeError(f"Balance scheduling: DP rank {rank} runs balance scheduling with {mine}, but {why}.")


def _wait_for(store: Any, keys: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
