"""Wiring only: makes vLLM's MoE data-parallel engine-core processes run the balance gather hook.

Installed with pip, this module is ``vllm_ascend_balance.patch_balance_engine``; the plugin
(``patch_balance_schedule``) calls ``install_engine_hook()`` in the front-end as soon as a switch
turns balance scheduling on: at plugin load for ``VLLM_ASCEND_BALANCE_SCHEDULING=1``, when the
``VllmConfig`` is built for ``additional_config={"enable_balance_scheduling": true}`` — both
before the engine cores are launched.

Why this route. vLLM's ``EngineCoreProc.run_engine_core`` (a staticmethod) runs first in every
engine-core process and picks ``DPEngineCoreProc`` through its *module global* name when the model
is MoE and DP > 1; general plugins are loaded in that process only later, in
``EngineCore.__init__``, too late to change that choice. The front-end process, however, loads
general plugins before it launches the engine cores, and the launcher looks up
``EngineCoreProc.run_engine_core`` at launch time. So, in the front-end:

* ``install_engine_hook()`` replaces that staticmethod with ``run_engine_core`` below, a
  module-level function of *this* module. A spawned child unpickles the process target by
  reference, i.e. imports this module and finds the function here; a forked child inherits it.
* ``run_engine_core`` runs inside the engine-core process and decides again from the config it is
  given (``balance_scheduling_enabled``: off there means vLLM's function, untouched); when on, it
  rebinds the module global
  ``vllm.v1.engine.core.DPEngineCoreProc`` to ``BalanceDPEngineCoreProc`` and calls vLLM's own
  ``run_engine_core``, which still makes every decision itself. MoE DP therefore builds the hook
  class; dense DP and DP = 1 build stock ``EngineCoreProc`` (with the reason logged once).

vllm-ascend's copying module replaces ``run_engine_core`` with a stale copy (which builds its DP
engine for dense models too and asserts). If it ran before the hook is installed (or displaced
the hook: ``install_engine_hook`` runs again at config time), vLLM's genuine function is no longer
referenced anywhere; it is rebuilt from the installed ``vllm/v1/engine/core.py`` (vLLM's
own source, compiled in its own module namespace; nothing is copied into this project) and a
warning says so. Any other replacement is refused.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import FunctionType
from typing import Any, Callable

import vllm.v1.engine.core as engine_core_module
from vllm.logger import init_logger
from vllm.v1.engine.core import EngineCoreProc

from vllm_ascend.core.balance_config import (
    BALANCE_SCHEDULING_CONFIG_KEY,
    BALANCE_SCHEDULING_ENV,
    balance_scheduling_enabled,
    decide_for_config,
)
from vllm_ascend.core.balance_upstream import VLLM_ASCEND_COPYING_MODULE

# Under vLLM's "vllm" logger: vLLM configures only that hierarchy (it does not propagate), so a
# logger named after this module alone would drop INFO records in vLLM processes.
logger = init_logger(f"vllm.{__name__}")

_LAUNCH_METHOD = "run_engine_core"
_DP_CLASS_GLOBAL = "DPEngineCoreProc"
_VLLM_QUALNAME = f"{EngineCoreProc.__qualname__}.{_LAUNCH_METHOD}"

# How to turn it off, for the errors below.
_SWITCHES_OFF = (f"unset {BALANCE_SCHEDULING_ENV} and additional_config"
                 f"[{BALANCE_SCHEDULING_CONFIG_KEY!r}]")

# vLLM's genuine run_engine_core, recorded when the hook is installed (a forked child inherits
# it; a spawned child finds vLLM's function still in place on its freshly imported class).
_upstream_run_engine_core: Callable[..., Any] | None = None


def install_engine_hook() -> None:
    """Front-end side: route engine-core launches through ``run_engine_core`` (idempotent)."""
    global _upstream_run_engine_core
    current = _launch_function()
    if current is run_engine_core:
        return
    from vllm_ascend.core.balance_engine_core import installed_engine_seam_problems

    problems = installed_engine_seam_problems()
    if problems:
        raise RuntimeError(
            "Balance scheduling is on, but the installed vLLM's engine core no longer offers the "
            "seam the balance gather relies on (one gather per active DP engine step):\n  - "
            + "\n  - ".join(problems) + f"\nFor this vLLM, {_SWITCHES_OFF}.")
    _upstream_run_engine_core = _genuine(current)
    setattr(EngineCoreProc, _LAUNCH_METHOD, staticmethod(run_engine_core))


def uninstall_engine_hook() -> None:
    """Undo ``install_engine_hook`` (and the child-side class swap) in this process."""
    global _upstream_run_engine_core
    if _launch_function() is run_engine_core and _upstream_run_engine_core is not None:
        setattr(EngineCoreProc, _LAUNCH_METHOD, staticmethod(_upstream_run_engine_core))
    _upstream_run_engine_core = None
    bound = getattr(engine_core_module, _DP_CLASS_GLOBAL)
    genuine = next(klass for klass in bound.__mro__
                   if klass.__module__ == engine_core_module.__name__)
    setattr(engine_core_module, _DP_CLASS_GLOBAL, genuine)


def is_engine_hook_installed() -> bool:
    return _launch_function() is run_engine_core


def run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """Engine-core process entry (the launcher's target): vLLM's, with the hook class in place.

    Deliberately not ``functools.wraps``-ed: pickling must name this module and function, not
    vLLM's, or a spawned child would import vLLM's original instead.
    """
    upstream = _upstream_run_engine_core or _genuine(_launch_function())
    vllm_config = kwargs.get("vllm_config")
    enabled = (balance_scheduling_enabled(None) if vllm_config is None
               else decide_for_config(vllm_config))
    if enabled:
        _use_hook_class(vllm_config)
    return upstream(*args, **kwargs)


def _use_hook_class(vllm_config: Any) -> None:
    from vllm_ascend.core.balance_engine_core import BalanceDPEngineCoreProc

    setattr(engine_core_module, _DP_CLASS_GLOBAL, BalanceDPEngineCoreProc)
    if vllm_config is None:
        return
    dp_size = vllm_config.parallel_config.data_parallel_size
    if dp_size > 1 and not vllm_config.model_config.is_moe:
        logger.info_once(
            "Balance scheduling is inactive for this dense (non-MoE) model: vLLM runs its %d DP "
            "ranks as independent engines (no DP group, no lockstep), so there is nothing to "
            "balance; each engine core runs stock vLLM with data_parallel_size=1.", dp_size)


def _launch_function() -> Callable[..., Any]:
    attribute = inspect.getattr_static(EngineCoreProc, _LAUNCH_METHOD)
    return attribute.__func__ if isinstance(attribute, staticmethod) else attribute


def _genuine(function: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's own ``run_engine_core``, given what is bound on ``EngineCoreProc`` now."""
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    if module == engine_core_module.__name__ and qualname == _VLLM_QUALNAME:
        return function
    if module == VLLM_ASCEND_COPYING_MODULE:
        logger.info(
            "Balance scheduling is on: vllm-ascend's copying balance module (%s) replaced "
            "EngineCoreProc.run_engine_core with a stale copy; rebuilding vLLM's own function "
            "from %s (the zero-copy engine hook replaces the copy).",
            VLLM_ASCEND_COPYING_MODULE, engine_core_module.__file__)
        return _rebuild_vllm_run_engine_core()
    raise RuntimeError(
        f"Balance scheduling is on, but EngineCoreProc.run_engine_core is {module}.{qualname}, "
        "not vLLM's; balance scheduling cannot tell which engine-core class it builds. Remove "
        f"that patch or {_SWITCHES_OFF}.")


def _rebuild_vllm_run_engine_core() -> FunctionType:
    source_file = inspect.getsourcefile(engine_core_module)
    if source_file is None:
        raise RuntimeError(f"cannot find the source of {engine_core_module.__name__}")
    tree = ast.parse(Path(source_file).read_text(), source_file)
    owner_name, _, method_name = _VLLM_QUALNAME.partition(".")
    definition = next(
        (node for owner in tree.body
         if isinstance(owner, ast.ClassDef) and owner.name == owner_name
         for node in owner.body
         if isinstance(node, ast.FunctionDef) and node.name == method_name), None)
    if definition is None:
        raise RuntimeError(f"{source_file} defines no {_VLLM_QUALNAME}")
    code = compile(ast.Module(body=[definition], type_ignores=[]), source_file, "exec")
    namespace: dict[str, Any] = {}
    # The module's own globals: names resolve exactly as in the original function. Decorators
    # are kept (line numbers stay exact); the staticmethod one is unwrapped below.
    exec(code, vars(engine_core_module), namespace)  # noqa: S102
    built = namespace[method_name]
    function: FunctionType = built.__func__ if isinstance(built, staticmethod) else built
    function.__qualname__ = _VLLM_QUALNAME
    return function
