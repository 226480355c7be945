"""Shared set-up for the patch-tool tests: a small synthetic repository and its series.

The pristine side is real: the installed vllm-ascend release's files (checked against the
distribution's RECORD); the synthetic manifest follows the project's manifest for that release
(see release_manifest.py). The repository side is a few files written per test, so the tests do
not depend on what other work is in the tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from export_patches import Manifest, PristineSource, generate, load_manifest, resolve
from release_manifest import FILES, INIT, MANIFEST, PROJECT, WIRING_SOURCE


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for path, text in FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    (root / "patches").mkdir()
    (root / "patches" / "series.toml").write_text(MANIFEST)
    return root


@pytest.fixture
def manifest(repo: Path) -> Manifest:
    return load_manifest(repo / "patches" / "series.toml")


@pytest.fixture(scope="session")
def pristine() -> PristineSource:
    source = PristineSource(PROJECT)
    # Guard: these tests need the installed, unmodified release (no network in unit tests).
    assert source.read(INIT) is not None
    assert source.origin.startswith("installed"), source.origin
    return source


@pytest.fixture
def series(repo: Path, manifest: Manifest, pristine: PristineSource, tmp_path: Path) -> Path:
    """The synthetic repository's series, written where its manifest says."""
    files = generate(manifest, resolve(manifest, repo), pristine, tmp_path / "gen")
    out = repo / manifest.output
    out.mkdir(parents=True)
    for name, content in files.items():
        (out / name).write_bytes(content)
    return out


@pytest.fixture
def vllm_ascend_tree(tmp_path: Path, pristine: PristineSource) -> Path:
    """A plain directory holding the pristine files the synthetic series modifies."""
    root = tmp_path / "vllm-ascend"
    for path in (INIT, WIRING_SOURCE):
        content = pristine.read(path)
        assert content is not None
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(content)
    (root / "vllm_ascend" / "core").mkdir()
    return root
