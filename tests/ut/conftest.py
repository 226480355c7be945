"""Shared set-up for the CPU unit tests: offline, no NPU, working-tree code.

* ``VLLM_PLUGINS`` allows only this project's plugin: vllm-ascend's platform plugin needs
  ``torch_npu``, which cannot load on a CPU machine.
* ``HF_HUB_OFFLINE``: nothing is fetched; the model is a tiny directory generated per session.
* The installed copy of this project must be the working tree's (the README test command
  reinstalls it first); a stale install would test old code, so it fails the session instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

os.environ["VLLM_PLUGINS"] = "ascend_balance_scheduling"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.pop("VLLM_ASCEND_BALANCE_SCHEDULING", None)

import pytest  # noqa: E402
from balance_fixtures import (  # noqa: E402,F401  (pytest.ini's pythonpath has tests/ut)
    balance_env_unset,
    balance_off,
    balance_on,
    cap_gate_rule,
    tiny_model,
    tiny_moe_model,
    vllm_restored,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where each working-tree source directory is installed (see setup.py's package_dir).
INSTALLED_PACKAGES = {
    "vllm_ascend/core": "vllm_ascend.core",
    "vllm_ascend/patch/platform": "vllm_ascend_balance",
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pytest_sessionstart(session: pytest.Session) -> None:
    stale = []
    for directory, package in INSTALLED_PACKAGES.items():
        for source in sorted((REPO_ROOT / directory).glob("*.py")):
            module = f"{package}.{source.stem}"
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                stale.append(f"{module} is not installed")
            elif _digest(Path(spec.origin)) != _digest(source):
                stale.append(f"{module} ({spec.origin}) differs from {directory}/{source.name}")
    if stale:
        pytest.exit(
            "installed project is not the working tree (run scripts/test.sh, which "
            "reinstalls it):\n  " + "\n  ".join(stale),
            returncode=3,
        )
