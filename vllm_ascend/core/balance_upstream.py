"""Finds vLLM's genuine scheduler classes when vllm-ascend's copying patch has rebound them.

vllm-ascend's own balance scheduling (``vllm_ascend/patch/platform/patch_balance_schedule.py`` in
the release) rebinds ``vllm.v1.core.sched.scheduler.Scheduler`` to a subclass carrying a copied
``schedule()``. Any class resolved through that global afterwards, including an ``AsyncScheduler``
whose module was first imported after the rebinding, inherits the copy. These helpers tell the
genuine class from the copy so the scheduler and the wiring can refuse or repair it.
"""

from __future__ import annotations

import vllm.v1.core.sched.scheduler as vllm_scheduler_module

# vllm-ascend's release defines its copying BalanceScheduler in this module (on the v0.18.0 line
# this project's patch series puts its wiring at the same path; it defines no scheduler class).
VLLM_ASCEND_COPYING_MODULE = "vllm_ascend.patch.platform.patch_balance_schedule"


def genuine_vllm_scheduler() -> type:
    """vLLM's own ``Scheduler``: the class defined in its module under that name."""
    bound = vllm_scheduler_module.Scheduler
    for klass in bound.__mro__:
        if klass.__module__ == vllm_scheduler_module.__name__ and klass.__qualname__ == "Scheduler":
            return klass
    raise RuntimeError(f"cannot find vLLM's Scheduler in the MRO of {bound!r}")


def copied_schedule_classes(cls: type) -> list[type]:
    """Classes in ``cls``'s MRO that carry vllm-ascend's copied ``schedule()``."""
    return [klass for klass in cls.__mro__
            if klass.__module__ == VLLM_ASCEND_COPYING_MODULE and "schedule" in klass.__dict__]
