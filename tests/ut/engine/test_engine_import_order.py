"""Whichever of vllm-ascend's copying module and this plugin is imported first, the engine-core
launch goes through this plugin's hook and ends in vLLM's genuine ``run_engine_core``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).parents[1] / "core" / "import_order_probe.py"


def test_engine_hook_wins_in_both_import_orders(tiny_model: Path) -> None:
    # Both probes start before either is awaited: their vLLM imports overlap.
    probes = {order: subprocess.Popen([sys.executable, str(PROBE), order, str(tiny_model)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for order in ("theirs-first", "ours-first")}
    reports = {}
    for order, probe in probes.items():
        out, err = probe.communicate(timeout=300)
        assert probe.returncode == 0, err[-3000:]
        line = next(l for l in out.splitlines() if l.startswith("PROBE "))
        reports[order] = (json.loads(line[len("PROBE "):]), out + err)  # vLLM logs to stdout
    theirs, theirs_log = reports["theirs-first"]
    # The real copying module did replace run_engine_core before the plugin ran, and the
    # repair says so.
    assert theirs["copy_bound_before_register"] == (
        "vllm_ascend.patch.platform.patch_balance_schedule")
    assert "replaced EngineCoreProc.run_engine_core with a stale copy" in theirs_log
    assert "stale copy" not in reports["ours-first"][1]
    for order, (report, _) in reports.items():
        assert report["launch_is_ours"], order
        assert report["upstream_module"] == "vllm.v1.engine.core", order
        assert report["upstream_is_vllm_code"], order
    assert reports["ours-first"][0]["copy_module_is_ours"]
