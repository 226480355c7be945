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
"""Run as a script by test_activation.py and test_engine_import_order.py: imports vllm-ascend's
real copying balance module and ours in a given order, with balance scheduling switched on by the
env flag (``env``), by ``additional_config`` alone (``config``) or not at all (``off``), then
reports which scheduler classes vLLM's config resolves and which ``run_engine_core`` the engine
launcher would use.

A separate process because the copying module rebinds vLLM globals irreversibly. Its package
``vllm_ascend.patch.platform.__init__`` imports NPU-only modules (torch_npu), so only that package
object is stubbed (``__path__`` pointing at the real directory): the copying module itself is the
release's real file, executed as vllm-ascend would.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from pathlib import Path

COPYING_MODULE = "vllm_ascend.patch.platform.patch_balance_schedule"


def import_vllm_ascend_copy() -> None:
    import vllm_ascend.patch

    platform_dir = Path(vllm_ascend.patch.__file__).parent / "platform"
    stub = types.ModuleType("vllm_ascend.patch.platform")
    stub.__path__ = [str(platform_dir)]
    sys.modules["vllm_ascend.patch.platform"] = stub
    from offline_vllm import torch_npu_stubbed_for_import

    with torch_npu_stubbed_for_import():  # vllm-ascend 0.23's copy imports it, uses none of it
        importlib.import_module(COPYING_MODULE)


def main(order: str, switch: str, model_dir: str) -> None:
    os.environ.pop("VLLM_ASCEND_BALANCE_SCHEDULING", None)
    if switch == "env":
        os.environ["VLLM_ASCEND_BALANCE_SCHEDULING"] = "1"
    additional_config = {"enable_balance_scheduling": True} if switch == "config" else None
    from offline_vllm import make_vllm_config  # PYTHONPATH from the test
    from vllm.v1.engine.core import EngineCoreProc

    from vllm_ascend_balance import patch_balance_coexist, patch_balance_schedule

    vllm_launch = EngineCoreProc.__dict__["run_engine_core"].__func__
    copy_bound = None
    if order == "theirs-first":
        import_vllm_ascend_copy()
        copy_bound = EngineCoreProc.__dict__["run_engine_core"].__module__
        # vLLM imports this lazily; here it is first imported while the global is rebound.
        import vllm.v1.core.sched.async_scheduler  # noqa: F401

        patch_balance_coexist.register()
    else:
        patch_balance_coexist.register()
        import_vllm_ascend_copy()

    import vllm.v1.core.sched.async_scheduler  # noqa: F401  (as EngineCore would, lazily)
    import vllm.v1.core.sched.scheduler as scheduler_module

    configs = {
        async_scheduling: make_vllm_config(
            Path(model_dir), dp_size=2, async_scheduling=async_scheduling, additional_config=additional_config
        )
        for async_scheduling in (False, True)
    }
    copy_module = sys.modules[COPYING_MODULE]
    bound = EngineCoreProc.__dict__["run_engine_core"]  # vllm-ascend binds a plain function
    launch = bound.__func__ if isinstance(bound, staticmethod) else bound
    upstream = patch_balance_schedule._vllm_run_engine_core or launch
    report = {
        "copy_module_is_ours": copy_module is patch_balance_schedule,
        "copy_bound_before_register": copy_bound,
        "launch_is_ours": EngineCoreProc.run_engine_core is patch_balance_schedule.run_engine_core,
        "upstream_module": upstream.__module__,
        # Rebuilt or not, the launch must end in vLLM's own code (same file, line, names).
        "upstream_is_vllm_code": (
            upstream.__code__.co_names == vllm_launch.__code__.co_names
            and upstream.__code__.co_firstlineno == vllm_launch.__code__.co_firstlineno
            and upstream.__code__.co_filename == vllm_launch.__code__.co_filename
        ),
    }
    for async_scheduling, config in configs.items():
        resolved = config.scheduler_config.get_scheduler_cls()
        report[f"async={async_scheduling}"] = [f"{k.__module__}.{k.__qualname__}" for k in resolved.__mro__]
    report["scheduler_global"] = f"{scheduler_module.Scheduler.__module__}.{scheduler_module.Scheduler.__qualname__}"
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
