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
"""Activation: the pip-installed plugin turns balance scheduling on in vLLM, and only when asked.

Covers the entry point, what ``SchedulerConfig.get_scheduler_cls`` returns with either switch (the
env flag, or ``additional_config`` alone) on and off, config-time refusal of PD-disaggregated
roles, vllm-ascend's own copying module imported before or after ours under either switch (and
left alone when both are off), that the installed vllm-ascend files are untouched, and that
without this distribution (uninstalled) vLLM is stock.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import os
import pickle
import subprocess
import sys
from base64 import urlsafe_b64encode
from pathlib import Path
from typing import Any

import pytest
import vllm.plugins
from balance_fixtures import helper_process_env, needs_vllm_ascend
from offline_vllm import make_vllm_config
from vllm.config import KVTransferConfig, SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCoreProc

from vllm_ascend.core.balance_scheduler import (
    BalanceAsyncScheduler,
    BalanceScheduler,
    BalanceSchedulingMixin,
)
from vllm_ascend_balance import patch_balance_coexist, patch_balance_schedule

DIST_NAME = "vllm-ascend-balance-scheduling"
PLUGIN_NAME = "ascend_balance_scheduling"
HERE = Path(__file__).resolve().parent


@pytest.fixture
def registered(balance_on: None) -> None:
    """The plugin's entry point has run (``vllm_restored`` undoes it after the test)."""
    patch_balance_coexist.register()


def wrapper_layers() -> list[str]:
    """The balance wrappers around SchedulerConfig.get_scheduler_cls, outermost first."""
    layers, layer = [], SchedulerConfig.__dict__["get_scheduler_cls"]
    while layer is not None:
        layers += [getattr(layer, "__balance_scheduling_wrapped__", "vllm")]
        layer = getattr(layer, "__wrapped__", None)
    return layers


def route_installed() -> bool:
    return EngineCoreProc.run_engine_core is patch_balance_schedule.run_engine_core


class CustomScheduler(Scheduler):
    """A user's scheduler_cls: balance must apply to it too."""


def test_entry_point_is_registered_for_vllm() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get(PLUGIN_NAME) == "vllm_ascend_balance.patch_balance_coexist:register"


def test_vllm_loads_the_plugin(balance_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert wrapper_layers() == ["_balanced_get_scheduler_cls", "_copy_free_get_scheduler_cls", "vllm"]


@pytest.mark.parametrize("async_scheduling, expected", [(False, BalanceScheduler), (True, BalanceAsyncScheduler)])
def test_flag_on_resolves_the_balanced_class(
    registered: None, tiny_model: Path, async_scheduling: bool, expected: type
) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=async_scheduling)
    assert config.scheduler_config.get_scheduler_cls() is expected


def test_a_configured_balanced_class_is_kept(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=BalanceAsyncScheduler)
    assert config.scheduler_config.get_scheduler_cls() is BalanceAsyncScheduler


def test_a_configured_scheduler_cls_is_balanced_too(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=CustomScheduler)
    resolved = config.scheduler_config.get_scheduler_cls()
    assert issubclass(resolved, CustomScheduler) and issubclass(resolved, BalanceSchedulingMixin)


ON = {"enable_balance_scheduling": True}
OFF = {"enable_balance_scheduling": False}


def _class_built_on_a_copy() -> type:
    """Stand-in for vllm-ascend 0.23's ProfilingChunkScheduler: a scheduler class in another
    module whose base is the copying module's scheduler (defined under that module's name)."""
    namespace: dict[str, Any] = {"__name__": "vllm_ascend.patch.platform.patch_balance_schedule", "Base": Scheduler}
    exec(
        "class BalanceScheduler(Base):\n    def schedule(self, *a, **k):\n"
        "        raise AssertionError('copied schedule() ran')",
        namespace,
    )
    return type(
        "ProfilingChunkScheduler",
        (namespace["BalanceScheduler"],),
        {"__module__": "vllm_ascend.core.scheduler_profiling_chunk"},
    )


def test_a_scheduler_cls_built_on_the_copy_is_refused(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=_class_built_on_a_copy())
    with pytest.raises(
        RuntimeError,
        match="scheduler_profiling_chunk.ProfilingChunkScheduler is built on vllm-ascend's copied schedule",
    ):
        config.scheduler_config.get_scheduler_cls()


@pytest.mark.parametrize("env", ["unset", "0"])
def test_switches_off_leave_vllm_stock(monkeypatch: pytest.MonkeyPatch, tiny_model: Path, env: str) -> None:
    if env == "unset":
        monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", env)
    patch_balance_coexist.register()
    # The config-time wrappers are there (the config may still turn it on)...
    assert wrapper_layers()[0] == "_balanced_get_scheduler_cls"
    # ...but nothing else: no engine route, vLLM's classes, vllm-ascend's module name free.
    assert not route_installed()
    assert "vllm_ascend.patch.platform.patch_balance_schedule" not in sys.modules
    for async_scheduling, stock in ((False, Scheduler), (True, AsyncScheduler)):
        config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=async_scheduling)
        assert config.scheduler_config.get_scheduler_cls() is stock
    assert not route_installed()


@pytest.mark.parametrize("async_scheduling, expected", [(False, BalanceScheduler), (True, BalanceAsyncScheduler)])
def test_config_switch_alone_activates_at_config_time(
    balance_env_unset: None, tiny_model: Path, async_scheduling: bool, expected: type
) -> None:
    patch_balance_coexist.register()
    assert not route_installed()
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=async_scheduling, additional_config=ON)
    assert route_installed()  # before any engine core starts
    assert config.scheduler_config.get_scheduler_cls() is expected


def test_config_switch_off_beats_the_env_flag(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=True, additional_config=OFF)
    assert config.scheduler_config.get_scheduler_cls() is AsyncScheduler


def test_the_decision_travels_with_the_config(balance_env_unset: None, tiny_model: Path) -> None:
    """Engine-core processes get the config pickled and no env switch: the decision made in the
    front-end comes along, and vLLM's config hash ignores it."""
    patch_balance_coexist.register()
    on = make_vllm_config(tiny_model, dp_size=2, additional_config=ON)
    plain = make_vllm_config(tiny_model, dp_size=2)
    shipped = pickle.loads(pickle.dumps(on.scheduler_config))
    assert shipped.get_scheduler_cls() is BalanceScheduler
    assert on.scheduler_config.compute_hash() == plain.scheduler_config.compute_hash()


def test_bad_config_value_fails_at_config_time(balance_env_unset: None, tiny_model: Path) -> None:
    patch_balance_coexist.register()
    with pytest.raises(ValueError, match="enable_balance_scheduling.*true or false"):
        make_vllm_config(tiny_model, dp_size=2, additional_config={"enable_balance_scheduling": "false"})


def test_flag_turned_off_later_gives_stock_classes(
    registered: None, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "0")
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=False)
    assert config.scheduler_config.get_scheduler_cls() is Scheduler


def test_register_twice_wraps_once(registered: None) -> None:
    wrapped = SchedulerConfig.__dict__["get_scheduler_cls"]
    patch_balance_coexist.register()
    patch_balance_schedule.register()
    assert SchedulerConfig.__dict__["get_scheduler_cls"] is wrapped
    assert wrapper_layers() == ["_balanced_get_scheduler_cls", "_copy_free_get_scheduler_cls", "vllm"]


def test_bad_flag_fails_at_plugin_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "true")
    with pytest.raises(ValueError, match="VLLM_ASCEND_BALANCE_SCHEDULING='true'"):
        patch_balance_coexist.register()


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("switch", ["env", "config"])
def test_pd_disaggregated_role_fails_at_config_time(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path, role: str, switch: str
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "1" if switch == "env" else "0")
    patch_balance_coexist.register()
    with pytest.raises(ValueError, match=f"does not support kv_role='{role}'.*only PD-mixed"):
        make_vllm_config(
            tiny_model,
            dp_size=2,
            kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role=role),
            additional_config=ON if switch == "config" else None,
        )


def test_pd_mixed_role_is_accepted(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(
        tiny_model, dp_size=2, kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    )
    assert config.kv_transfer_config is not None


def _run(args: list[str], **env: str) -> str:
    # Run from this directory: from the repository root, ``-c`` would find its ``vllm_ascend`` sources (a namespace
    # package where no vllm-ascend is installed).
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=helper_process_env(**env), cwd=HERE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _probe(order: str, switch: str, tiny_model: Path) -> dict[str, Any]:
    out = _run([sys.executable, str(HERE / "import_order_probe.py"), order, switch, str(tiny_model)])
    report: dict[str, Any] = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
    return report


@needs_vllm_ascend
@pytest.mark.parametrize("switch", ["env", "config"])
@pytest.mark.parametrize("order", ["ours-first", "theirs-first"])
def test_ours_wins_over_vllm_ascends_copy_in_either_import_order(tiny_model: Path, order: str, switch: str) -> None:
    report = _probe(order, switch, tiny_model)
    for key, ours in (("async=False", "BalanceScheduler"), ("async=True", "BalanceAsyncScheduler")):
        mro = report[key]
        assert mro[0] == f"vllm_ascend.core.balance_scheduler.{ours}", mro
        assert not any(name.startswith("vllm_ascend.patch.") for name in mro), mro
    assert report["scheduler_global"] == "vllm.v1.core.sched.scheduler.Scheduler"
    # Only the env flag is known before vllm-ascend imports its module (and makes 0.18 import it).
    assert report["copy_module_is_ours"] is (order == "ours-first" and switch == "env")


@needs_vllm_ascend
@pytest.mark.parametrize("order", ["ours-first", "theirs-first"])
def test_with_both_switches_off_vllm_ascends_module_is_left_in_effect(tiny_model: Path, order: str) -> None:
    """vllm-ascend 0.23 imports its module unconditionally (its off path and its kv_producer
    preemption guard live there): with balance scheduling off, this plugin changes nothing."""
    report = _probe(order, "off", tiny_model)
    copy_class = "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"
    assert report["scheduler_global"] == copy_class
    assert report["async=False"][0] == copy_class
    assert not report["copy_module_is_ours"]
    assert not report["launch_is_ours"]


def _record_hash(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + urlsafe_b64encode(digest).rstrip(b"=").decode()


@needs_vllm_ascend
def test_installed_vllm_ascend_files_are_untouched() -> None:
    ascend = metadata.distribution("vllm-ascend")
    ours = {str(f) for f in metadata.distribution(DIST_NAME).files or []}
    checked = 0
    for file in ascend.files or []:
        assert str(file) not in ours, f"{file} belongs to vllm-ascend and to this project"
        if file.hash is not None:
            assert _record_hash(Path(str(file.locate()))) == f"{file.hash.mode}={file.hash.value}", file
            checked += 1
    assert checked > 100


def _site_without(site: Path, excluded: set[Path], target: Path) -> None:
    """Mirror ``site`` into ``target`` with symlinks, leaving out ``excluded`` files (and the
    directories left empty without them), as ``pip uninstall`` would."""
    target.mkdir()
    for entry in site.iterdir():
        inside = {p for p in excluded if entry == p or entry in p.parents}
        if not inside:
            (target / entry.name).symlink_to(entry)
        elif entry.is_dir() and entry not in excluded:
            _site_without(entry, inside, target / entry.name)
    if not any(target.iterdir()):
        target.rmdir()


def test_without_this_distribution_vllm_is_stock(tmp_path: Path, tiny_model: Path) -> None:
    """Uninstalled (its files absent from the path), the flag changes nothing in vLLM."""
    dist = metadata.distribution(DIST_NAME)
    site = Path(str(dist.locate_file("")))
    excluded = {Path(str(dist.locate_file(f))) for f in dist.files or []}
    _site_without(site, excluded, tmp_path / "site")
    script = f"""
import importlib.util, sys
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # its package is gone too (no vllm-ascend on this line)
        return True
assert absent("vllm_ascend_balance") and absent("vllm_ascend.core.balance_scheduler")
import vllm.plugins
vllm.plugins.load_general_plugins()
from pathlib import Path
from offline_vllm import make_vllm_config
for flag in (False, True):
    cls = make_vllm_config(Path({str(tiny_model)!r}), dp_size=2,
                           async_scheduling=flag).scheduler_config.get_scheduler_cls()
    print("RESOLVED", cls.__module__ + "." + cls.__qualname__)
"""
    out = _run(
        [sys.executable, "-S", "-c", script],
        PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), helper_process_env()["PYTHONPATH"]]),
        VLLM_PLUGINS=PLUGIN_NAME,
        VLLM_ASCEND_BALANCE_SCHEDULING="1",
    )
    resolved = [line.split()[1] for line in out.splitlines() if line.startswith("RESOLVED")]
    assert resolved == ["vllm.v1.core.sched.scheduler.Scheduler", "vllm.v1.core.sched.async_scheduler.AsyncScheduler"]


VLLM_RUN_ENGINE_CORE = EngineCoreProc.__dict__["run_engine_core"].__func__


@needs_vllm_ascend
@pytest.mark.parametrize("switch", ["on", "off"])
def test_vllm_ascend_copy_installed_first_is_repaired_only_when_on(
    balance_env_unset: None,
    tiny_moe_model: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    switch: str,
) -> None:
    """In-process stand-in: a function from vllm-ascend's module name (the real module is
    imported in a separate process by test_engine_import_order.py)."""
    monkeypatch.setattr(patch_balance_schedule.logger, "propagate", True)  # let caplog see it
    namespace: dict[str, Any] = {"__name__": "vllm_ascend.patch.platform.patch_balance_schedule"}
    exec("def run_engine_core(*args, **kwargs):\n    raise AssertionError('stale copy')", namespace)
    copy = namespace["run_engine_core"]
    monkeypatch.setattr(EngineCoreProc, "run_engine_core", copy)
    patch_balance_coexist.register()
    make_vllm_config(tiny_moe_model, dp_size=2, additional_config={"enable_balance_scheduling": switch == "on"})
    if switch == "off":  # left exactly as vllm-ascend set it
        assert EngineCoreProc.__dict__["run_engine_core"] is copy
        return
    assert route_installed()
    rebuilt = patch_balance_schedule._vllm_run_engine_core
    assert rebuilt is not VLLM_RUN_ENGINE_CORE
    # Same source, same module: same names, variables and lines (the byte code itself may
    # differ in peephole details between the wheel's .pyc and a fresh compile).
    for attribute in (
        "co_names",
        "co_varnames",
        "co_cellvars",
        "co_filename",
        "co_firstlineno",
        "co_argcount",
        "co_kwonlyargcount",
    ):
        assert getattr(rebuilt.__code__, attribute) == getattr(VLLM_RUN_ENGINE_CORE.__code__, attribute), attribute
    assert {line for *_, line in rebuilt.__code__.co_lines()} == {
        line for *_, line in VLLM_RUN_ENGINE_CORE.__code__.co_lines()
    }
    assert rebuilt.__globals__ is VLLM_RUN_ENGINE_CORE.__globals__
    assert rebuilt.__qualname__ == "EngineCoreProc.run_engine_core"
    assert "replaced EngineCoreProc.run_engine_core; rebuilt vLLM's own" in caplog.text
