"""The balance-scheduling switch and the configurations it refuses.

One place reads ``VLLM_ASCEND_BALANCE_SCHEDULING`` so the plugin, the scheduler and the engine hook
agree on its meaning and reject bad values the same way.
"""

from __future__ import annotations

import os

from vllm.config import VllmConfig

BALANCE_SCHEDULING_ENV = "VLLM_ASCEND_BALANCE_SCHEDULING"
_FLAG_VALUES = {"0": False, "1": True}


def balance_scheduling_flag() -> bool:
    """The value of ``VLLM_ASCEND_BALANCE_SCHEDULING``: "1" on, "0" or unset off.

    Any other value is an error rather than a guess: upstream reads it with ``bool(int(...))``,
    so "true" would crash there and "2" would silently enable it.
    """
    raw = os.environ.get(BALANCE_SCHEDULING_ENV, "0")
    if raw not in _FLAG_VALUES:
        raise ValueError(
            f"{BALANCE_SCHEDULING_ENV}={raw!r} is not valid: accepted values are "
            f"'1' (balance scheduling on) and '0' or unset (off).")
    return _FLAG_VALUES[raw]


def check_balance_scheduling_supported(vllm_config: VllmConfig) -> None:
    """Refuse configurations balance scheduling cannot serve (PD-disaggregated roles).

    A prefill-only or decode-only instance of a PD-disaggregated deployment does not run the
    mixed prefill+decode lockstep the gate is designed for; upstream refuses it too.
    """
    kv_transfer_config = vllm_config.kv_transfer_config
    kv_role = getattr(kv_transfer_config, "kv_role", None)
    if kv_transfer_config is not None and kv_role != "kv_both":
        raise ValueError(
            f"{BALANCE_SCHEDULING_ENV}=1 (balance scheduling) supports only PD-mixed serving "
            f"(no kv_transfer_config, or kv_role='kv_both'); got kv_role={kv_role!r}. Unset "
            f"{BALANCE_SCHEDULING_ENV} for PD-disaggregated (kv_producer/kv_consumer) instances.")
