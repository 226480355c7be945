"""The pip plugin beside vllm-ascend main's platform patches: the engine-core route with balance on.

vllm-ascend main's platform patch package imports its copying ``patch_balance_schedule`` (which
replaces ``EngineCoreProc.run_engine_core`` with its wrapper) and then ``patch_dyntra_lb_core``, which
wraps that wrapper again, for every deployment. With balance scheduling on, DyntraLB is off (main
refuses the two together), so that outer wrapper only delegates; the plugin must still route engine-core
launches to ``BalanceDPEngineCoreProc``. Run in a subprocess: both modules rebind vLLM globals for good.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from balance_fixtures import helper_process_env

PROBE = """
import importlib, sys
from pathlib import Path
import import_order_probe
from offline_vllm import make_vllm_config, torch_npu_stubbed_for_import
from vllm.v1.engine.core import EngineCoreProc
from vllm_ascend_balance import patch_balance_coexist, patch_balance_schedule

import_order_probe.import_vllm_ascend_copy()
with torch_npu_stubbed_for_import():
    importlib.import_module("vllm_ascend.utils")
    importlib.import_module("vllm_ascend.patch.platform.patch_dyntra_lb_core")
patch_balance_coexist.register()
make_vllm_config(Path(sys.argv[1]), dp_size=2)
bound = EngineCoreProc.__dict__["run_engine_core"].__func__
print("ROUTE", bound is patch_balance_schedule.run_engine_core)
"""


def _has_dyntra_patch() -> bool:
    return importlib.util.find_spec("vllm_ascend") is not None and any(
        (Path(location) / "patch" / "platform" / "patch_dyntra_lb_core.py").exists()
        for location in importlib.util.find_spec("vllm_ascend").submodule_search_locations or []
    )


@pytest.mark.skipif(not _has_dyntra_patch(), reason="this line's vllm-ascend has no patch_dyntra_lb_core (main only)")
def test_balance_on_routes_engine_cores_despite_dyntra_lbs_wrapper(tiny_moe_model: Path) -> None:
    helpers = str(Path(__file__).parents[1] / "core")  # import_order_probe.py lives there
    env = helper_process_env(VLLM_ASCEND_BALANCE_SCHEDULING="1", VLLM_PLUGINS="ascend_balance_scheduling")
    env["PYTHONPATH"] = helpers + ":" + env["PYTHONPATH"]
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_moe_model)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ROUTE True" in run.stdout
