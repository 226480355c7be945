"""Wiring only: makes every vLLM process that builds a scheduler build a balanced one.

Installed with pip, this module is ``vllm_ascend_balance.patch_balance_schedule`` and its
``register`` is a ``vllm.general_plugins`` entry point: vLLM calls it in every process before it
resolves the scheduler class (``EngineCore.__init__`` loads general plugins first). In the
fork-style tree it sits at vllm-ascend's path, replacing vllm-ascend's copying module.

What ``register`` does when ``VLLM_ASCEND_BALANCE_SCHEDULING=1`` (nothing at all when it is off):

* wraps ``SchedulerConfig.get_scheduler_cls`` so whatever class vLLM would use (``Scheduler``,
  ``AsyncScheduler``, a configured ``scheduler_cls``) comes back with the balance mixin applied;
* wraps ``VllmConfig.__post_init__`` so PD-disaggregated roles are refused when the config is built;
* keeps vllm-ascend's copying module from taking effect, whichever is imported first: if it has
  not run yet its module name is bound to this module; if it has, its rebinding of vLLM's
  ``Scheduler`` global is undone (and ``AsyncScheduler``, if it was built on the copy, rebuilt);
* installs the engine-core hook (``patch_balance_engine``): one gather per active MoE DP step.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

from vllm.config import SchedulerConfig, VllmConfig
from vllm.logger import init_logger

import vllm.v1.core.sched.scheduler as vllm_scheduler_module
from vllm_ascend.core.balance_config import (
    BALANCE_SCHEDULING_ENV,
    balance_scheduling_flag,
    check_balance_scheduling_supported,
)
from vllm_ascend.core.balance_upstream import (
    VLLM_ASCEND_COPYING_MODULE,
    copied_schedule_classes,
    genuine_vllm_scheduler,
)

from .patch_balance_engine import install_engine_hook, uninstall_engine_hook

# Under "vllm." so vLLM's logging configuration (handler, level, format) applies to it.
logger = init_logger(f"vllm.{__name__}")

# Marks our wrappers so a second register() (plugins load once per process, but tests and the
# fork's import may call it again) never stacks a second wrapper.
_WRAPPED_MARK = "__balance_scheduling_wrapped__"


def register() -> None:
    """Entry point: install balance scheduling in this process when the flag is on."""
    if not balance_scheduling_flag():
        return
    _keep_vllm_ascend_copy_out()
    _wrap_once(SchedulerConfig, "get_scheduler_cls", _balanced_get_scheduler_cls)
    _wrap_once(VllmConfig, "__post_init__", _checked_post_init)
    install_engine_hook()  # the engine-core side: one gather per active MoE DP step


def is_registered() -> bool:
    return getattr(SchedulerConfig.get_scheduler_cls, _WRAPPED_MARK, False)


def unregister() -> None:
    """Undo ``register`` in this process (vLLM's own methods back, no module alias)."""
    uninstall_engine_hook()
    for owner, name in ((SchedulerConfig, "get_scheduler_cls"), (VllmConfig, "__post_init__")):
        current = owner.__dict__[name]
        if getattr(current, _WRAPPED_MARK, False):
            setattr(owner, name, current.__wrapped__)
    aliased = sys.modules.get(VLLM_ASCEND_COPYING_MODULE) is sys.modules[__name__]
    if aliased and __name__ != VLLM_ASCEND_COPYING_MODULE:
        del sys.modules[VLLM_ASCEND_COPYING_MODULE]


def _wrap_once(owner: type, name: str, make_wrapper: Callable[[Callable[..., Any]], Any]) -> None:
    original = owner.__dict__[name]
    if getattr(original, _WRAPPED_MARK, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _WRAPPED_MARK, True)
    setattr(owner, name, wrapper)


def _balanced_get_scheduler_cls(original: Callable[[SchedulerConfig], type]) -> Callable[..., type]:
    def get_scheduler_cls(self: SchedulerConfig) -> type:
        resolved = original(self)
        if not balance_scheduling_flag():
            return resolved
        # Imported here, after _keep_vllm_ascend_copy_out repaired vLLM's bindings.
        from vllm_ascend.core.balance_scheduler import balance_scheduler_class

        if copied_schedule_classes(resolved):
            if resolved.__module__ != VLLM_ASCEND_COPYING_MODULE:
                raise RuntimeError(
                    f"Scheduler class {resolved.__module__}.{resolved.__qualname__} is built on "
                    "vllm-ascend's copied schedule(), which balance scheduling replaces; build "
                    "it on vllm.v1.core.sched.scheduler.Scheduler instead.")
            resolved = genuine_vllm_scheduler()
        balanced = balance_scheduler_class(resolved)
        logger.info_once("Balance scheduling: using %s (over %s.%s).", balanced.__qualname__,
                         resolved.__module__, resolved.__qualname__)
        return balanced

    return get_scheduler_cls


def _checked_post_init(original: Callable[..., None]) -> Callable[..., None]:
    def __post_init__(self: VllmConfig, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if balance_scheduling_flag():
            check_balance_scheduling_supported(self)

    return __post_init__


def _keep_vllm_ascend_copy_out() -> None:
    this_module = sys.modules[__name__]
    existing = sys.modules.get(VLLM_ASCEND_COPYING_MODULE)
    if existing is None:
        # vllm-ascend imports its module when the same flag is set; it now gets this one.
        sys.modules[VLLM_ASCEND_COPYING_MODULE] = this_module
        return
    if existing is this_module:
        return
    genuine = genuine_vllm_scheduler()
    if vllm_scheduler_module.Scheduler is not genuine:
        logger.warning(
            "%s=1: vllm-ascend's copying balance scheduler was imported before this plugin; "
            "restoring vLLM's Scheduler (%s is replaced by the zero-copy implementation).",
            BALANCE_SCHEDULING_ENV, VLLM_ASCEND_COPYING_MODULE)
        vllm_scheduler_module.Scheduler = genuine
    async_module = sys.modules.get("vllm.v1.core.sched.async_scheduler")
    if async_module is not None and copied_schedule_classes(async_module.AsyncScheduler):
        # AsyncScheduler's module was first imported while the global was rebound, so the class
        # inherits the copy; re-executing the module builds it on the genuine Scheduler.
        importlib.reload(async_module)
