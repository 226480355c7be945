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
"""What the balance gate did, on vLLM's ``/metrics``, per DP engine (labels ``model_name``, ``engine``).

Operators watch vLLM through Prometheus; the gate's only other trace is the engines' shutdown line, often lost when
vLLM force-kills them. vLLM loads this stat logger from the ``vllm.stat_logger_plugins`` entry point in every API
server and calls it, before its own loggers, with each engine's ``SchedulerStats``. The engine-side counts arrive in
those stats: the balanced scheduler's ``make_stats`` adds, under ``STATS_PREFIX`` in ``running_lora_adapters`` (a
``dict[str, int]``, one of the few fields vLLM's typed message carries that only LoRA reads), its counts *since the
previous stats*; every stats message reaches exactly one API server, so counters summed over API servers (vLLM's
multiprocess collector with ``--api-server-count`` > 1) are the engines' exact totals, and gauges are the most recent
value. This logger takes the keys out before vLLM's loggers see the dict. The metrics exist only when balance
scheduling is on (the recorded decision); ``docs/metrics.md`` says what each one means.
"""

from prometheus_client import Counter, Gauge
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats

from vllm_ascend_balance.patch_balance_schedule import recorded_decision

# Carried key -> (metric ``vllm:balance_<key>``, one-line help): counters add the engine's increments, gauges show
# its latest value. Every one is per engine (DP rank).
METRICS: dict[str, tuple[type[Counter] | type[Gauge], str]] = {
    "gate_closed": (Gauge, "1 while the balance gate is closed (a DP rank was at its cap at the last gather), else 0."),
    "steps": (Counter, "schedule() steps of this engine with balance scheduling on (engine_steps at shutdown)."),
    "gated_steps": (Counter, "Steps the balance gate was closed on this engine: no new request admitted."),
    "waiting_gated_steps": (Counter, "Gated steps in which this engine had a request waiting (the gate kept it out)."),
    "gate_rule": (Gauge, "Balance gate rule in force: 0 = cap, 1 = adaptive and holding, 2 = adaptive, admitting."),
}


class BalanceStatLogger(AggregateStatLoggerBase):
    """vLLM stat logger for the balance gate: one per API server, covering every DP engine it hears from."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
        self.vllm_config = vllm_config
        self.metrics: dict[str, Counter | Gauge] = {}

    def log_engine_initialized(self) -> None:
        # Not in __init__: vLLM's PrometheusStatLogger, built after this logger, unregisters every "vllm:" collector;
        # vLLM calls this once all its loggers are built.
        if recorded_decision(self.vllm_config.scheduler_config, log=False) and not self.metrics:
            # Imported with balance on only: the module binds vLLM's scheduler classes as they are at import.
            from vllm_ascend.core.balance_scheduler import STATS_PREFIX

            self.prefix = STATS_PREFIX
            for key, (kind, text) in METRICS.items():
                mode = {"multiprocess_mode": "mostrecent"} if kind is Gauge else {}
                self.metrics[key] = kind(f"vllm:balance_{key}", text, ["model_name", "engine"], **mode)

    def record(self, scheduler_stats: SchedulerStats | None, *args: object, engine_idx: int = 0, **_: object) -> None:
        carried = scheduler_stats.running_lora_adapters if self.metrics and scheduler_stats else {}
        got = {key[len(self.prefix) :]: carried.pop(key) for key in [k for k in carried if k.startswith(self.prefix)]}
        for key, metric in self.metrics.items() if got else ():
            child = metric.labels(self.vllm_config.model_config.served_model_name, str(engine_idx))
            (child.inc if isinstance(child, Counter) else child.set)(got[key])
