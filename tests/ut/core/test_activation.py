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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from offline_vllm import make_vllm_config
from vllm.config import KVTransferConfig, SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

import vllm.plugins
from vllm_ascend.core.balance_scheduler import (
    BalanceAsyncScheduler,
    BalanceScheduler,
    BalanceSchedulingMixin,
)
from vllm_ascend.core.balance_upstream import genuine_vllm_scheduler
from vllm_ascend_balance import patch_balance_engine, patch_balance_schedule

DIST_NAME = "vllm-ascend-balance-scheduling"
PLUGIN_NAME = "ascend_balance_scheduling"
HERE = Path(__file__).resolve().parent


@pytest.fixture
def registered(balance_on: None) -> Iterator[None]:
    patch_balance_schedule.register()
    yield
    patch_balance_schedule.unregister()


@pytest.fixture(autouse=True)
def _always_unregistered() -> Iterator[None]:
    yield
    patch_balance_schedule.unregister()


class CustomScheduler(genuine_vllm_scheduler()):  # type: ignore[misc]
    """A user's scheduler_cls: balance must apply to it too."""


def test_entry_point_is_registered_for_vllm() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get(PLUGIN_NAME) == "vllm_ascend_balance.patch_balance_schedule:register"


def test_vllm_loads_the_plugin(balance_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert patch_balance_schedule.is_registered()


@pytest.mark.parametrize("async_scheduling, expected", [(False, BalanceScheduler),
                                                         (True, BalanceAsyncScheduler)])
def test_flag_on_resolves_the_balanced_class(registered: None, tiny_model: Path,
                                             async_scheduling: bool, expected: type) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=async_scheduling)
    assert config.scheduler_config.get_scheduler_cls() is expected


def test_a_configured_scheduler_cls_is_balanced_too(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=CustomScheduler)
    resolved = config.scheduler_config.get_scheduler_cls()
    assert issubclass(resolved, CustomScheduler) and issubclass(resolved, BalanceSchedulingMixin)


ON = {"enable_balance_scheduling": True}
OFF = {"enable_balance_scheduling": False}


def _class_built_on_a_copy() -> type:
    """Stand-in for vllm-ascend 0.23's ProfilingChunkScheduler: a scheduler class in another
    module whose base is the copying module's scheduler (defined under that module's name)."""
    namespace: dict[str, Any] = {"__name__": "vllm_ascend.patch.platform.patch_balance_schedule",
                                 "Base": genuine_vllm_scheduler()}
    exec("class BalanceScheduler(Base):\n    def schedule(self, *a, **k):\n"
         "        raise AssertionError('copied schedule() ran')", namespace)
    return type("ProfilingChunkScheduler", (namespace["BalanceScheduler"],),
                {"__module__": "vllm_ascend.core.scheduler_profiling_chunk"})


def test_a_scheduler_cls_built_on_the_copy_is_refused(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, scheduler_cls=_class_built_on_a_copy())
    with pytest.raises(RuntimeError, match="scheduler_profiling_chunk.ProfilingChunkScheduler "
                                           "is built on vllm-ascend's copied schedule"):
        config.scheduler_config.get_scheduler_cls()


@pytest.mark.parametrize("env", ["unset", "0"])
def test_switches_off_leave_vllm_stock(monkeypatch: pytest.MonkeyPatch, tiny_model: Path,
                                       env: str) -> None:
    if env == "unset":
        monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", env)
    patch_balance_schedule.register()
    # The config-time wrappers are there (the config may still turn it on)...
    assert patch_balance_schedule.is_registered()
    # ...but nothing else: no engine route, vLLM's classes, vllm-ascend's module name free.
    assert not patch_balance_engine.is_engine_hook_installed()
    assert "vllm_ascend.patch.platform.patch_balance_schedule" not in sys.modules
    for async_scheduling, stock in ((False, genuine_vllm_scheduler()), (True, AsyncScheduler)):
        config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=async_scheduling)
        assert config.scheduler_config.get_scheduler_cls() is stock
    assert not patch_balance_engine.is_engine_hook_installed()


@pytest.mark.parametrize("async_scheduling, expected", [(False, BalanceScheduler),
                                                         (True, BalanceAsyncScheduler)])
def test_config_switch_alone_activates_at_config_time(balance_env_unset: None, tiny_model: Path,
                                                      async_scheduling: bool,
                                                      expected: type) -> None:
    patch_balance_schedule.register()
    assert not patch_balance_engine.is_engine_hook_installed()
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=async_scheduling,
                              additional_config=ON)
    assert patch_balance_engine.is_engine_hook_installed()  # before any engine core starts
    assert config.scheduler_config.get_scheduler_cls() is expected


def test_config_switch_off_beats_the_env_flag(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=True, additional_config=OFF)
    assert config.scheduler_config.get_scheduler_cls() is AsyncScheduler


def test_the_decision_travels_with_the_config(balance_env_unset: None, tiny_model: Path) -> None:
    """Engine-core processes get the config pickled and no env switch: the decision made in the
    front-end comes along, and vLLM's config hash ignores it."""
    patch_balance_schedule.register()
    on = make_vllm_config(tiny_model, dp_size=2, additional_config=ON)
    plain = make_vllm_config(tiny_model, dp_size=2)
    shipped = pickle.loads(pickle.dumps(on.scheduler_config))
    assert shipped.get_scheduler_cls() is BalanceScheduler
    assert on.scheduler_config.compute_hash() == plain.scheduler_config.compute_hash()


def test_bad_config_value_fails_at_config_time(balance_env_unset: None, tiny_model: Path) -> None:
    patch_balance_schedule.register()
    with pytest.raises(ValueError, match="enable_balance_scheduling.*true and false"):
        make_vllm_config(tiny_model, dp_size=2,
                         additional_config={"enable_balance_scheduling": "false"})


def test_flag_turned_off_later_gives_stock_classes(registered: None, tiny_model: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "0")
    config = make_vllm_config(tiny_model, dp_size=2, async_scheduling=False)
    assert config.scheduler_config.get_scheduler_cls() is genuine_vllm_scheduler()


def test_register_twice_wraps_once(registered: None) -> None:
    wrapped = SchedulerConfig.__dict__["get_scheduler_cls"]
    patch_balance_schedule.register()
    assert SchedulerConfig.__dict__["get_scheduler_cls"] is wrapped
    assert not getattr(wrapped.__wrapped__, "__balance_scheduling_wrapped__", False)


def test_bad_flag_fails_at_plugin_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "true")
    with pytest.raises(ValueError, match="VLLM_ASCEND_BALANCE_SCHEDULING='true'"):
        patch_balance_schedule.register()


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("switch", ["env", "config"])
def test_pd_disaggregated_role_fails_at_config_time(monkeypatch: pytest.MonkeyPatch,
                                                    tiny_model: Path, role: str,
                                                    switch: str) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "1" if switch == "env" else "0")
    patch_balance_schedule.register()
    with pytest.raises(ValueError, match=f"supports only PD-mixed.*{role}"):
        make_vllm_config(tiny_model, dp_size=2, kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector", kv_role=role),
            additional_config=ON if switch == "config" else None)


def test_pd_mixed_role_is_accepted(registered: None, tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, dp_size=2, kv_transfer_config=KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both"))
    assert config.kv_transfer_config is not None


def _run(args: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _probe(order: str, switch: str, tiny_model: Path) -> dict[str, Any]:
    out = _run([sys.executable, str(HERE / "import_order_probe.py"), order, switch,
                str(tiny_model)])
    report: dict[str, Any] = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
    return report


@pytest.mark.parametrize("switch", ["env", "config"])
@pytest.mark.parametrize("order", ["ours-first", "theirs-first"])
def test_ours_wins_over_vllm_ascends_copy_in_either_import_order(tiny_model: Path, order: str,
                                                                 switch: str) -> None:
    report = _probe(order, switch, tiny_model)
    for key, ours in (("async=False", "BalanceScheduler"), ("async=True", "BalanceAsyncScheduler")):
        mro = report[key]
        assert mro[0] == f"vllm_ascend.core.balance_scheduler.{ours}", mro
        assert not any(name.startswith("vllm_ascend.patch.") for name in mro), mro
    assert report["scheduler_global"] == "vllm.v1.core.sched.scheduler.Scheduler"
    # Only the env flag is known before vllm-ascend imports its module (and makes 0.18 import it).
    assert report["copy_module_is_ours"] is (order == "ours-first" and switch == "env")


@pytest.mark.parametrize("order", ["ours-first", "theirs-first"])
def test_with_both_switches_off_vllm_ascends_module_is_left_in_effect(tiny_model: Path,
                                                                      order: str) -> None:
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
sys.path.insert(0, {str(HERE.parents[2] / 'scripts')!r})
assert importlib.util.find_spec("vllm_ascend_balance") is None
assert importlib.util.find_spec("vllm_ascend.core.balance_scheduler") is None
import vllm.plugins
vllm.plugins.load_general_plugins()
from pathlib import Path
from offline_vllm import make_vllm_config
for flag in (False, True):
    cls = make_vllm_config(Path({str(tiny_model)!r}), dp_size=2,
                           async_scheduling=flag).scheduler_config.get_scheduler_cls()
    print("RESOLVED", cls.__module__ + "." + cls.__qualname__)
"""
    out = _run([sys.executable, "-S", "-c", script],
               env={"PYTHONPATH": str(tmp_path / "site"), "VLLM_PLUGINS": PLUGIN_NAME,
                    "VLLM_ASCEND_BALANCE_SCHEDULING": "1"})
    resolved = [line.split()[1] for line in out.splitlines() if line.startswith("RESOLVED")]
    assert resolved == ["vllm.v1.core.sched.scheduler.Scheduler",
                        "vllm.v1.core.sched.async_scheduler.AsyncScheduler"]
