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
"""The route that puts the balance hook into vLLM's engine-core processes, end to end.

The decisive test launches engine cores the way vLLM does (its ``CoreEngineProcManager``, spawn
start method) and reads what each child process reports: a MoE DP child must construct
``BalanceDPEngineCoreProc``, a dense DP child stock ``EngineCoreProc``. Children stop at their
first ZMQ handshake (a deliberately unusable address), right after the class was chosen, so no
executor, model or front-end is needed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import vllm.v1.engine.core as engine_core_module
from offline_vllm import make_vllm_config
from vllm.v1.engine.core import EngineCoreProc

from vllm_ascend_balance import patch_balance_schedule as wiring

HOOK_LOG = "this DP engine core is BalanceDPEngineCoreProc"
CONFIG_ON = {"enable_balance_scheduling": True}


VLLM_RUN_ENGINE_CORE = EngineCoreProc.__dict__["run_engine_core"].__func__
assert VLLM_RUN_ENGINE_CORE.__module__ == "vllm.v1.engine.core"


def route_installed() -> bool:
    return EngineCoreProc.run_engine_core is wiring.run_engine_core


@pytest.fixture
def engine_hook(balance_on: None) -> Any:
    wiring.install_engine_route()
    return wiring


def test_plugin_leaves_the_launch_alone_with_both_switches_off(balance_off: None, tiny_moe_model: Path) -> None:
    wiring.register()
    make_vllm_config(tiny_moe_model, dp_size=2)
    assert EngineCoreProc.run_engine_core is VLLM_RUN_ENGINE_CORE
    assert not route_installed()


@pytest.mark.parametrize("switch", ["env", "config"])
def test_either_switch_installs_the_route_when_the_config_is_built(
    balance_env_unset: None, monkeypatch: pytest.MonkeyPatch, tiny_moe_model: Path, switch: str
) -> None:
    if switch == "env":
        monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "1")
    wiring.register()
    assert not route_installed()  # nothing before a config decides
    make_vllm_config(tiny_moe_model, dp_size=2, additional_config=CONFIG_ON if switch == "config" else None)
    assert route_installed()


def test_launch_target_pickles_by_reference_to_this_module(engine_hook: Any) -> None:
    target = EngineCoreProc.run_engine_core  # what vLLM's launcher passes to Process(...)
    # The pickler spawn-started processes receive their target with (vllm-ascend's pre-commit forbids
    # importing pickle outside a list of files).
    payload = bytes(ForkingPickler.dumps(target))
    assert wiring.__name__.encode() in payload
    assert b"vllm.v1.engine.core" not in payload
    assert ForkingPickler.loads(payload) is wiring.run_engine_core


def test_install_is_idempotent_and_records_vllms_function(engine_hook: Any) -> None:
    engine_hook.install_engine_route()
    assert engine_hook._vllm_run_engine_core is VLLM_RUN_ENGINE_CORE
    assert route_installed()
    assert engine_core_module.DPEngineCoreProc.__module__ == "vllm.v1.engine.core"  # swapped only in the child


def test_the_route_reads_the_decision_without_logging_it(
    balance_env_unset: None, tiny_moe_model: Path, mocker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM >= 0.33 configures an engine process's logging inside its own run_engine_core: a decision logged by
    the route, before it, would be lost, and info_once would then drop it when the scheduler is resolved."""
    wiring.register()
    config = make_vllm_config(tiny_moe_model, dp_size=2, additional_config=CONFIG_ON)
    assert route_installed()
    chosen = []
    monkeypatch.setattr(wiring, "_vllm_run_engine_core", lambda **_: chosen.append(engine_core_module.DPEngineCoreProc))
    monkeypatch.setattr(engine_core_module, "DPEngineCoreProc", engine_core_module.DPEngineCoreProc)
    logged = [mocker.spy(wiring.logger, name) for name in ("info", "info_once", "warning", "warning_once")]
    wiring.run_engine_core(vllm_config=config)
    assert [cls.__name__ for cls in chosen] == ["BalanceDPEngineCoreProc"]
    assert [spy.call_args_list for spy in logged] == [[], [], [], []]


def test_a_foreign_run_engine_core_is_refused(balance_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def run_engine_core(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(EngineCoreProc, "run_engine_core", staticmethod(run_engine_core))
    with pytest.raises(RuntimeError, match="not vLLM's"):
        wiring.install_engine_route()


# ---- the Ray DP route ---------------------------------------------------------------------------------------------


def _post_init_with(config: Any, **parallel: Any) -> None:
    """The deciding ``VllmConfig.__post_init__`` wrapper over an already built config (vLLM's own part skipped)."""
    for name, value in parallel.items():
        setattr(config.parallel_config, name, value)
    wiring._deciding_post_init(lambda self: None)(config)


@pytest.mark.parametrize("balance", [True, False], ids=["balance-on", "balance-off"])
def test_the_ray_launcher_imports_the_balanced_actor_only_when_on(
    balance_env_unset: None, tiny_moe_model: Path, balance: bool
) -> None:
    from vllm_ascend.core.balance_engine_core import BalanceDPMoEEngineCoreActor

    stock = engine_core_module.DPMoEEngineCoreActor
    config = make_vllm_config(tiny_moe_model, dp_size=2, additional_config={"enable_balance_scheduling": balance})
    _post_init_with(config, data_parallel_backend="mp")
    assert engine_core_module.DPMoEEngineCoreActor is stock  # the multiprocess backend: the actor is never used
    _post_init_with(config, data_parallel_backend="ray")
    # What CoreEngineActorManager.__init__'s function-local import now reads.
    from vllm.v1.engine.core import DPMoEEngineCoreActor

    assert DPMoEEngineCoreActor is (BalanceDPMoEEngineCoreActor if balance else stock)
    assert route_installed() is balance


def test_the_balanced_actor_pickles_by_reference_as_ray_ships_it() -> None:
    """Ray exports an actor class with cloudpickle, which pickles an importable class by reference as the standard
    pickler does (the standard one here: vllm-ascend's pre-commit forbids importing pickle or cloudpickle in tests):
    every node imports this package (as it imports vLLM), nothing of vLLM's actor is copied into the payload."""
    from vllm_ascend.core.balance_engine_core import BalanceDPMoEEngineCoreActor

    payload = bytes(ForkingPickler.dumps(BalanceDPMoEEngineCoreActor))
    assert b"vllm_ascend.core.balance_engine_core" in payload and b"BalanceDPMoEEngineCoreActor" in payload
    assert len(payload) < 200 and ForkingPickler.loads(payload) is BalanceDPMoEEngineCoreActor


def test_a_moved_ray_seam_is_refused_naming_the_backend(balance_on: None, tiny_moe_model: Path, mocker: Any) -> None:
    mocker.patch("vllm_ascend.core.balance_seam.ray_seam_problems", return_value=["the launcher moved"])
    stock = engine_core_module.DPMoEEngineCoreActor
    config = make_vllm_config(tiny_moe_model, dp_size=2)
    with pytest.raises(RuntimeError, match=r"(?s)data_parallel_backend='ray'.*the launcher moved.*multiprocessing"):
        _post_init_with(config, data_parallel_backend="ray")
    assert engine_core_module.DPMoEEngineCoreActor is stock


# ---- real engine-core child processes, started by vLLM's launcher with spawn ----------------


@contextlib.contextmanager
def _child_output_to(path: Path) -> Iterator[None]:
    """Children inherit fds 1 and 2 at start: point them at ``path`` meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _launch(config: Any, output: Path) -> Any:
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    with _child_output_to(output):
        # One local engine of a DP-2 deployment (rank 0), exactly as vLLM's front-end starts it.
        return CoreEngineProcManager(
            local_engine_count=1,
            start_index=0,
            local_start_index=0,
            vllm_config=config,
            local_client=True,
            handshake_address="unusable://stop-after-class-choice",
            executor_class=UniProcExecutor,
            log_stats=False,
        )


def _launch_all(configs: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """Launch one engine core per config, all before any is awaited (their vLLM imports overlap),
    and return each child's log once it stopped where expected."""
    managers = {name: _launch(config, tmp_path / f"{name}.log") for name, config in configs.items()}
    logs = {}
    for name, manager in managers.items():
        (process,) = manager.processes
        process.join(timeout=240)
        assert process.exitcode is not None, f"{name} engine core did not stop"
        logs[name] = (tmp_path / f"{name}.log").read_text()
        # The expected stop: the handshake, after the engine-core class was chosen.
        assert process.exitcode == 1, logs[name]
        assert "EngineCore failed to start" in logs[name], logs[name]
        assert "Protocol not supported" in logs[name], logs[name]
    return logs


def test_spawned_engine_cores_run_the_hook_for_moe_and_stock_for_dense(
    engine_hook: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: Path, tiny_moe_model: Path
) -> None:
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # the children's hook line is at INFO
    moe = make_vllm_config(tiny_moe_model, dp_size=2)
    dense = make_vllm_config(tiny_model, dp_size=2)
    assert moe.model_config.is_moe and not dense.model_config.is_moe
    logs = _launch_all({"moe": moe, "dense": dense}, tmp_path)
    assert HOOK_LOG in logs["moe"], logs["moe"]
    # Independent of that log line: the construction traceback passes through the hook class.
    assert "vllm_ascend/core/balance_engine_core.py" in logs["moe"]
    assert "vllm_ascend/core/balance_engine_core.py" not in logs["dense"]
    assert HOOK_LOG not in logs["dense"], logs["dense"]


def test_spawned_engine_cores_follow_the_config_switch_alone(
    balance_env_unset: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_moe_model: Path
) -> None:
    """No env flag anywhere: the config switch installs the route in the front-end, and each
    engine-core child follows the decision recorded on the config it receives (on: hook class; silent: stock)."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    wiring.register()
    switched_on = make_vllm_config(tiny_moe_model, dp_size=2, additional_config=CONFIG_ON)
    silent = make_vllm_config(tiny_moe_model, dp_size=2)
    assert route_installed()
    logs = _launch_all({"on": switched_on, "silent": silent}, tmp_path)
    # No env flag: only the decision recorded on the config can have chosen the hook class.
    assert HOOK_LOG in logs["on"], logs["on"]
    assert "vllm_ascend/core/balance_engine_core.py" in logs["on"]
    assert HOOK_LOG not in logs["silent"], logs["silent"]
    assert "vllm_ascend/core/balance_engine_core.py" not in logs["silent"]
