"""Shared set-up for the patch-tool tests: a small synthetic repository and its series.

The pristine side is real: vllm-ascend 0.18.0's files as installed in this environment (checked
against the distribution's RECORD); the repository side is a few files written per test, so the
tests do not depend on what other work is in the tree.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from export_patches import Manifest, PristineSource, generate, load_manifest, resolve

MANIFEST = textwrap.dedent('''
    [base]
    distribution = "vllm-ascend"
    version = "0.18.0"
    tag = "v0.18.0"
    output = "patches/series"

    [commit]
    author = "Test Author <test@example.invalid>"
    date = "2026-05-01T00:00:00+00:00"

    [classify]
    scope = ["vllm_ascend/**/*.py", "tests/ut/**/*.py"]
    exclude = ["tests/ut/conftest.py"]

    [[patch]]
    slug = "feature"
    subject = "[Feature] Example"
    files = [{ from = "vllm_ascend/core/balance_*.py" },
             { from = "vllm_ascend/patch/platform/patch_balance_*.py" }]
    [[patch.edit]]
    path = "vllm_ascend/patch/platform/__init__.py"
    find = """
    if envs.VLLM_ASCEND_BALANCE_SCHEDULING:
        import vllm_ascend.patch.platform.patch_balance_schedule  # noqa
    """
    replace = """
    if envs.VLLM_ASCEND_BALANCE_SCHEDULING:
        from vllm_ascend.patch.platform.patch_balance_schedule import register

        register()
    """
    [patch.message]
    text = "### What this PR does / why we need it?\\n\\nExample."

    [[patch]]
    slug = "tests"
    subject = "[Test] Example tests"
    files = [{ from = "tests/ut/engine/*.py", to = "tests/ut/core/" },
             { from = "scripts/helper.py", to = "tests/ut/core/helper.py" }]
    rewrite = [{ find = "vllm_ascend_balance", replace = "vllm_ascend.patch.platform" }]
    [patch.message]
    text = "### How was this patch tested?\\n\\nExample."
''')

FILES = {
    "vllm_ascend/core/balance_example.py": '"""Example."""\nVALUE = 1\n',
    "vllm_ascend/patch/platform/patch_balance_schedule.py":
        '"""Wiring, installed as vllm_ascend_balance.patch_balance_schedule."""\n\n\n'
        "def register() -> None:\n    pass\n",
    "tests/ut/engine/test_example.py":
        "from vllm_ascend_balance import patch_balance_schedule\n\n\n"
        "def test_it() -> None:\n    assert patch_balance_schedule.register() is None\n",
    "tests/ut/conftest.py": "# project-only\n",
    "scripts/helper.py": "HELP = 1\n",
}


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
    source = PristineSource(load_manifest())
    # Guard: these tests need the installed, unmodified release (no network in unit tests).
    assert source.read("vllm_ascend/patch/platform/__init__.py") is not None
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
    for path in ("vllm_ascend/patch/platform/__init__.py",
                 "vllm_ascend/patch/platform/patch_balance_schedule.py"):
        content = pristine.read(path)
        assert content is not None
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(content)
    (root / "vllm_ascend" / "core").mkdir()
    return root
