"""The balance-scheduling switch and the configurations it refuses.

One place decides whether balance scheduling is on, so the plugin, the scheduler and the engine
hook agree on it and reject bad values the same way. There are two switches, accepted on every
release line (the vllm-ascend 0.18 line reads only the first, the 0.23 line prefers the second and
deprecates the first):

* the environment variable ``VLLM_ASCEND_BALANCE_SCHEDULING`` ("1" on, "0" or unset off);
* ``additional_config={"enable_balance_scheduling": true}`` in vLLM's config
  (``--additional-config '{"enable_balance_scheduling": true}'``).

The config is the more specific setting (one engine, not every process of the shell), so when it
names the key it wins; the environment variable decides only when the config says nothing. The
log says which of the two decided.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger

# Under "vllm." so vLLM's logging configuration (handler, level, format) applies to it.
logger = init_logger(f"vllm.{__name__}")

BALANCE_SCHEDULING_ENV = "VLLM_ASCEND_BALANCE_SCHEDULING"
BALANCE_SCHEDULING_CONFIG_KEY = "enable_balance_scheduling"
_FLAG_VALUES = {"0": False, "1": True}


def balance_scheduling_flag() -> bool:
    """The value of ``VLLM_ASCEND_BALANCE_SCHEDULING`` alone: "1" on, "0" or unset off.

    Any other value is an error rather than a guess: upstream reads it with ``bool(int(...))``,
    so "true" would crash there and "2" would silently enable it. Where a ``VllmConfig`` is at
    hand, use ``balance_scheduling_enabled`` instead: the config's switch overrides this one.
    """
    raw = os.environ.get(BALANCE_SCHEDULING_ENV, "0")
    if raw not in _FLAG_VALUES:
        raise ValueError(
            f"{BALANCE_SCHEDULING_ENV}={raw!r} is not valid: accepted values are "
            f"'1' (balance scheduling on) and '0' or unset (off).")
    return _FLAG_VALUES[raw]


def config_balance_switch(vllm_config: VllmConfig | None) -> bool | None:
    """``additional_config["enable_balance_scheduling"]``, or None when the config says nothing.

    Only JSON booleans are accepted: vllm-ascend reads the key with ``bool(value)``, so the
    string "false" would turn balance scheduling *on* there. An ``additional_config`` that is
    not a mapping (vLLM also allows a hashable object for other plugins) says nothing here.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, Mapping) or BALANCE_SCHEDULING_CONFIG_KEY not in additional:
        return None
    value: Any = additional[BALANCE_SCHEDULING_CONFIG_KEY]
    if not isinstance(value, bool):
        raise ValueError(
            f"additional_config[{BALANCE_SCHEDULING_CONFIG_KEY!r}]={value!r} is not valid: "
            f"accepted values are true and false (JSON booleans), e.g. --additional-config "
            f"'{{\"{BALANCE_SCHEDULING_CONFIG_KEY}\": true}}'.")
    return value


def balance_scheduling_enabled(vllm_config: VllmConfig | None) -> bool:
    """Whether balance scheduling is on for ``vllm_config``, and log (once) which switch decided.

    ``additional_config["enable_balance_scheduling"]`` wins when present; otherwise
    ``VLLM_ASCEND_BALANCE_SCHEDULING`` decides; otherwise it is off. A bad value in either
    switch is an error, even the one that does not decide: it is a typo the user should see.
    ``vllm_config=None`` (a process that has no config yet) leaves only the environment variable.
    """
    env_value = balance_scheduling_flag()
    env_set = BALANCE_SCHEDULING_ENV in os.environ
    config_value = config_balance_switch(vllm_config)
    if config_value is not None:
        if env_set and env_value != config_value:
            logger.warning_once(
                "Balance scheduling %s: additional_config[%r]=%s decides; %s=%s is ignored "
                "(the config's switch wins over the environment variable).",
                _on_off(config_value), BALANCE_SCHEDULING_CONFIG_KEY, config_value,
                BALANCE_SCHEDULING_ENV, os.environ[BALANCE_SCHEDULING_ENV])
        else:
            logger.info_once("Balance scheduling %s: set by additional_config[%r]=%s.",
                             _on_off(config_value), BALANCE_SCHEDULING_CONFIG_KEY, config_value)
        return config_value
    if env_set:
        logger.info_once(
            "Balance scheduling %s: set by %s=%s (additional_config has no %r; vllm-ascend "
            "0.23 deprecates the environment variable in favour of --additional-config "
            "'{\"%s\": true}').", _on_off(env_value), BALANCE_SCHEDULING_ENV,
            os.environ[BALANCE_SCHEDULING_ENV], BALANCE_SCHEDULING_CONFIG_KEY,
            BALANCE_SCHEDULING_CONFIG_KEY)
    return env_value


# Where ``decide_for_config`` records its decision: an attribute of the ``SchedulerConfig`` (not a
# dataclass field), so it pickles with the config into engine-core processes, where
# ``SchedulerConfig.get_scheduler_cls`` has no ``VllmConfig`` to decide from, and stays out of
# vLLM's config hash.
_DECISION_ATTR = "_vllm_ascend_balance_scheduling"


def decide_for_config(vllm_config: VllmConfig) -> bool:
    """``balance_scheduling_enabled(vllm_config)``, recorded on its ``SchedulerConfig``."""
    enabled = balance_scheduling_enabled(vllm_config)
    setattr(vllm_config.scheduler_config, _DECISION_ATTR, enabled)
    return enabled


def recorded_decision(scheduler_config: Any) -> bool:
    """The decision ``decide_for_config`` recorded; the env flag for a ``SchedulerConfig`` that
    never went through a ``VllmConfig`` (there is no config switch to read then)."""
    decision = getattr(scheduler_config, _DECISION_ATTR, None)
    return balance_scheduling_flag() if decision is None else bool(decision)


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def check_balance_scheduling_supported(vllm_config: VllmConfig) -> None:
    """Refuse configurations balance scheduling cannot serve.

    A prefill-only or decode-only instance of a PD-disaggregated deployment does not run the
    mixed prefill+decode lockstep the gate is designed for; upstream refuses it too. Ray-based DP
    builds its engine actors from classes bound at import time, which the gather hook cannot
    reach: the gate would silently never close, so it is refused instead.
    """
    parallel_config = vllm_config.parallel_config
    backend = getattr(parallel_config, "data_parallel_backend", "mp")
    if parallel_config.data_parallel_size > 1 and backend == "ray":
        raise ValueError(
            f"Balance scheduling ({BALANCE_SCHEDULING_ENV}=1) does not support "
            "data_parallel_backend='ray': Ray's DP engine actors never run the per-step gather, "
            "so the gate could never close. Use the default multiprocessing DP backend ('mp') "
            f"or unset {BALANCE_SCHEDULING_ENV}.")
    kv_transfer_config = vllm_config.kv_transfer_config
    kv_role = getattr(kv_transfer_config, "kv_role", None)
    if kv_transfer_config is not None and kv_role != "kv_both":
        raise ValueError(
            f"Balance scheduling ({BALANCE_SCHEDULING_ENV}=1 or additional_config"
            f"[{BALANCE_SCHEDULING_CONFIG_KEY!r}]=true) supports only PD-mixed serving "
            f"(no kv_transfer_config, or kv_role='kv_both'); got kv_role={kv_role!r}. Unset "
            f"{BALANCE_SCHEDULING_ENV} (and additional_config[{BALANCE_SCHEDULING_CONFIG_KEY!r}]) "
            f"for PD-disaggregated (kv_producer/kv_consumer) instances.")
