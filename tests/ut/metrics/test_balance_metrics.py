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
"""The gate on /metrics, on real vLLM objects: real balanced schedulers stepped with real requests, their stats
through vLLM's own msgpack encoder/decoder of ``EngineCoreOutputs`` (the engine -> front-end wire), vLLM's own
``StatLoggerManager`` (with its Prometheus and logging loggers) loading this logger from the installed entry point,
and the text exposition of ``prometheus_client``'s registry parsed with its parser.

The seams these checks pin (each fails when vLLM moves it): ``SchedulerStats.running_lora_adapters`` travels as a
``dict[str, int]``; custom stat loggers are called before vLLM's own (so the carried keys are gone when vLLM's
loggers read the dict); vLLM's ``PrometheusStatLogger`` unregisters "vllm:" collectors when it is built, before
``log_engine_initialized``; stat-logger plugins load from ``vllm.stat_logger_plugins`` under ``VLLM_PLUGINS``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from offline_vllm import build_scheduler, emulate_gather, make_request, make_vllm_config, step
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager, load_stat_logger_plugin_factories
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_ascend.core.balance_metrics import METRICS, BalanceStatLogger
from vllm_ascend.core.balance_scheduler import STATS_PREFIX, BalanceScheduler
from vllm_ascend_balance.patch_balance_schedule import decide

CAP, DP = 2, 2
DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana-balance-scheduling.json"
# A /metrics scrape of a real `vllm serve` with balance on (saved by tests/e2e_cpu, see docs/metrics.md).
SCRAPE = Path(__file__).resolve().parent / "data" / "scrape-balance-on-v0.18.0.txt"
NAMES = [f"vllm:balance_{key}" for key in METRICS]


def config(model: Path, balance: bool) -> Any:
    vllm_config = make_vllm_config(
        model,
        max_num_seqs=CAP,
        dp_size=DP,
        additional_config={"scheduler_config": {"enable_balance_scheduling": balance}},
    )
    decide(vllm_config)  # as vLLM's VllmConfig.__post_init__ does with the plugin loaded
    return vllm_config


def wire(stats: SchedulerStats | None) -> SchedulerStats:
    """``stats`` as the front-end receives them: vLLM's own encoder and decoder of EngineCoreOutputs."""
    frames = MsgpackEncoder().encode(EngineCoreOutputs(engine_index=1, scheduler_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert decoded.scheduler_stats is not None
    return decoded.scheduler_stats


def scrape() -> dict[tuple[str, str], float]:
    """Every balance sample of the default registry (what /metrics serves with one API server), by (name, engine)."""
    text = prometheus_client.generate_latest().decode()
    return {
        (sample.name, sample.labels["engine"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:balance_") and not sample.name.endswith("_created")
    }


def families() -> set[str]:
    """Names of the balance metric families the default registry serves (HELP/TYPE even before any sample)."""
    text = prometheus_client.generate_latest().decode()
    return {family.name for family in text_string_to_metric_families(text) if family.name.startswith("vllm:balance_")}


@pytest.fixture
def manager_for(tiny_moe_model: Path) -> Any:
    """vLLM's StatLoggerManager as AsyncLLM builds it (plugins from the entry points), for balance on or off."""

    def make(balance: bool) -> StatLoggerManager:
        factories = load_stat_logger_plugin_factories()
        manager = StatLoggerManager(
            config(tiny_moe_model, balance), engine_idxs=list(range(DP)), custom_stat_loggers=factories
        )
        manager.log_engine_initialized()
        return manager

    return make


def test_the_entry_point_loads_this_logger_under_the_plugin_name() -> None:
    # conftest.py sets VLLM_PLUGINS=ascend_balance_scheduling: the one name admits the plugin and its metrics.
    assert load_stat_logger_plugin_factories() == [BalanceStatLogger]


def test_gate_counts_reach_metrics_exactly(tiny_moe_model: Path, manager_for: Any) -> None:
    manager = manager_for(True)
    # Custom loggers first, vLLM's Prometheus logger last: the carried keys are gone before vLLM reads the dict.
    assert isinstance(manager.stat_loggers[0], BalanceStatLogger)
    assert isinstance(manager.stat_loggers[-1], PrometheusStatLogger)
    assert set(NAMES) <= families(), "metrics unregistered by vLLM's PrometheusStatLogger"
    scheduler = build_scheduler(BalanceScheduler, config(tiny_moe_model, True))
    for index in range(5):
        scheduler.add_request(make_request(f"r{index}", num_prompt_tokens=8, max_tokens=6))
    before = scrape()
    states = []
    for number in range(8):
        # Rank 1 at the cap for steps 2-4: the gate closes on this rank too, with requests waiting behind it.
        emulate_gather([scheduler], [0, CAP if 2 <= number <= 4 else 0])
        _, outputs = step(scheduler)
        stats = wire(next(iter(outputs.values())).scheduler_stats)
        manager.record(scheduler_stats=stats, iteration_stats=None, engine_idx=1)
        assert stats.running_lora_adapters == {}, "a carried key reached vLLM's own loggers"
        states.append(scrape()[("vllm:balance_gate_closed", "1")])
    after = scrape()

    def moved(name: str) -> float:
        return after[(name, "1")] - before.get((name, "1"), 0.0)

    assert moved("vllm:balance_steps_total") == scheduler.balance_steps == 8
    assert moved("vllm:balance_gated_steps_total") == scheduler.balance_gated_steps == 3
    assert moved("vllm:balance_waiting_gated_steps_total") == scheduler.balance_waiting_gated_steps == 3
    # The state of the step each stats follow (make_stats runs before the step's gather).
    assert states == [0, 0, 1, 1, 1, 0, 0, 0]
    assert after[("vllm:balance_gate_rule", "1")] == 0  # 0 = "cap"
    assert ("vllm:balance_steps_total", "0") not in after  # engine 0 sent nothing


def test_the_rule_in_force_is_carried(tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm:balance_gate_rule: 0 cap; adaptive 2 while it admits without waiting (until its first fit, too), 1 while
    it holds."""
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_GATE_RULE", "adaptive")
    scheduler = build_scheduler(BalanceScheduler, config(tiny_moe_model, True))
    scheduler.add_request(make_request("r0", num_prompt_tokens=8, max_tokens=6))
    _, outputs = step(scheduler)
    assert next(iter(outputs.values())).scheduler_stats.running_lora_adapters[f"{STATS_PREFIX}gate_rule"] == 2
    scheduler._balance_hold.holding = True
    assert scheduler.make_stats().running_lora_adapters[f"{STATS_PREFIX}gate_rule"] == 1


def test_balance_off_registers_nothing(tiny_moe_model: Path, manager_for: Any) -> None:
    manager_for(False)
    assert not families(), "balance off, yet balance metrics are registered"


def test_payload_travels_as_the_typed_field(tiny_moe_model: Path) -> None:
    """The seam: vLLM's decoder keeps ``running_lora_adapters`` as dict[str, int]; an attribute or a bool would not
    travel (they are what this test would catch if the field's type or the encoder changed)."""
    scheduler = build_scheduler(BalanceScheduler, config(tiny_moe_model, True))
    emulate_gather([scheduler], [CAP, CAP])
    scheduler.add_request(make_request("a"))
    _, outputs = step(scheduler)
    stats = next(iter(outputs.values())).scheduler_stats
    stats.extra_attribute = 1
    received = wire(stats)
    assert not hasattr(received, "extra_attribute")
    carried = {k: v for k, v in received.running_lora_adapters.items() if k.startswith(STATS_PREFIX)}
    assert carried == {
        f"{STATS_PREFIX}steps": 1,
        f"{STATS_PREFIX}gated_steps": 1,
        f"{STATS_PREFIX}waiting_gated_steps": 1,
        f"{STATS_PREFIX}gate_closed": 1,
        f"{STATS_PREFIX}gate_rule": 0,
    }
    assert all(type(v) is int for v in carried.values())


def test_stock_scheduler_stats_carry_nothing(tiny_moe_model: Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = build_scheduler(Scheduler, config(tiny_moe_model, False))
    scheduler.add_request(make_request("a"))
    _, outputs = step(scheduler)
    assert wire(next(iter(outputs.values())).scheduler_stats).running_lora_adapters == {}


def dashboard_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    assert exprs, "dashboard without queries"
    return {name for expr in exprs for name in re.findall(r"vllm:[a-z_:]+", expr)}


def scraped_names(text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_dashboard_queries_name_metrics_of_a_real_scrape() -> None:
    names = scraped_names(SCRAPE.read_text())
    missing = dashboard_metrics() - names
    assert not missing, f"dashboard queries metrics absent from {SCRAPE.name}: {sorted(missing)}"
    assert {"vllm:balance_gated_steps_total", "vllm:time_to_first_token_seconds_bucket"} <= dashboard_metrics()


def test_dashboard_check_fails_on_an_unknown_metric() -> None:
    names = scraped_names(SCRAPE.read_text())
    assert "vllm:balance_gated_steps_totl" not in names  # the check above would name it
