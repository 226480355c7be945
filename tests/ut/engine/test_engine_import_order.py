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
"""Whichever of vllm-ascend's copying module and this plugin is imported first, and whichever
switch turns balance scheduling on, the engine-core launch goes through this plugin's hook and
ends in vLLM's genuine ``run_engine_core``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from balance_fixtures import helper_process_env, needs_vllm_ascend

PROBE = Path(__file__).parents[1] / "core" / "import_order_probe.py"
REPAIR_LOG = "replaced EngineCoreProc.run_engine_core; rebuilt vLLM's own"


@needs_vllm_ascend
@pytest.mark.parametrize("switch", ["env", "config"])
def test_engine_hook_wins_in_both_import_orders(tiny_model: Path, switch: str) -> None:
    # Both probes start before either is awaited: their vLLM imports overlap.
    probes = {
        order: subprocess.Popen(
            [sys.executable, str(PROBE), order, switch, str(tiny_model)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=helper_process_env(),
        )
        for order in ("theirs-first", "ours-first")
    }
    reports = {}
    for order, probe in probes.items():
        out, err = probe.communicate(timeout=300)
        assert probe.returncode == 0, err[-3000:]
        line = next(text for text in out.splitlines() if text.startswith("PROBE "))
        reports[order] = (json.loads(line[len("PROBE ") :]), out + err)  # vLLM logs to stdout
    theirs, theirs_log = reports["theirs-first"]
    # The real copying module did replace run_engine_core before the plugin ran, and the
    # repair says so.
    assert theirs["copy_bound_before_register"] == ("vllm_ascend.patch.platform.patch_balance_schedule")
    assert REPAIR_LOG in theirs_log
    ours, ours_log = reports["ours-first"]
    if switch == "env":
        # Activated at plugin load, with vllm-ascend's module name bound to ours: it never runs.
        assert ours["copy_module_is_ours"]
        assert REPAIR_LOG not in ours_log
    else:
        # Activated only when the config is built: vllm-ascend's module ran in between and
        # displaced nothing of ours yet; activation repairs what it bound.
        assert not ours["copy_module_is_ours"]
        assert REPAIR_LOG in ours_log
    for order, (report, _) in reports.items():
        assert report["launch_is_ours"], order
        assert report["upstream_module"] == "vllm.v1.engine.core", order
        assert report["upstream_is_vllm_code"], order
