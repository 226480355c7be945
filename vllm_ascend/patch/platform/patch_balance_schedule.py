"""Wiring only: makes every vLLM process that builds a scheduler build a balanced one.

Installed with pip, this module is ``vllm_ascend_balance.patch_balance_schedule`` and its
``register`` is a ``vllm.general_plugins`` entry point: vLLM calls it in every process before it
resolves the scheduler class (``EngineCore.__init__`` loads general plugins first). In the
patch series it sits at vllm-ascend's path on the v0.18.0 line, replacing the copying module, and
beside it as ``patch_zero_copy_balance.py`` on the v0.23.0 line, where vllm-ascend's module also
carries a PD prefill-node preemption guard and stays.

Balance scheduling is switched on by ``VLLM_ASCEND_BALANCE_SCHEDULING=1`` or by
``additional_config={"enable_balance_scheduling": true}`` (the config wins when it names the key;
``balance_config`` decides). The env flag is readable when the plugin loads; the config switch only
once a ``VllmConfig`` exists. So ``register`` installs two cheap wrappers in every case, and the
rest happens as soon as a switch says "on":

* ``SchedulerConfig.get_scheduler_cls`` is wrapped: when balance scheduling is on for that config
  (the decision is recorded on the ``SchedulerConfig`` and travels with it to engine-core
  processes), whatever class vLLM would use (``Scheduler``, ``AsyncScheduler``, a configured
  ``scheduler_cls``) comes back with the balance mixin applied; when off, vLLM's answer untouched;
* ``VllmConfig.__post_init__`` is wrapped: it decides for the new config, refuses configurations
  balance scheduling cannot serve, and, when on, activates the rest in this process;
* activation keeps vllm-ascend's copying module from taking effect, whichever is imported first
  (its rebinding of vLLM's ``Scheduler`` global is undone and ``AsyncScheduler``, if it was built on
  the copy, rebuilt), and installs the engine-core route (``patch_balance_engine``): one gather per
  active MoE DP step.

With the env flag on, activation happens at once in ``register`` and vllm-ascend's module name is
also bound to this module when it has not been imported yet: vllm-ascend 0.18 imports its copy
under that flag and balances with it whatever the config says. With both switches off, nothing
of vLLM's or vllm-ascend's behaviour changes (vllm-ascend 0.23 imports its module unconditionally;
it then stays in effect, as it would without this plugin).
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
    balance_scheduling_flag,
    check_balance_scheduling_supported,
    decide_for_config,
    recorded_decision,
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
    """Entry point: install the config-time wrappers; activate now when the env flag is on."""
    _wrap_once(SchedulerConfig, "get_scheduler_cls", _balanced_get_scheduler_cls)
    _wrap_once(VllmConfig, "__post_init__", _checked_post_init)
    if balance_scheduling_flag():
        activate(bind_copying_module_name=True)


def activate(*, bind_copying_module_name: bool = False) -> None:
    """Make this process's scheduler and engine-core launch the zero-copy ones (idempotent)."""
    _keep_vllm_ascend_copy_out(bind_copying_module_name)
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
        if not recorded_decision(self):
            return original(self)
        # Repaired here too, not only at config time: vllm-ascend's module may have been imported
        # (and rebound vLLM's Scheduler) since, e.g. by a plugin in an engine-core process.
        _keep_vllm_ascend_copy_out(bind_copying_module_name=False)
        resolved = original(self)
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
        if decide_for_config(self):
            check_balance_scheduling_supported(self)
            activate()

    return __post_init__


def _keep_vllm_ascend_copy_out(bind_copying_module_name: bool) -> None:
    this_module = sys.modules[__name__]
    existing = sys.modules.get(VLLM_ASCEND_COPYING_MODULE)
    if existing is None:
        if bind_copying_module_name:
            # vllm-ascend imports its module under the env flag; it now gets this one.
            sys.modules[VLLM_ASCEND_COPYING_MODULE] = this_module
        return
    if existing is this_module:
        return
    genuine = genuine_vllm_scheduler()
    if vllm_scheduler_module.Scheduler is not genuine:
        logger.info(
            "Balance scheduling is on: vllm-ascend's copying balance scheduler (%s) rebound "
            "vLLM's Scheduler; restoring vLLM's own (the zero-copy implementation replaces the "
            "copy).", VLLM_ASCEND_COPYING_MODULE)
        vllm_scheduler_module.Scheduler = genuine
    async_module = sys.modules.get("vllm.v1.core.sched.async_scheduler")
    if async_module is not None and copied_schedule_classes(async_module.AsyncScheduler):
        # AsyncScheduler's module was first imported while the global was rebound, so the class
        # inherits the copy; re-executing the module builds it on the genuine Scheduler.
        importlib.reload(async_module)
