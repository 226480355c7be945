"""The two balance switches, on every release line: ``additional_config`` wins, the env decides
only when the config says nothing, bad values are errors, and the log names the deciding switch.

vllm-ascend 0.18 reads only ``VLLM_ASCEND_BALANCE_SCHEDULING``; 0.23 prefers
``additional_config={"enable_balance_scheduling": true}`` and deprecates the env flag. The same
source accepts both on both lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from offline_vllm import build_scheduler, emulate_gather, make_request, make_vllm_config, step
from pytest_mock import MockerFixture
from vllm.config import KVTransferConfig, SchedulerConfig
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ascend.core.balance_scheduler import BalanceScheduler
from vllm_ascend_balance import patch_balance_schedule as wiring
from vllm_ascend_balance.patch_balance_schedule import (
    BALANCE_SCHEDULING_CONFIG_KEY,
    BALANCE_SCHEDULING_ENV,
    decide,
    recorded_decision,
    switches,
)

CAP = 2


def with_switch(config: Any, value: Any) -> Any:
    config.additional_config = {BALANCE_SCHEDULING_CONFIG_KEY: value}
    return config


@pytest.fixture
def config(tiny_model: Path) -> Any:
    return make_vllm_config(tiny_model, max_num_seqs=CAP, dp_size=2)


# ---- which switch decides -------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, config_value, expected",
    [
        (None, True, True),
        (None, False, False),
        ("0", True, True),  # the config wins over the env...
        ("1", False, False),  # ...in both directions
        ("1", None, True),  # the env decides only when the config says nothing
        ("0", None, False),
        (None, None, False),  # neither: off
    ],
)
def test_config_wins_and_env_decides_only_when_config_is_silent(
    monkeypatch: pytest.MonkeyPatch, config: Any, env: str | None, config_value: bool | None, expected: bool
) -> None:
    if env is None:
        monkeypatch.delenv(BALANCE_SCHEDULING_ENV, raising=False)
    else:
        monkeypatch.setenv(BALANCE_SCHEDULING_ENV, env)
    if config_value is not None:
        with_switch(config, config_value)
    assert decide(config) is expected
    assert recorded_decision(config.scheduler_config) is expected


@pytest.mark.parametrize(
    "nested, top_level, env, expected",
    [
        (True, False, "0", True),  # the nested key wins over both...
        (False, True, "1", False),  # ...in both directions
        (None, True, "0", True),  # then the top-level key
        (None, None, "1", True),  # then the environment variable
        (False, None, None, False),
    ],
)
def test_nested_key_wins_over_the_top_level_key_over_the_env(
    monkeypatch: pytest.MonkeyPatch,
    config: Any,
    nested: bool | None,
    top_level: bool | None,
    env: str | None,
    expected: bool,
) -> None:
    """vllm-ascend main's precedence, on every line (a user upgrading keeps the same --additional-config)."""
    if env is None:
        monkeypatch.delenv(BALANCE_SCHEDULING_ENV, raising=False)
    else:
        monkeypatch.setenv(BALANCE_SCHEDULING_ENV, env)
    additional: dict[str, Any] = {"scheduler_config": {"some_other_option": 1}}
    if nested is not None:
        additional["scheduler_config"][BALANCE_SCHEDULING_CONFIG_KEY] = nested
    if top_level is not None:
        additional[BALANCE_SCHEDULING_CONFIG_KEY] = top_level
    config.additional_config = additional
    assert decide(config) is expected


@pytest.mark.parametrize("value", ["true", 1, None])
def test_non_boolean_nested_value_is_a_clear_error(balance_env_unset: None, config: Any, value: Any) -> None:
    config.additional_config = {"scheduler_config": {BALANCE_SCHEDULING_CONFIG_KEY: value}}
    with pytest.raises(ValueError, match=r"\['scheduler_config'\]\['enable_balance_scheduling'\].*true or false"):
        decide(config)


def test_a_bad_top_level_value_is_an_error_even_when_the_nested_key_decides(
    balance_env_unset: None, config: Any
) -> None:
    config.additional_config = {
        "scheduler_config": {BALANCE_SCHEDULING_CONFIG_KEY: True},
        "enable_balance_scheduling": "no",
    }
    with pytest.raises(ValueError, match=r"additional_config\['enable_balance_scheduling'\]='no'"):
        decide(config)


def test_a_scheduler_config_that_is_not_a_mapping_says_nothing(balance_env_unset: None, config: Any) -> None:
    config.additional_config = {"scheduler_config": "default"}
    assert switches(config) == [] and decide(config) is False


def test_log_names_the_nested_key_without_a_deprecation(
    balance_env_unset: None, config: Any, mocker: MockerFixture
) -> None:
    info = mocker.spy(wiring.logger, "info_once")
    config.additional_config = {"scheduler_config": {BALANCE_SCHEDULING_CONFIG_KEY: True}}
    decide(config)
    text = logged(info)
    assert "on: set by additional_config['scheduler_config']['enable_balance_scheduling']=True." in text
    assert "deprecated" not in text


def test_nested_conflict_warns_that_the_others_are_ignored(
    monkeypatch: pytest.MonkeyPatch, config: Any, mocker: MockerFixture
) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    warning = mocker.spy(wiring.logger, "warning_once")
    config.additional_config = {
        "scheduler_config": {BALANCE_SCHEDULING_CONFIG_KEY: False},
        "enable_balance_scheduling": True,
    }
    assert decide(config) is False
    assert f"additional_config['enable_balance_scheduling']=True, {BALANCE_SCHEDULING_ENV}=1 is ignored" in logged(
        warning
    )


def test_a_scheduler_config_never_decided_leaves_only_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    never_decided = SchedulerConfig(max_model_len=1024, is_encoder_decoder=False)
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    assert recorded_decision(never_decided) is True
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "0")
    assert recorded_decision(never_decided) is False


def test_the_recorded_decision_outlives_the_switches(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    """An engine-core process reads what the front-end decided; it never decides again."""
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    decide(config)
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "0")
    assert recorded_decision(config.scheduler_config) is True


def test_other_additional_config_keys_say_nothing(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    config.additional_config = {"enable_flashcomm1": False}
    assert switches(config) == [(f"{BALANCE_SCHEDULING_ENV}=1", True)]
    assert decide(config) is True


@pytest.mark.parametrize("value", ["true", "false", 1, 0, None, "1"])
def test_non_boolean_config_value_is_a_clear_error(balance_env_unset: None, config: Any, value: Any) -> None:
    # vllm-ascend reads bool(value): the string "false" would silently turn it on there.
    with_switch(config, value)
    with pytest.raises(ValueError, match=r"enable_balance_scheduling.*true or false"):
        decide(config)


def test_bad_env_value_is_an_error_even_when_the_config_decides(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "yes")
    with pytest.raises(ValueError, match=BALANCE_SCHEDULING_ENV):
        decide(with_switch(config, True))


# ---- what the log says ------------------------------------------------------------------------


def logged(spy: Any) -> str:
    return "\n".join(call.args[0] % call.args[1:] for call in spy.call_args_list)


def test_log_names_the_config_when_it_decides(balance_env_unset: None, config: Any, mocker: MockerFixture) -> None:
    info = mocker.spy(wiring.logger, "info_once")
    decide(with_switch(config, True))
    assert "on: set by additional_config['enable_balance_scheduling']=True" in logged(info)


def test_log_names_the_env_and_its_deprecation_when_it_decides(
    monkeypatch: pytest.MonkeyPatch, config: Any, mocker: MockerFixture
) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    info = mocker.spy(wiring.logger, "info_once")
    decide(config)
    text = logged(info)
    assert f"on: set by {BALANCE_SCHEDULING_ENV}=1" in text and "deprecated" in text


def test_conflict_warns_that_the_env_is_ignored(
    monkeypatch: pytest.MonkeyPatch, config: Any, mocker: MockerFixture
) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    warning = mocker.spy(wiring.logger, "warning_once")
    assert decide(with_switch(config, False)) is False
    assert f"{BALANCE_SCHEDULING_ENV}=1 is ignored" in logged(warning)


def test_nothing_is_logged_when_no_switch_is_set(balance_env_unset: None, config: Any, mocker: MockerFixture) -> None:
    info = mocker.spy(wiring.logger, "info_once")
    warning = mocker.spy(wiring.logger, "warning_once")
    assert decide(config) is False
    assert info.call_count == warning.call_count == 0


# ---- the switch reaches a real scheduler ------------------------------------------------------


def resolved_scheduler(config: Any) -> Any:
    """The scheduler vLLM's EngineCore would build from ``config`` with the wiring registered."""
    wiring.register()
    decide(config)  # what the wrapped VllmConfig.__post_init__ does when the config is built
    return build_scheduler(config.scheduler_config.get_scheduler_cls(), config)


def test_config_switch_alone_turns_the_gate_on(balance_env_unset: None, config: Any) -> None:
    scheduler = resolved_scheduler(with_switch(config, True))
    assert isinstance(scheduler, BalanceScheduler)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", max_tokens=20))
    emulate_gather([scheduler], [0, CAP])  # the other rank is at its cap
    output, _ = step(scheduler)
    assert output.scheduled_new_reqs == []
    assert scheduler.balance_gated_steps == 1


def test_config_switch_off_overrides_the_env_in_the_scheduler(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "1")
    scheduler = resolved_scheduler(with_switch(config, False))
    assert type(scheduler) is Scheduler
    scheduler.add_request(make_request("r0"))
    assert [r.req_id for r in step(scheduler)[0].scheduled_new_reqs] == ["r0"]


def test_pd_refusal_names_both_switches(balance_env_unset: None, tiny_model: Path) -> None:
    config = make_vllm_config(
        tiny_model,
        dp_size=2,
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer"),
    )
    with pytest.raises(ValueError, match=r"does not support kv_role='kv_producer'.*only PD-mixed") as error:
        decide(with_switch(config, True))
    assert BALANCE_SCHEDULING_ENV in str(error.value)
    assert BALANCE_SCHEDULING_CONFIG_KEY in str(error.value)


@pytest.mark.parametrize("named", [BalanceScheduler, "vllm_ascend.core.balance_scheduler.BalanceScheduler"])
def test_naming_a_balanced_class_switches_balance_on(balance_env_unset: None, tiny_model: Path, named: Any) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=named)
    assert decide(config) is True
    wiring.register()
    assert config.scheduler_config.get_scheduler_cls() is BalanceScheduler


def test_naming_a_balanced_class_with_a_switch_off_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    monkeypatch.setenv(BALANCE_SCHEDULING_ENV, "0")
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=BalanceScheduler)
    with pytest.raises(ValueError, match="is a balance scheduling class, but balance scheduling is switched off"):
        decide(config)
