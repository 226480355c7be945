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
"""Fixtures shared by the balance-scheduling unit tests (a pytest plugin module).

Loaded by this repository's ``tests/ut/conftest.py`` and, in the upstream patch series, by the
``conftest.py`` of vllm-ascend's ``tests/ut/core`` — one definition for both. Everything is built
offline: the model is a tiny directory generated per session, nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# vllm-ascend's copying module, whose name the pip plugin may bind to its wiring.
COPYING_MODULE = "vllm_ascend.patch.platform.patch_balance_schedule"


def vllm_ascend_installed() -> bool:
    """vllm-ascend itself is installed (this project installs into the same ``vllm_ascend`` package, so a module
    lookup cannot tell; the v0.33.0 line has no vllm-ascend)."""
    try:
        metadata.distribution("vllm-ascend")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_vllm_ascend = pytest.mark.skipif(
    not vllm_ascend_installed(), reason="vllm-ascend is not installed on this line (none supports vLLM 0.33 yet)"
)


def helper_process_env(**extra: str) -> dict[str, str]:
    """The environment for a Python subprocess of a test: it imports the same test helpers
    (``offline_vllm``, ``balance_fixtures``...) from where this process found them."""
    import offline_vllm

    helpers = {str(Path(offline_vllm.__file__).parent), str(Path(__file__).parent)}
    path = os.pathsep.join([*sorted(helpers), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offline_vllm import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offline_vllm import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), moe=True)


@pytest.fixture
def balance_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "1")


@pytest.fixture(autouse=True)
def cap_gate_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's gate rule, which closes from the gathered counts alone: what the tests of the gate's mechanics and
    wiring need. The adaptive rule's own tests (tests/ut/core/test_gate_rule.py) choose it explicitly."""
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_GATE_RULE", "cap")


@pytest.fixture
def balance_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "0")


@pytest.fixture
def balance_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither "1" nor "0": only a config's ``additional_config`` can switch it on."""
    monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)


@pytest.fixture(autouse=True)
def vllm_restored() -> Iterator[None]:
    """Every test leaves vLLM as it found it: the wrapped config methods, the engine-core route and the
    DP engine classes (process and Ray actor), the wiring's recorded vLLM function, and the copying module's name."""
    import vllm.v1.engine.core as engine_core_module
    from vllm.config import SchedulerConfig, VllmConfig

    from vllm_ascend_balance import patch_balance_schedule as wiring

    saved = [
        (SchedulerConfig, "get_scheduler_cls", SchedulerConfig.__dict__["get_scheduler_cls"]),
        (VllmConfig, "__post_init__", VllmConfig.__dict__["__post_init__"]),
        (
            engine_core_module.EngineCoreProc,
            "run_engine_core",
            engine_core_module.EngineCoreProc.__dict__["run_engine_core"],
        ),
        (engine_core_module, "DPEngineCoreProc", engine_core_module.DPEngineCoreProc),
        (engine_core_module, "DPMoEEngineCoreActor", engine_core_module.DPMoEEngineCoreActor),
        (wiring, "_vllm_run_engine_core", wiring._vllm_run_engine_core),
    ]
    copying_module = sys.modules.get(COPYING_MODULE)
    yield
    for owner, name, value in saved:
        setattr(owner, name, value)
    if copying_module is None:
        sys.modules.pop(COPYING_MODULE, None)
    else:
        sys.modules[COPYING_MODULE] = copying_module
