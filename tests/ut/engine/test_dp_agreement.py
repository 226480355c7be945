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
"""Every DP rank agrees on balance scheduling at start-up, or every rank fails fast; what cannot gather is refused.

Each DP rank is an OS process (forked) doing what a DP engine core does before its model loads: its class's real
``_init_data_parallel`` (``BalanceDPEngineCoreProc`` for a balanced rank, vLLM's own ``DPEngineCoreProc`` for a stock
one), so the gloo group and ``dp_store`` are exactly vLLM's and a balanced rank runs the agreement; then the first
collectives its busy loop runs (balanced: ``balance_gather`` and vLLM's ``has_unfinished_dp``; stock: vLLM's alone).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from offline_vllm import build_scheduler, make_request, make_vllm_config
from vllm.config import ParallelConfig, VllmConfig
from vllm.v1.engine.core import DPEngineCoreProc

from vllm_ascend.core import balance_engine_core
from vllm_ascend.core.balance_engine_core import AGREEMENT_TIMEOUT_ENV, BalanceDPEngineCoreProc
from vllm_ascend.core.balance_rule import RULE_ENV
from vllm_ascend.core.balance_scheduler import BalanceScheduler
from vllm_ascend_balance.patch_balance_schedule import decide, register

BOUND_S = 90.0  # every process of a group must have exited by then, whatever the outcome
SHORT_AGREEMENT_S = "3"  # the agreement's bound where a rank is missing (the default, 60 s, elsewhere)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int, stock: bool, config: VllmConfig, port: int, result: Path, code: str | None, rule_steps: int
) -> None:
    os.setsid()  # its own process group: the test kills the whole tree by it
    outcome: dict[str, Any] = {"rank": rank, "stock": stock}
    try:
        parallel = config.parallel_config
        parallel.data_parallel_rank = parallel.data_parallel_rank_local = rank
        parallel.data_parallel_master_ip, parallel.data_parallel_master_port = "127.0.0.1", port
        parallel._data_parallel_master_port_list = []
        if code is not None:  # this rank runs other balance scheduling code
            settings = balance_engine_core.balance_settings
            balance_engine_core.balance_settings = lambda vllm_config: {**settings(vllm_config), "code": code}
        engine_cls = DPEngineCoreProc if stock else BalanceDPEngineCoreProc
        core = object.__new__(engine_cls)
        engine_cls._init_data_parallel(core, config)
        if not stock:
            scheduler = build_scheduler(BalanceScheduler, config)
            for index in range(rank):  # rank r runs r requests: the gather must show [0, 1, 2, ...]
                scheduler.add_request(make_request(f"r{rank}-{index}"))
            scheduler.schedule()
            scheduler.balance_gather(core.dp_group)
            outcome["gathered"] = [int(slot.item()) for slot in scheduler.balance_queue]
            rng = random.Random(7)  # the same draws on every rank: the group's steps
            for _ in range(rule_steps):
                # Each rank reports its own prefill tokens and its own (slightly different) time for the step.
                prefill = [rng.choice((0, 0, 0, 256, 1024)) for _ in range(parallel.data_parallel_size)]
                ms = 20.0 + 100.0 * any(prefill) + 0.05 * sum(prefill) + 0.1 * rank
                scheduler._balance_step = (prefill[rank], int(ms * 1000))
                scheduler.balance_gather(core.dp_group)
            if rule_steps:
                hold = scheduler._balance_hold
                outcome["rule"] = [hold.penalty_s, hold.decode_s, hold.saving_s > hold.slot_s, hold.steps]
        outcome["unfinished"] = ParallelConfig.has_unfinished_dp(core.dp_group, True)
    except BaseException as error:  # noqa: BLE001 - reported to the test
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["ended"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    result.write_text(json.dumps(outcome))
    os._exit(0)


def _kill_tree(process: multiprocessing.process.BaseProcess) -> None:
    if process.pid is not None:
        with contextlib.suppress(ProcessLookupError):  # the child had not made its group yet, or is gone
            os.killpg(process.pid, signal.SIGKILL)
    process.kill()
    process.join()


def run_group(
    configs: list[VllmConfig],
    stock: set[int],
    scratch: Path,
    codes: dict[int, str] | None = None,
    rule_steps: int = 0,
) -> tuple[list[dict[str, Any]], float]:
    """One forked process per DP rank; returns each rank's outcome and the seconds until the last one exited.
    Fails when a process is still running after BOUND_S (it is killed, as every child is at the end)."""
    context = multiprocessing.get_context("fork")
    port = _free_port()
    paths = [scratch / f"rank{rank}.json" for rank in range(len(configs))]
    processes = [
        context.Process(
            target=_rank_main,
            name=f"dp-rank{rank}",
            args=(rank, rank in stock, config, port, paths[rank], (codes or {}).get(rank), rule_steps),
        )
        for rank, config in enumerate(configs)
    ]
    started = time.monotonic()
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(max(started + BOUND_S - time.monotonic(), 0.1))
        elapsed = time.monotonic() - started
        hung = [process.name for process in processes if process.is_alive()]
    finally:
        for process in processes:
            _kill_tree(process)
    assert not hung, f"{hung} still running {BOUND_S:g} s after start: the group hung"
    return [json.loads(path.read_text()) for path in paths], elapsed


@pytest.fixture
def configs(balance_on: None, tiny_moe_model: Path) -> Any:
    def build(dp: int, caps: dict[int, int] | None = None) -> list[VllmConfig]:
        return [
            make_vllm_config(tiny_moe_model, max_num_seqs=(caps or {}).get(rank, 4), dp_size=dp) for rank in range(dp)
        ]

    return build


def test_an_agreeing_group_starts_and_gathers(configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    outcomes, _ = run_group(configs(3), set(), tmp_path)
    for outcome in outcomes:
        assert "error" not in outcome, outcome
        assert outcome["gathered"] == [0, 1, 2] and outcome["unfinished"] is True


def test_the_adaptive_rule_learns_the_same_on_every_rank(
    configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks report different prefill tokens and step times; after the gathers every rank holds the same fit."""
    monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    monkeypatch.setenv(RULE_ENV, "adaptive")
    outcomes, _ = run_group(configs(3), set(), tmp_path, rule_steps=200)
    assert all("error" not in outcome for outcome in outcomes), outcomes
    assert len({json.dumps(outcome["rule"]) for outcome in outcomes}) == 1, [o["rule"] for o in outcomes]
    penalty_s, decode_s, worth_holding, steps = outcomes[0]["rule"]
    assert steps == 200 and worth_holding and penalty_s == pytest.approx(0.1, rel=0.1), outcomes[0]["rule"]


@pytest.mark.parametrize("dp, stock_rank", [(2, 1), (3, 0)])
def test_a_rank_without_balance_scheduling_fails_every_rank_fast(
    configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dp: int, stock_rank: int
) -> None:
    monkeypatch.setenv(AGREEMENT_TIMEOUT_ENV, SHORT_AGREEMENT_S)
    outcomes, elapsed = run_group(configs(dp), {stock_rank}, tmp_path)
    balanced = [outcome for outcome in outcomes if not outcome["stock"]]
    for outcome in balanced:
        assert outcome["error"].startswith("RuntimeError: Balance scheduling: DP rank"), outcome
        assert f"DP rank(s) [{stock_rank}] did not announce it within {SHORT_AGREEMENT_S} s" in outcome["error"]
        assert AGREEMENT_TIMEOUT_ENV in outcome["error"] and "VLLM_PLUGINS" in outcome["error"]
    # The stock rank waited in vLLM's first all_reduce of its busy loop: it fails when its balanced peers exit.
    stock = outcomes[stock_rank]
    assert "error" in stock and "unfinished" not in stock, stock
    after = stock["ended"] - min(outcome["ended"] for outcome in balanced)
    print(
        f"dp={dp} stock rank {stock_rank}: failed {after:.2f} s after the first balanced peer exited; "
        f"every process gone {elapsed:.1f} s after start ({stock['error'][:120]})"
    )


def test_different_max_num_seqs_are_refused_on_every_rank(
    configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    outcomes, _ = run_group(configs(2, caps={1: 8}), set(), tmp_path)
    assert "DP rank(s) differ: {1: {'cap': 8}}" in outcomes[0]["error"]
    assert "DP rank(s) differ: {0: {'cap': 4}}" in outcomes[1]["error"]
    assert all("--max-num-seqs" in outcome["error"] for outcome in outcomes)


def test_different_max_num_active_seqs_are_refused_on_every_rank(
    configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM >= 0.31 admits up to max_num_active_seqs when set: the gate's threshold, so it must agree too."""
    group = configs(2)
    if not hasattr(group[1].scheduler_config, "max_num_active_seqs"):
        pytest.skip("this vLLM has no max_num_active_seqs (added in vLLM 0.31)")
    group[1].scheduler_config.max_num_active_seqs = 2
    monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    outcomes, _ = run_group(group, set(), tmp_path)
    assert "DP rank(s) differ: {1: {'active_cap': 2}}" in outcomes[0]["error"]
    assert "DP rank(s) differ: {0: {'active_cap': None}}" in outcomes[1]["error"]
    assert all("--max-num-active-seqs" in outcome["error"] for outcome in outcomes)


def test_different_balance_scheduling_code_is_refused(
    configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    outcomes, _ = run_group(configs(2), set(), tmp_path, codes={1: "0123456789ab"})
    assert "DP rank(s) differ: {1: {'code': '0123456789ab'}}" in outcomes[0]["error"]
    assert "DP rank(s) differ: {0: {'code': " in outcomes[1]["error"]
    assert all("and package on every node" in outcome["error"] for outcome in outcomes)


def test_different_gate_rules_are_refused_on_every_rank(
    configs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose config (or VLLM_ASCEND_BALANCE_GATE_RULE) picks another rule would decide other steps."""
    group = configs(2)
    group[1].additional_config = {"scheduler_config": {"balance_gate_rule": "adaptive"}}  # rank 0: the env's cap
    monkeypatch.delenv(AGREEMENT_TIMEOUT_ENV, raising=False)
    outcomes, _ = run_group(group, set(), tmp_path)
    assert "DP rank(s) differ: {1: {'rule': 'adaptive'}}" in outcomes[0]["error"]
    assert "DP rank(s) differ: {0: {'rule': 'cap'}}" in outcomes[1]["error"]
    assert all("balance_gate_rule" in outcome["error"] for outcome in outcomes)


def test_vllm_creates_the_dp_store_before_the_model_loads() -> None:
    """The agreement's seam: ``_init_data_parallel`` (which leaves ``dp_store``) runs before ``EngineCore.__init__``
    (which loads the model), so a disagreeing group fails in seconds, not after a model load."""
    import inspect

    from vllm.v1.engine.core import EngineCoreProc

    init = inspect.getsource(EngineCoreProc.__init__)
    assert -1 < init.find("self._init_data_parallel(vllm_config)") < init.find("super().__init__(")
    dp_init = inspect.getsource(DPEngineCoreProc._init_data_parallel)
    assert "self.dp_group, self.dp_store = dp_group, dp_store" in dp_init


def test_a_bad_agreement_timeout_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, configs: Any) -> None:
    monkeypatch.setenv(AGREEMENT_TIMEOUT_ENV, "1m")
    with pytest.raises(ValueError, match=f"{AGREEMENT_TIMEOUT_ENV}='1m' is not a number of seconds"):
        balance_engine_core.agree_across_dp_group(store=None, rank=0, vllm_config=configs(1)[0])


# ---- what cannot gather is refused when the config is built --------------------------------------------------------


@pytest.mark.parametrize(
    "attribute, value, setting",
    [
        ("distributed_executor_backend", "external_launcher", "distributed_executor_backend='external_launcher'"),
    ],
)
def test_dp_engines_that_never_gather_are_refused(
    balance_on: None, tiny_moe_model: Path, attribute: str, value: str, setting: str
) -> None:
    config = make_vllm_config(tiny_moe_model, dp_size=2)
    setattr(config.parallel_config, attribute, value)
    with pytest.raises(ValueError, match=f"does not support {setting} with data parallelism"):
        decide(config)


def test_an_in_process_dp_engine_is_refused_when_the_config_is_built(
    balance_on: None, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register()  # the config-time decision, as the plugin installs it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="does not support VLLM_ENABLE_V1_MULTIPROCESSING=0 with data parallelism"):
        make_vllm_config(tiny_moe_model, dp_size=2)
    # DP 1 in process: one engine, nothing to gather with; allowed.
    assert decide(make_vllm_config(tiny_moe_model, dp_size=1))


@pytest.mark.parametrize(
    "switch, named",
    [
        ("env", "set by VLLM_ASCEND_BALANCE_SCHEDULING=1"),
        ("config", "set by additional_config['enable_balance_scheduling']=True"),
    ],
)
def test_elastic_ep_is_refused_naming_the_setting_and_the_switch(
    balance_env_unset: None, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch, switch: str, named: str
) -> None:
    """Engine cores added at scale-up (multiprocess or Ray) would wait in vain for the running ranks' agreement."""
    if switch == "env":
        monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "1")
    additional = {"enable_balance_scheduling": True} if switch == "config" else None
    config = make_vllm_config(tiny_moe_model, dp_size=2, additional_config=additional)
    config.parallel_config.enable_elastic_ep = True
    with pytest.raises(ValueError) as refused:
        decide(config)
    assert named in str(refused.value) and "enable_elastic_ep=True (--enable-elastic-ep)" in str(refused.value)
    config.parallel_config.data_parallel_backend = "ray"  # the Ray launcher's scale-up path too
    with pytest.raises(ValueError, match="enable_elastic_ep=True"):
        decide(config)
