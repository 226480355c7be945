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
"""Keeps vllm-ascend's copying balance module out of the way when balance scheduling is on.

Needed only where this zero-copy implementation runs *beside* vllm-ascend's own
``vllm_ascend/patch/platform/patch_balance_schedule.py``: the pip plugin (every line) and the
v0.23.0 series (which keeps that module for its PD prefill-node guard). The v0.18.0 series puts
the wiring at that module's path, so there is no copy to keep out and this file is not in it.

On import, the copying module rebinds ``vllm.v1.core.sched.scheduler.Scheduler`` to its subclass
with a copied ``schedule()`` (an ``AsyncScheduler`` whose module is first imported afterwards
inherits it) and replaces ``EngineCoreProc.run_engine_core`` with a copy. With balance scheduling
on, this module undoes both, each with an INFO line, before the wiring reads them; with it off,
everything is left as vllm-ascend set it:

* with the env flag on and this plugin loaded first, the copying module's name is bound to the
  wiring module, so vllm-ascend 0.18 (which imports its copy under that flag) never runs the copy;
* ``SchedulerConfig.get_scheduler_cls``, wrapped inside the wiring's wrapper, restores vLLM's
  ``Scheduler`` global, rebuilds a copy-based ``AsyncScheduler`` and maps the copy's own class to
  vLLM's; any other class built on the copy is refused;
* ``VllmConfig.__post_init__``, wrapped around the wiring's, puts vLLM's ``run_engine_core``
  (rebuilt from vLLM's own source file: nothing is copied into this project) in place of the copy
  while the wiring decides, and gives the copy back if the decision is off.
"""

import ast
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from types import FunctionType
from typing import Any

import vllm.v1.core.sched.scheduler as vllm_scheduler_module
import vllm.v1.engine.core as engine_core_module
from vllm.config import SchedulerConfig, VllmConfig
from vllm.logger import logger
from vllm.v1.engine.core import EngineCoreProc

from vllm_ascend.core.balance_seam import method_node

from . import patch_balance_schedule as wiring

COPYING_MODULE = "vllm_ascend.patch.platform.patch_balance_schedule"
# What replaces EngineCoreProc.run_engine_core at import: the copy, and on vllm-ascend main DyntraLB's wrapper of it
# (main refuses DyntraLB with balance scheduling on, so the wrapper would only delegate to the copy).
REPLACING_MODULES = (COPYING_MODULE, "vllm_ascend.patch.platform.patch_dyntra_lb_core")
_REBUILT = "Balance scheduling is on: %s replaced EngineCoreProc.run_engine_core; rebuilt vLLM's own from %s."
_RESTORED = "Balance scheduling is on: restoring vLLM's Scheduler, which %s rebound to its copy."


def register() -> None:
    """Entry point of the pip plugin (``vllm.general_plugins``): the wiring, kept copy-free."""
    wiring.wrap_once(SchedulerConfig, "get_scheduler_cls", _copy_free_get_scheduler_cls)
    wiring.register()
    wiring.wrap_once(VllmConfig, "__post_init__", _copy_free_post_init)
    if wiring.balance_scheduling_flag() and COPYING_MODULE not in sys.modules:
        sys.modules[COPYING_MODULE] = wiring  # vllm-ascend imports its copy under that flag


def _carries_copy(cls: type) -> bool:
    return any(klass.__module__ == COPYING_MODULE and "schedule" in klass.__dict__ for klass in cls.__mro__)


def _copy_free_get_scheduler_cls(original: Callable[[SchedulerConfig], type]) -> Callable[..., type]:
    def get_scheduler_cls(self: SchedulerConfig) -> type:
        if not wiring.recorded_decision(self):
            return original(self)
        mro, own = vllm_scheduler_module.Scheduler.__mro__, vllm_scheduler_module.__name__
        genuine = next(k for k in mro if (k.__module__, k.__name__) == (own, "Scheduler"))
        if vllm_scheduler_module.Scheduler is not genuine:
            logger.info(_RESTORED, COPYING_MODULE)
            vllm_scheduler_module.Scheduler = genuine
        async_module = sys.modules.get("vllm.v1.core.sched.async_scheduler")
        if async_module is not None and _carries_copy(async_module.AsyncScheduler):
            # Its module was first imported while the global was rebound, so the class inherits the copy;
            # re-executing the module builds it on vLLM's Scheduler.
            importlib.reload(async_module)
        resolved = original(self)
        if not _carries_copy(resolved):
            return resolved
        if resolved.__module__ != COPYING_MODULE:
            raise RuntimeError(
                f"Scheduler class {resolved.__module__}.{resolved.__qualname__} is built on vllm-ascend's copied "
                "schedule(), which balance scheduling replaces; build it on vllm.v1.core.sched.scheduler.Scheduler."
            )
        return genuine

    return get_scheduler_cls


def _copy_free_post_init(original: Callable[..., None]) -> Callable[..., None]:
    def __post_init__(self: VllmConfig, *args: Any, **kwargs: Any) -> None:
        copy, replaced_by = EngineCoreProc.__dict__["run_engine_core"], EngineCoreProc.run_engine_core.__module__
        if replaced_by not in REPLACING_MODULES:
            return original(self, *args, **kwargs)
        EngineCoreProc.run_engine_core = staticmethod(_rebuilt_vllm_run_engine_core())
        try:
            original(self, *args, **kwargs)
        finally:
            if EngineCoreProc.run_engine_core is wiring.run_engine_core:
                logger.info(_REBUILT, replaced_by, engine_core_module.__file__)
            else:
                EngineCoreProc.run_engine_core = copy  # balance off: as vllm-ascend left it

    return __post_init__


@functools.cache
def _rebuilt_vllm_run_engine_core() -> FunctionType:
    """vLLM's ``EngineCoreProc.run_engine_core``, compiled from vLLM's own installed source file in its own module
    namespace, so names resolve exactly as in the original."""
    definition = method_node(ast.parse(inspect.getsource(engine_core_module)), "EngineCoreProc", "run_engine_core")
    if definition is None:
        raise RuntimeError(f"{engine_core_module.__file__} defines no EngineCoreProc.run_engine_core")
    namespace: dict[str, Any] = {}
    code = compile(ast.Module(body=[definition], type_ignores=[]), engine_core_module.__file__, "exec")
    exec(code, vars(engine_core_module), namespace)
    # Its staticmethod decorator was kept, so every line number is the original's.
    function: FunctionType = namespace["run_engine_core"].__func__
    function.__qualname__ = "EngineCoreProc.run_engine_core"
    return function
