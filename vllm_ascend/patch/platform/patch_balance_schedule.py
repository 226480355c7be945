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
"""Wiring: decides once whether balance scheduling is on, and makes vLLM build accordingly.

**The decision.** Three switches, accepted on every release line, the most specific winning (vllm-ascend main's
precedence): ``additional_config={"scheduler_config": {"enable_balance_scheduling": true}}`` (main's documented
form), then the top-level ``additional_config={"enable_balance_scheduling": true}`` (vllm-ascend 0.23's form), then
``VLLM_ASCEND_BALANCE_SCHEDULING`` ("1" on, "0"/unset off). Any other value of any of them is an error, even where a
more specific switch decides: vllm-ascend reads them with ``bool(...)``, so "false" would mean *on* there.
``decide`` runs when a ``VllmConfig`` is built (in the front-end, before any engine core is launched), refuses what
balance scheduling cannot serve, logs which switch decided, and records the decision on the config's
``SchedulerConfig``: an attribute, not a dataclass field, so it pickles into every engine-core process and stays out
of vLLM's config hash. Engine processes read that record (``recorded_decision``) and never decide again.

**What it changes.** ``register`` (called in every vLLM process before a scheduler is resolved)
wraps two vLLM methods, which do nothing while balance scheduling is off:

* ``VllmConfig.__post_init__``: decides; when on, installs the engine-core route below;
* ``SchedulerConfig.get_scheduler_cls``: when the recorded decision is on, whatever class vLLM
  resolved (``Scheduler``, ``AsyncScheduler``, a configured ``scheduler_cls``) comes back with the
  balance mixin applied. The class is the decision from there on.

**The engine-core route.** vLLM's ``EngineCoreProc.run_engine_core`` (a staticmethod) runs first in
every engine-core process and picks ``DPEngineCoreProc`` through its *module global* when the model
is MoE and DP > 1; plugins load in that process only later, too late to change it. The front-end
loads plugins before it launches engine cores, and the launcher looks the target up at launch
time, so the front-end replaces that staticmethod with ``run_engine_core`` of this module (a
spawned child unpickles it by reference; a forked child inherits it). In the engine process it
rebinds the module global to ``BalanceDPEngineCoreProc`` and calls vLLM's own ``run_engine_core``,
which still decides MoE DP vs dense DP vs DP 1.

**The Ray route.** With ``data_parallel_backend="ray"`` vLLM's ``CoreEngineActorManager`` starts every DP rank as a
Ray actor, importing ``DPMoEEngineCoreActor`` from ``vllm.v1.engine.core`` inside the function, at launch time. The
front-end binds that module attribute to ``BalanceDPMoEEngineCoreActor`` (vLLM's actor with the balance mixin);
Ray pickles it by reference, so every Ray node imports it from this package. Elastic EP is refused: ranks added at
scale-up would join a group whose running ranks never run the start-up agreement again.
"""

import functools
import os
from collections.abc import Callable
from typing import Any

import vllm.v1.engine.core as engine_core_module
from vllm import envs
from vllm.config import SchedulerConfig, VllmConfig
from vllm.logger import logger
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.engine.core import EngineCoreProc

from vllm_ascend.core import balance_rule, balance_seam

BALANCE_SCHEDULING_ENV = "VLLM_ASCEND_BALANCE_SCHEDULING"
BALANCE_SCHEDULING_CONFIG_KEY = "enable_balance_scheduling"
NESTED_SWITCH = f"additional_config['scheduler_config'][{BALANCE_SCHEDULING_CONFIG_KEY!r}]"
TOP_LEVEL_SWITCH = f"additional_config[{BALANCE_SCHEDULING_CONFIG_KEY!r}]"
SWITCH_EXAMPLE = f'--additional-config \'{{"scheduler_config": {{"{BALANCE_SCHEDULING_CONFIG_KEY}": true}}}}\''
SWITCHES_OFF = f"set {NESTED_SWITCH} to false (it wins over {TOP_LEVEL_SWITCH} and {BALANCE_SCHEDULING_ENV})"
_DECISION_ATTR = "_vllm_ascend_balance_scheduling"
_WRAPPED_MARK = "__balance_scheduling_wrapped__"

# vLLM's run_engine_core, recorded when the route is installed (a forked child inherits it; a spawned child finds
# vLLM's function still in place on its freshly imported class).
_vllm_run_engine_core: Callable[..., Any] | None = None


# ---- the decision -----------------------------------------------------------------------------------------------


def balance_scheduling_flag() -> bool:
    """``VLLM_ASCEND_BALANCE_SCHEDULING`` alone: "1" on, "0" or unset off, anything else an error."""
    if (raw := os.environ.get(BALANCE_SCHEDULING_ENV, "0")) not in ("0", "1"):
        raise ValueError(f"{BALANCE_SCHEDULING_ENV}={raw!r} is not valid: accepted values are '1' (on), '0' or unset.")
    return raw == "1"


def switches(vllm_config: VllmConfig) -> list[tuple[str, bool]]:
    """Every switch that is set, as ``(what the user wrote, value)``, most specific first; each one checked."""
    found = []
    for label, holder in zip((NESTED_SWITCH, TOP_LEVEL_SWITCH), balance_rule.option_mappings(vllm_config)):
        if BALANCE_SCHEDULING_CONFIG_KEY in holder:
            value = holder[BALANCE_SCHEDULING_CONFIG_KEY]
            if not isinstance(value, bool):
                raise ValueError(f"{label}={value!r} is not valid: true or false (JSON), e.g. {SWITCH_EXAMPLE}.")
            found.append((f"{label}={value}", value))
    if BALANCE_SCHEDULING_ENV in os.environ:
        found.append((f"{BALANCE_SCHEDULING_ENV}={os.environ[BALANCE_SCHEDULING_ENV]}", balance_scheduling_flag()))
    return found


def decide(vllm_config: VllmConfig) -> bool:
    """The one decision for ``vllm_config``: checked, logged and recorded on its SchedulerConfig.

    A ``scheduler_cls`` that names a balanced class asks for balance scheduling when no switch says otherwise.
    """
    (first, enabled), *others = switches(vllm_config) or [(None, False)]
    source = first and f"set by {first}"
    if first and not first.startswith(NESTED_SWITCH):
        source += f" (deprecated by vllm-ascend main in favour of {SWITCH_EXAMPLE})"
    if ignored := [label for label, value in others if value != enabled]:
        source += f"; {', '.join(ignored)} is ignored (the more specific switch wins)"
    if _names_balanced_class(named := vllm_config.scheduler_config.scheduler_cls):
        if first and not enabled:
            raise ValueError(
                f"scheduler_cls={named!r} is a balance scheduling class, but balance scheduling is switched off "
                f"({source}): remove one of the two."
            )
        enabled, source = True, source or f"set by scheduler_cls={named!r}"
    if enabled:
        _refuse_unsupported(vllm_config, source)
    setattr(vllm_config.scheduler_config, _DECISION_ATTR, (enabled, source))
    return recorded_decision(vllm_config.scheduler_config)


def _names_balanced_class(named: str | type | None) -> bool:
    if named is None:  # the default; importing the mixin now would bind vLLM's Scheduler before coexist restores it
        return False
    from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin

    named = resolve_obj_by_qualname(named) if isinstance(named, str) else named  # as vLLM resolves it
    return isinstance(named, type) and issubclass(named, BalanceSchedulingMixin)


def recorded_decision(scheduler_config: SchedulerConfig, log: bool = True) -> bool:
    """The decision ``decide`` recorded (logged once per process); for a ``SchedulerConfig`` that never went
    through a ``VllmConfig`` there is no config switch, so the environment variable alone."""
    record = getattr(scheduler_config, _DECISION_ATTR, None)
    if record is None:
        return balance_scheduling_flag()
    enabled, source = record
    if log and source is not None:
        log = logger.warning_once if "is ignored" in source else logger.info_once
        log("Balance scheduling %s: %s.", "on" if enabled else "off", source)
    return enabled


def _refuse_unsupported(vllm_config: VllmConfig, source: str | None) -> None:
    """What balance scheduling cannot serve. The gather runs in vLLM's DP engine cores (processes or Ray actors):
    an in-process engine is no DP engine core, so the gate could never close; ranks added by elastic EP would wait
    in vain for the running ranks' agreement. A PD-disaggregated instance does not run the mixed prefill+decode lockstep
    the gate is for (upstream refuses it too)."""
    parallel, kv_role = vllm_config.parallel_config, getattr(vllm_config.kv_transfer_config, "kv_role", None)
    dp, no_gather = parallel.data_parallel_size > 1, "the per-step gather runs only in vLLM's DP engine cores"
    refused = (  # (refused when, the setting, why)
        (dp and parallel.distributed_executor_backend == "external_launcher", "distributed_executor_backend="
         "'external_launcher' with data parallelism", no_gather + ", so the gate could never close"),
        (dp and not envs.VLLM_ENABLE_V1_MULTIPROCESSING, "VLLM_ENABLE_V1_MULTIPROCESSING=0 with data parallelism",
         no_gather + ", so the gate could never close"),
        (getattr(parallel, "enable_elastic_ep", False), "enable_elastic_ep=True (--enable-elastic-ep)",
         "engine cores added at scale-up would wait in vain for the running ranks' start-up agreement"),
        (vllm_config.kv_transfer_config is not None and kv_role != "kv_both", f"kv_role={kv_role!r} (PD-disaggregated"
         " serving)", "only PD-mixed serving (no kv_transfer_config, or kv_role='kv_both') steps in lockstep"),
    )  # fmt: skip
    for what, why in [(setting, why) for present, setting, why in refused if present][:1]:
        raise ValueError(f"Balance scheduling ({source}) does not support {what}: {why}. Change it or {SWITCHES_OFF}.")


# ---- the wrappers -------------------------------------------------------------------------------------------------


def register() -> None:
    """Install the two config-time wrappers (idempotent); nothing else changes until a config decides balance
    scheduling on."""
    wrap_once(SchedulerConfig, "get_scheduler_cls", _balanced_get_scheduler_cls)
    wrap_once(VllmConfig, "__post_init__", _deciding_post_init)


def wrap_once(owner: type, name: str, make_wrapper: Callable[[Callable[..., Any]], Any]) -> None:
    """Wrap ``owner.name`` with ``make_wrapper(current)`` unless a layer of it already is one (plugins load once
    per process, but a second ``register()`` must never stack wrappers)."""
    current = layer = owner.__dict__[name]
    while layer is not None:
        if getattr(layer, _WRAPPED_MARK, None) == make_wrapper.__name__:
            return
        layer = getattr(layer, "__wrapped__", None)
    wrapper = functools.update_wrapper(make_wrapper(current), current)
    setattr(wrapper, _WRAPPED_MARK, make_wrapper.__name__)
    setattr(owner, name, wrapper)


def _balanced_get_scheduler_cls(original: Callable[[SchedulerConfig], type]) -> Callable[..., type]:
    def get_scheduler_cls(self: SchedulerConfig) -> type:
        resolved = original(self)
        if not recorded_decision(self):
            return resolved
        from vllm_ascend.core.balance_scheduler import balance_scheduler_class

        balanced = balance_scheduler_class(resolved)
        logger.info_once("Balance scheduling: using %s (over %s).", balanced.__qualname__, resolved)
        return balanced

    return get_scheduler_cls


def _deciding_post_init(original: Callable[..., None]) -> Callable[..., None]:
    def __post_init__(self: VllmConfig, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if decide(self):
            install_engine_route()
            if self.parallel_config.data_parallel_backend == "ray":
                install_ray_route()

    return __post_init__


# ---- the engine-core route ----------------------------------------------------------------------------------------


def install_engine_route() -> None:
    """Front-end side: engine-core launches go through ``run_engine_core`` (idempotent)."""
    global _vllm_run_engine_core
    if EngineCoreProc.run_engine_core is run_engine_core:
        return
    balance_seam.refuse_if(
        balance_seam.engine_seam_problems(),
        "Balance scheduling is on, but the installed vLLM's engine core no longer offers the seam the balance "
        "gather relies on (one gather per active DP engine step)",
        f"For this vLLM, {SWITCHES_OFF}.",
    )
    _vllm_run_engine_core = vllm_run_engine_core()
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)


def install_ray_route() -> None:
    """Front-end side, Ray DP backend: vLLM's actor launcher builds the balanced actor (idempotent)."""
    from vllm_ascend.core.balance_engine_core import BalanceDPMoEEngineCoreActor

    balance_seam.refuse_if(
        balance_seam.ray_seam_problems(),
        "Balance scheduling is on with data_parallel_backend='ray', but the installed vLLM's Ray DP engine "
        "actors no longer offer the seam the balance gather relies on",
        f"Use the multiprocessing DP backend (the default) or {SWITCHES_OFF}.",
    )
    engine_core_module.DPMoEEngineCoreActor = BalanceDPMoEEngineCoreActor


def run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """Engine-core process entry (the launcher's target): vLLM's, with the hook class in place.

    Deliberately not ``functools.wraps``-ed: pickling must name this module and function, not vLLM's, or a
    spawned child would import vLLM's original instead.
    """
    vllm_run = _vllm_run_engine_core or vllm_run_engine_core()
    # Not logged here: vLLM >= 0.33 configures an engine process's logging inside its run_engine_core, and a line
    # logged before would be lost (info_once would then drop it for good); the scheduler's resolution logs it.
    if recorded_decision(kwargs["vllm_config"].scheduler_config, log=False):
        from vllm_ascend.core.balance_engine_core import BalanceDPEngineCoreProc

        engine_core_module.DPEngineCoreProc = BalanceDPEngineCoreProc
    return vllm_run(*args, **kwargs)


def vllm_run_engine_core() -> Callable[..., Any]:
    """vLLM's own ``run_engine_core`` as bound on ``EngineCoreProc`` now; anything else is refused (the route
    could not tell which engine-core class it builds)."""
    function = EngineCoreProc.run_engine_core
    name = f"{function.__module__}.{function.__qualname__}"
    if name != f"{engine_core_module.__name__}.EngineCoreProc.run_engine_core":
        raise RuntimeError(
            f"Balance scheduling is on, but EngineCoreProc.run_engine_core is {name}, not vLLM's; balance "
            f"scheduling cannot tell which engine-core class it builds. Remove that patch or {SWITCHES_OFF}."
        )
    return function
