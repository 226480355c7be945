"""Fixtures shared by the balance-scheduling unit tests (a pytest plugin module).

Loaded by this repository's ``tests/ut/conftest.py`` and, in the upstream patch series, by the
``conftest.py`` of vllm-ascend's ``tests/ut/core`` — one definition for both. Everything is built
offline: the model is a tiny directory generated per session, nothing is fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

import pytest


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


@pytest.fixture
def balance_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither "1" nor "0": only a config's ``additional_config`` can switch it on."""
    monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
