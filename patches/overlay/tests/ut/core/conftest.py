"""Fixtures of the balance-scheduling unit tests, for vllm-ascend's tests/ut/core.

Exported by the patch series only (this repository's own test session gets the same fixtures
from tests/ut/conftest.py, with project-only checks added). Everything is built offline: the
model is a tiny directory generated per session, nothing is fetched from a hub.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("VLLM_ASCEND_BALANCE_SCHEDULING", None)
# offline_vllm.py sits beside this file; not every import mode puts this directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))


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


@pytest.fixture
def balance_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "0")
