"""export_patches: the manifest decides the series, the series is reproducible, --check catches drift."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from export_patches import (
    PATCHES_DIR,
    REPO_ROOT,
    ExportError,
    Manifest,
    PristineSource,
    base_release,
    check,
    default_manifest,
    generate,
    load_manifest,
    manifest_versions,
    manifests_for,
    resolve,
)
from release_manifest import (
    INIT,
    INIT_EDITS,
    PROJECT,
    WIRING_SOURCE,
    WIRING_TARGET,
    needs_release,
    on_its_own_line,
    wiring_target,
)

PROJECT_MANIFESTS = sorted(PATCHES_DIR.glob("*.toml"))
# vllm-ascend's own (copying) module: strings naming it must survive the rewrites untouched.
VLLM_ASCEND_MODULE = b'"vllm_ascend.patch.platform.patch_balance_schedule"'


def _module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _imports_wiring(test_file: bytes, wiring_target: str) -> bool:
    """The file imports the module at wiring_target (under any name)."""
    package, _, name = _module_of(wiring_target).rpartition(".")
    return any(
        isinstance(node, ast.ImportFrom) and node.module == package and any(a.name == name for a in node.names)
        for node in ast.walk(ast.parse(test_file))
    )


@needs_release
def test_there_is_a_manifest_for_the_installed_release() -> None:
    assert default_manifest() == PROJECT.path
    assert len(PROJECT_MANIFESTS) >= 2  # one per release line


@pytest.mark.parametrize("path", PROJECT_MANIFESTS, ids=lambda p: p.stem)
def test_the_project_manifest_classifies_every_file_in_its_scope(path: Path) -> None:
    """A new file under vllm_ascend/ or tests/ must be exported or excluded explicitly."""
    manifest = on_its_own_line(path)
    patches = resolve(manifest, REPO_ROOT)
    targets = {path for patch in patches for path in patch.files}
    assert "vllm_ascend/core/balance_scheduler.py" in targets
    assert wiring_target(manifest) in targets
    assert not any(path.startswith("tests/ut/patches/") for path in targets)


@pytest.mark.parametrize("path", PROJECT_MANIFESTS, ids=lambda p: p.stem)
def test_the_project_tests_import_what_the_series_adds_and_keep_vllm_ascends_name(path: Path) -> None:
    """Rewritten tests import only modules the series exports (never vllm-ascend's copying
    module unless the series replaces it), and strings naming that module stay as written."""
    manifest = on_its_own_line(path)
    patches = resolve(manifest, REPO_ROOT)
    targets = {target for patch in patches for target in patch.files}
    exported_modules = {_module_of(t) for t in targets}
    stand_ins = 0
    for patch in patches:
        for target, content in patch.files.items():
            if not target.startswith("tests/"):
                continue
            source = (REPO_ROOT / patch.sources[target]).read_bytes()
            assert content.count(VLLM_ASCEND_MODULE) == source.count(VLLM_ASCEND_MODULE), target
            stand_ins += content.count(VLLM_ASCEND_MODULE)
            for node in ast.walk(ast.parse(content)):
                if isinstance(node, ast.ImportFrom) and node.module == "vllm_ascend.patch.platform":
                    for alias in node.names:
                        assert f"{node.module}.{alias.name}" in exported_modules, (target, alias.name)
    assert stand_ins > 0  # the stand-in of test_engine_route.py is among them
    route = next(
        patch.files["tests/ut/core/test_engine_route.py"]
        for patch in patches
        if "tests/ut/core/test_engine_route.py" in patch.files
    )
    assert _imports_wiring(route, wiring_target(manifest))


def test_files_map_to_vllm_ascend_paths_and_only_tests_are_rewritten(repo: Path, manifest: Manifest) -> None:
    feature, tests = resolve(manifest, repo)
    assert sorted(feature.files) == sorted(["vllm_ascend/core/balance_example.py", WIRING_TARGET])
    # Sources are exported byte for byte: the docstring keeps the pip-install name.
    assert b"vllm_ascend_balance.patch_balance_schedule" in feature.files[WIRING_TARGET]
    assert sorted(tests.files) == ["tests/ut/core/helper.py", "tests/ut/core/test_example.py"]
    rewritten = tests.files["tests/ut/core/test_example.py"]
    assert b"vllm_ascend_balance" not in rewritten
    assert _imports_wiring(rewritten, WIRING_TARGET)


def test_a_form_the_rewrites_miss_is_refused_by_file_and_line(repo: Path, manifest: Manifest) -> None:
    feature, tests = manifest.patches
    no_rewrites = dataclasses.replace(tests, rewrites=(), forbid=("vllm_ascend_balance",))
    bare = dataclasses.replace(manifest, patches=(feature, no_rewrites))
    with pytest.raises(
        ExportError,
        match=r"tests/ut/engine/test_example.py:1 still names "
        r"'vllm_ascend_balance'",
    ):
        resolve(bare, repo)
    # Whole identifiers only: a longer name that contains it is not a use of the package.
    (repo / "tests/ut/engine/test_example.py").write_text("KEY = '_vllm_ascend_balance_x'\n")
    resolve(bare, repo)


@needs_release
def test_the_default_manifest_is_the_installed_releases(tmp_path: Path) -> None:
    assert manifest_versions()[default_manifest()] == (PROJECT.distribution, PROJECT.version)
    other = tmp_path / "vllm-ascend-v0.0.1.toml"
    other.write_text(PROJECT.path.read_text().replace(f'version = "{PROJECT.version}"', 'version = "0.0.1"', 1))
    installed = metadata.version(PROJECT.distribution)  # the release, or a post-release of it
    with pytest.raises(
        ExportError,
        match=r"no manifest matches the installed release "
        rf"\(vllm-ascend {re.escape(installed)}\)(.|\n)*"
        r"vllm-ascend-v0.0.1.toml \(vllm-ascend 0.0.1\)",
    ):
        default_manifest(tmp_path)
    shutil.copy(PROJECT.path, tmp_path / PROJECT.path.name)
    assert default_manifest(tmp_path) == tmp_path / PROJECT.path.name


def test_a_post_release_or_local_build_follows_its_release_and_nothing_else_does() -> None:
    assert base_release("0.23.0") == "0.23.0"
    assert base_release("0.23.0.post1") == base_release("0.23.0+cpu") == "0.23.0"
    assert base_release("v0.18.0.post2") == "0.18.0"
    assert base_release("0.23.0rc1") is None and base_release("0.24.0.dev3+g1234") is None
    available = {
        Path("a.toml"): ("vllm-ascend", "0.18.0"),
        Path("b.toml"): ("vllm-ascend", "0.23.0"),
        Path("c.toml"): ("other", "0.23.0"),
    }
    assert manifests_for("0.23.0", "vllm-ascend", available) == ([Path("b.toml")], False)
    assert manifests_for("0.23.0.post1", "vllm-ascend", available) == ([Path("b.toml")], True)
    assert manifests_for("0.23.1", "vllm-ascend", available) == ([], False)
    assert manifests_for("0.23.0rc1", "vllm-ascend", available) == ([], False)


def test_an_unclassified_file_is_refused_by_name(repo: Path, manifest: Manifest) -> None:
    (repo / "tests/ut/sim").mkdir(parents=True)
    (repo / "tests/ut/sim/test_new.py").write_text("")
    with pytest.raises(ExportError, match=r"tests/ut/sim/test_new.py"):
        resolve(manifest, repo)


def test_the_walk_never_enters_a_venv_or_a_cache(
    repo: Path, manifest: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI builds the other lines' venvs while a line's tests resolve the series: a walk into one meets folders
    that pip removes under it (FileNotFoundError), so the walk must never look inside."""
    for ignored in (".venv-v0.33.0/lib/site-packages/pkg/__pycache__", "vllm_ascend/__pycache__", ".git/objects"):
        (repo / ignored).mkdir(parents=True)
        (repo / ignored / "x.py").write_text("")
    scanned: list[str] = []
    real_scandir = os.scandir

    def recording_scandir(path: str | Path = ".") -> object:
        scanned.append(Path(path).relative_to(repo).as_posix())
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", recording_scandir)
    resolve(manifest, repo)
    assert "tests/ut/engine" in scanned
    assert not [path for path in scanned if path.startswith((".venv", ".git")) or "__pycache__" in path]


def test_two_files_mapping_to_one_target_are_refused(repo: Path, manifest: Manifest) -> None:
    (repo / "tests/ut/engine/helper.py").write_text("")
    with pytest.raises(ExportError, match="both map to tests/ut/core/helper.py"):
        resolve(manifest, repo)


def test_the_series_is_reproducible_and_git_formatted(
    repo: Path, manifest: Manifest, pristine: PristineSource, tmp_path: Path
) -> None:
    patches = resolve(manifest, repo)
    first = generate(manifest, patches, pristine, tmp_path / "a")
    second = generate(manifest, patches, pristine, tmp_path / "b")
    assert first == second
    assert sorted(first) == ["0001-Feature-Example.patch", "0002-Test-Example-tests.patch"]
    text = first["0001-Feature-Example.patch"].decode()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH 1/2] [Feature] Example" in text
    assert "From: Test Author <test@example.invalid>" in text
    # The manifest's edits of __init__: each removed line as "-", each added line as "+".
    added = removed = 0
    for edit in INIT_EDITS:
        old, new = edit.find.splitlines(), edit.replace.splitlines()
        for line in (line for line in old if line not in new):
            assert f"\n-{line}\n" in text
            removed += 1
        for line in (line for line in new if line not in old):
            assert f"\n+{line}\n" in text
            added += 1
    assert added >= 2  # at least the import and the register() call
    # The blob ids are git's, so `git am -3` on a real checkout can fall back to a 3-way merge.
    pristine_init = pristine.read(INIT)
    assert pristine_init is not None
    blob = hashlib.sha1(b"blob %d\0" % len(pristine_init) + pristine_init).hexdigest()
    assert f"index {blob}.." in text


def test_check_passes_on_a_current_series(
    repo: Path, manifest: Manifest, pristine: PristineSource, series: Path
) -> None:
    assert check(manifest, repo, pristine) == []


def test_check_names_the_stale_patch_and_file(
    repo: Path, manifest: Manifest, pristine: PristineSource, series: Path
) -> None:
    (repo / "vllm_ascend/core/balance_example.py").write_text('"""Example."""\nVALUE = 2\n')
    problems = check(manifest, repo, pristine)
    assert "stale: patches/series/0001-Feature-Example.patch" in problems
    assert (
        "after git am, vllm_ascend/core/balance_example.py differs from vllm_ascend/core/balance_example.py"
    ) in problems


def test_check_reports_a_series_that_does_not_apply(
    repo: Path, manifest: Manifest, pristine: PristineSource, series: Path
) -> None:
    patch = series / "0001-Feature-Example.patch"
    text = patch.read_text()
    # A context line of the __init__ hunk: the committed series no longer matches pristine.
    start = text.index(f"diff --git a/{INIT}")
    hunk = text[start:]
    context = next(line for line in hunk.splitlines()[5:] if line.startswith(" ") and line.strip())
    patch.write_text(text[:start] + hunk.replace(f"\n{context}\n", f"\n {context.strip()}  # changed\n", 1))
    problems = check(manifest, repo, pristine)
    assert any("does not apply" in p and "vllm_ascend/patch/platform/__init__.py" in p for p in problems), problems


def test_check_reports_missing_and_extra_patch_files(
    repo: Path, manifest: Manifest, pristine: PristineSource, series: Path
) -> None:
    (series / "0002-Test-Example-tests.patch").rename(series / "0002-old-name.patch")
    problems = check(manifest, repo, pristine)
    assert "missing from patches/series: 0002-Test-Example-tests.patch" in problems
    assert "not produced by the manifest any more: patches/series/0002-old-name.patch" in problems


def test_an_edit_whose_anchor_moved_upstream_is_refused(repo: Path, pristine: PristineSource, tmp_path: Path) -> None:
    toml = repo / "patches" / "series.toml"
    toml.write_text(
        toml.read_text().replace(
            "import vllm_ascend.patch.platform.patch_balance_schedule  # noqa", "import moved  # noqa", 1
        )
    )
    manifest = load_manifest(toml)
    with pytest.raises(ExportError, match="occurs 0 times"):
        generate(manifest, resolve(manifest, repo), pristine, tmp_path / "gen")


def test_installed_pristine_source_ignores_files_other_distributions_added(pristine: PristineSource) -> None:
    # This project's pip install puts balance_scheduler.py into vllm_ascend/core; it is not
    # vllm-ascend's, so the pristine release has no such file.
    assert pristine.read("vllm_ascend/core/balance_scheduler.py") is None
    if PROJECT.archive is None:  # a wheel has no tests/; a commit's source archive (main) has them
        assert pristine.read("tests/ut/conftest.py") is None
    content = pristine.read(WIRING_SOURCE)
    assert content is not None and b"class BalanceScheduler(Scheduler)" in content


@needs_release
def test_a_wheel_is_read_when_given(tmp_path: Path) -> None:
    wheel = tmp_path / f"vllm_ascend-{PROJECT.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(INIT, "# from the wheel\n")
    source = PristineSource(PROJECT, wheel=wheel)
    assert source.read(INIT) == b"# from the wheel\n"
    assert source.read("vllm_ascend/core/absent.py") is None
    assert source.origin == str(wheel)


def test_cli_check_exit_status(repo: Path, series: Path, empty_sdist: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "scripts" / "export_patches.py"),
                "--root",
                str(repo),
                "--manifest",
                str(repo / "patches" / "series.toml"),
                "--sdist",
                str(empty_sdist),
                *args,
            ],
            capture_output=True,
            text=True,
        )

    current = run("--check")
    assert current.returncode == 0, current.stderr
    (repo / "scripts/helper.py").write_text("HELP = 2\n")
    stale = run("--check")
    assert stale.returncode == 1
    assert "stale: patches/series/0002-Test-Example-tests.patch" in stale.stderr
    assert run().returncode == 0  # regenerates
    assert run("--check").returncode == 0
