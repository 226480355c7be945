"""What the patch-tool tests expect of the installed release, from the project's manifest for it.

The synthetic series of these tests does to the pristine files what the project's manifest for
the installed vllm-ascend release does (its ``__init__`` edits, where the wiring module goes, how
test imports are rewritten), so the same tests run on every release line the project has a
manifest for. A module of its own (not conftest.py) so test files can import it unambiguously.

When no manifest matches the installed vllm-ascend, importing this still works: ``PROJECT`` is None,
``UNAVAILABLE`` says why, and the tests that need the release are skipped with that reason (a
failure here must never stop the collection of the whole suite).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from export_patches import ExportError, Manifest, PatchSpec, _matches, load_manifest

INIT = "vllm_ascend/patch/platform/__init__.py"
WIRING_SOURCE = "vllm_ascend/patch/platform/patch_balance_schedule.py"


def wiring_target(manifest: Manifest) -> str:
    """Where the manifest exports this repository's wiring module in vllm-ascend."""
    for spec in manifest.patches:
        for rule in spec.files:
            if _matches(WIRING_SOURCE, rule.source_glob):  # the tool's own glob semantics
                return rule.target_for(WIRING_SOURCE)
    raise AssertionError(f"{manifest.path.name} does not export {WIRING_SOURCE}")


def _test_patch(manifest: Manifest) -> PatchSpec:
    """The patch of the unit tests (its files are rewritten to vllm-ascend's module names)."""
    (spec,) = [spec for spec in manifest.patches if spec.rewrites and spec.slug.endswith("unit-tests")]
    return spec


def _toml(value: str) -> str:
    # JSON's string escapes (\n, \", \\, \uXXXX) are all TOML basic-string escapes.
    return json.dumps(value)


def _synthetic_manifest() -> str:
    assert PROJECT is not None
    edits = "".join(
        f"[[patch.edit]]\npath = {_toml(e.path)}\nfind = {_toml(e.find)}\nreplace = {_toml(e.replace)}\n"
        for e in INIT_EDITS
    )
    rewrites = ", ".join(
        f"{{ find = {_toml(r.find)}, replace = {_toml(r.replace)} }}" for r in _test_patch(PROJECT).rewrites
    )
    forbid = ", ".join(_toml(name) for name in _test_patch(PROJECT).forbid)
    return (
        textwrap.dedent(f'''
        [base]
        distribution = "{PROJECT.distribution}"
        version = "{PROJECT.version}"
        tag = "{PROJECT.tag}"
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
        files = [{{ from = "vllm_ascend/core/balance_*.py" }},
                 {{ from = "{WIRING_SOURCE}", to = "{WIRING_TARGET}" }}]
        ''')
        + edits
        + textwrap.dedent(f"""
        [patch.message]
        text = "### What this PR does / why we need it?\\n\\nExample."

        [[patch]]
        slug = "tests"
        subject = "[Test] Example tests"
        files = [{{ from = "tests/ut/engine/*.py", to = "tests/ut/core/" }},
                 {{ from = "scripts/helper.py", to = "tests/ut/core/helper.py" }}]
        rewrite = [{rewrites}]
        forbid = [{forbid}]
        [patch.message]
        text = "### How was this patch tested?\\n\\nExample."
        """)
    )


# The project's manifest for the installed vllm-ascend release (the tools' default too).
try:
    PROJECT: Manifest | None = load_manifest()
    UNAVAILABLE: str | None = None
except ExportError as error:
    PROJECT = None
    UNAVAILABLE = f"no patch manifest for the installed vllm-ascend: {error}".replace("\n", " ")
needs_release = pytest.mark.skipif(PROJECT is None, reason=UNAVAILABLE or "")


def on_its_own_line(path: Path) -> Manifest:
    """The series manifest at ``path``, or a skip unless it is the installed line's: these checks do not depend on
    the installed vLLM, so each series is checked once, on its own line (CI runs every line), not on all five."""
    manifest = load_manifest(path)
    if PROJECT is None or PROJECT.path.resolve() != manifest.path.resolve():
        pytest.skip(f"{manifest.path.name} is checked on its own line (vllm-ascend {manifest.version})")
    return manifest


# A line cut against a commit (vllm-ascend main, [base] archive) has no releases, so no post-releases.
has_post_releases = pytest.mark.skipif(
    PROJECT is not None and PROJECT.archive is not None,
    reason="the installed vllm-ascend is a commit of main (no release, so no post-release follows it)",
)

if PROJECT is not None:
    WIRING_TARGET = wiring_target(PROJECT)
    INIT_EDITS = tuple(edit for spec in PROJECT.patches for edit in spec.edits if edit.path == INIT)
    # The line of the edited __init__ that calls register() (what a conflict must show).
    REGISTER_CALL = next(
        line
        for edit in INIT_EDITS
        for line in edit.replace.splitlines()
        if "register" in line and line.rstrip().endswith("()")
    )
    NEW_FILES = ["vllm_ascend/core/balance_example.py", "tests/ut/core/test_example.py", "tests/ut/core/helper.py"] + (
        [WIRING_TARGET] if WIRING_TARGET != WIRING_SOURCE else []
    )
    MANIFEST = _synthetic_manifest()
    # Every installed-package file the project's series changes: a site-packages target holds them all.
    INSTALLED_TOUCHED = sorted(
        {INIT, WIRING_SOURCE}
        | {
            path
            for spec in PROJECT.patches
            for path in [edit.path for edit in spec.edits] + list(spec.deletes)
            if path.startswith("vllm_ascend/")
        }
    )
else:  # every test that uses these is skipped (needs_release, or the fixtures of conftest.py)
    WIRING_TARGET = INIT_EDITS = REGISTER_CALL = NEW_FILES = MANIFEST = INSTALLED_TOUCHED = None  # type: ignore

FILES = {
    "vllm_ascend/core/balance_example.py": '"""Example."""\nVALUE = 1\n',
    WIRING_SOURCE: '"""Wiring, installed as vllm_ascend_balance.patch_balance_schedule."""\n\n\n'
    "def register() -> None:\n    pass\n",
    "tests/ut/engine/test_example.py": "from vllm_ascend_balance import patch_balance_schedule\n\n\n"
    "def test_it() -> None:\n    assert patch_balance_schedule.register() is None\n",
    "tests/ut/conftest.py": "# project-only\n",
    "scripts/helper.py": "HELP = 1\n",
}
