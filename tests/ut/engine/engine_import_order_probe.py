"""Run as a script by test_engine_import_order.py: imports vllm-ascend's real copying module and
this plugin in a given order, then reports which run_engine_core the launcher would use.

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

    stub = types.ModuleType("vllm_ascend.patch.platform")
    stub.__path__ = [str(Path(vllm_ascend.patch.__file__).parent / "platform")]
    sys.modules["vllm_ascend.patch.platform"] = stub
    importlib.import_module(COPYING_MODULE)


def main(order: str) -> None:
    os.environ["VLLM_ASCEND_BALANCE_SCHEDULING"] = "1"
    from vllm.v1.engine.core import EngineCoreProc

    vllm_function = EngineCoreProc.__dict__["run_engine_core"].__func__
    from vllm_ascend_balance import patch_balance_engine, patch_balance_schedule

    if order == "theirs-first":
        import_vllm_ascend_copy()
        copy_bound = EngineCoreProc.__dict__["run_engine_core"].__module__
        patch_balance_schedule.register()
    else:
        patch_balance_schedule.register()
        import_vllm_ascend_copy()
        copy_bound = None
    upstream = patch_balance_engine._upstream_run_engine_core
    report = {
        "copy_bound_before_register": copy_bound,
        "launch_is_ours": EngineCoreProc.run_engine_core is patch_balance_engine.run_engine_core,
        "upstream_module": upstream.__module__,
        "upstream_is_vllm_code": (
            upstream.__code__.co_names == vllm_function.__code__.co_names
            and upstream.__code__.co_firstlineno == vllm_function.__code__.co_firstlineno
            and upstream.__code__.co_filename == vllm_function.__code__.co_filename),
        "copy_module_is_ours": sys.modules[COPYING_MODULE] is patch_balance_schedule,
    }
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
