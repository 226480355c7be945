"""Shared set-up for the patch-tool tests: a small synthetic repository and its series.

The pristine side is real: the installed vllm-ascend release's files (checked against the
distribution's RECORD); outside ``vllm_ascend/``, where the synthetic series only adds files, a
stand-in sdist holding none (release_tree.py). The synthetic manifest follows the project's
manifest for that release (see release_manifest.py). The repository side is a few files written
per test, so the tests do not depend on what other work is in the tree. Tests that need the
installed release skip, with the reason, when it is not exactly a release the project has a
manifest for.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
from pathlib import Path

import pytest
from export_patches import ExportError, Manifest, PristineSource, generate, load_manifest, resolve
from release_manifest import FILES, INIT, INSTALLED_TOUCHED, MANIFEST, PROJECT, UNAVAILABLE, WIRING_SOURCE
from release_tree import fake_sdist
from tool_runner import with_dist_info


@pytest.fixture(autouse=True)
def state_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test's journals and backups go to its own directory (never the user's)."""
    root = tmp_path / "state"
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_STATE_DIR", str(root))
    return root


def _require_release() -> Manifest:
    if PROJECT is None:
        pytest.skip(UNAVAILABLE)
    return PROJECT


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _require_release()
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


def _record_intact(project: Manifest, paths: list[str]) -> str | None:
    """Why the installed distribution cannot serve as the pristine release (None: it can)."""
    installed = metadata.version(project.distribution)
    if installed != project.version:
        return (
            f"installed {project.distribution} {installed} is not exactly {project.version}: "
            "its pristine files would have to be downloaded (unit tests stay offline)"
        )
    dist = metadata.distribution(project.distribution)
    hashes = {str(f): f.hash.value for f in dist.files or [] if f.hash is not None}
    for path in paths:
        content = Path(dist.locate_file(path)).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        if hashes.get(path) != digest:
            return f"installed {path} is not the released file (RECORD hash differs)"
    return None


@pytest.fixture(scope="session")
def empty_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's sdist as these tests see it: no file the synthetic series adds (offline)."""
    project = _require_release()
    return fake_sdist(tmp_path_factory.mktemp("sdist") / "release.tar.gz", project.distribution, project.version)


@pytest.fixture(scope="session")
def pristine(empty_sdist: Path) -> PristineSource:
    project = _require_release()
    # These tests need the installed, unmodified release (no network in unit tests).
    reason = _record_intact(project, [INIT, WIRING_SOURCE])
    if reason:
        pytest.skip(reason)
    try:
        source = PristineSource(project, sdist=empty_sdist)
    except ExportError as error:  # a commit's line (main) whose source archive is not on this machine
        pytest.skip(str(error))
    assert source.read(INIT) is not None
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
    """A plain directory holding the pristine files the synthetic series modifies (and every other
    ``vllm_ascend/`` file the project's series changes, so that series applies to it too)."""
    root = tmp_path / "vllm-ascend"
    for path in INSTALLED_TOUCHED:
        content = pristine.read(path)
        assert content is not None
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(content)
    (root / "vllm_ascend" / "core").mkdir(exist_ok=True)
    return root


@pytest.fixture
def site_packages(vllm_ascend_tree: Path) -> Path:
    """The same files as an installed vllm-ascend: a dist-info naming the release."""
    assert PROJECT is not None
    return with_dist_info(vllm_ascend_tree, PROJECT.version)
