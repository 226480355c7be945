"""The series registers its e2e test where vllm-ascend's own CI looks, and upstream's checks pass.

vllm-ascend's CI refuses a test file that is in no suite: v0.18.0's ``run_suite.py`` (``sanity_check``,
before any e2e job runs) and v0.23.0's ``coverage.py`` (PR validation, then ``select_tests.py``). The
series therefore edits ``.github/workflows/scripts/*.yaml``, which the wheel does not hold:
export_patches reads them from the release's sdist (or at the tag of ``--git`` / ``$VLLM_ASCEND_GIT``).

The last tests apply each committed series to the release's whole tree and run upstream's own
scripts there, with and without the registration. The tree is the release sdist from the package
index, committed and tagged in a temporary git repository (release_tree.py), or, when
``$VLLM_ASCEND_GIT`` is set, that repository's tag: they need only what CI has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from export_patches import (
    PATCHES_DIR,
    REPO_ROOT,
    ExportError,
    PristineSource,
    generate,
    load_manifest,
    resolve,
)
from release_manifest import on_its_own_line
from release_tree import fake_sdist, patched_tree

MANIFESTS = sorted(PATCHES_DIR.glob("*.toml"))
SCRIPTS = ".github/workflows/scripts"
E2E_SOURCE = "tests/e2e/test_balance_scheduling_dp.py"


def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    return subprocess.run(["git", *ident, *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


# ------------------------------------------------------------------ the tool, on a small repository
_MANIFEST = """
[base]
distribution = "vllm-ascend"
version = "0.0.1"
tag = "v0.0.1"
output = "patches/series"
[commit]
author = "Test Author <test@example.invalid>"
date = "2026-05-01T00:00:00+00:00"
[classify]
scope = ["tests/e2e/**/*.py"]
exclude = []
[[patch]]
slug = "e2e"
subject = "[Test] Example e2e"
files = [{ from = "tests/e2e/test_x.py", to = "tests/e2e/two_card/test_x.py" }]
[[patch.edit]]
path = ".github/workflows/scripts/config.yaml"
find = "suite-b:\\n"
replace = "- name: tests/e2e/two_card/test_x.py\\nsuite-b:\\n"
[patch.message]
text = "Example."
"""


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, Path]:
    """(this-project-like repository with a manifest, vllm-ascend-like git repository with tag v0.0.1)."""
    upstream = tmp_path / "upstream"
    (upstream / SCRIPTS).mkdir(parents=True)
    (upstream / SCRIPTS / "config.yaml").write_text("suite-a:\n- name: tests/e2e/two_card/test_y.py\nsuite-b:\n")
    _git(tmp_path, "init", "-q", str(upstream))
    _git(upstream, "add", "-A")
    _git(upstream, "commit", "-qm", "release")
    _git(upstream, "tag", "v0.0.1")
    (upstream / SCRIPTS / "config.yaml").write_text("changed after the tag\n")  # must not be read
    _git(upstream, "commit", "-qam", "later")
    repo = tmp_path / "repo"
    (repo / "tests/e2e").mkdir(parents=True)
    (repo / "tests/e2e/test_x.py").write_text("def test_x() -> None:\n    pass\n")
    (repo / "patches").mkdir()
    (repo / "patches/series.toml").write_text(_MANIFEST)
    return repo, upstream


def test_an_edit_outside_the_wheel_reads_the_file_at_the_tag_from_git(small: tuple[Path, Path], tmp_path: Path) -> None:
    repo, upstream = small
    manifest = load_manifest(repo / "patches/series.toml")
    series = generate(manifest, resolve(manifest, repo), PristineSource(manifest, git_repo=upstream), tmp_path / "g")
    (patch,) = series.values()
    text = patch.decode()
    assert "+++ b/tests/e2e/two_card/test_x.py" in text
    hunk = " suite-a:\n - name: tests/e2e/two_card/test_y.py\n+- name: tests/e2e/two_card/test_x.py\n suite-b:\n"
    assert hunk in text
    # The patch applies to the tag, not to the later commit.
    _git(upstream, "checkout", "-q", "v0.0.1")
    (tmp_path / "p.patch").write_bytes(patch)
    _git(upstream, "apply", "--check", str(tmp_path / "p.patch"))


def _sdist_of(upstream: Path, path: Path, version: str = "0.0.1", top: str | None = None) -> Path:
    """The tag's tree as an sdist (setuptools-scm puts the tracked files of the tag in it)."""
    tree = {f: _git(upstream, "show", f"v0.0.1:{f}") for f in _git(upstream, "ls-files").split()}
    return fake_sdist(path, "vllm-ascend", version, tree, top=top)


def test_without_git_an_edit_outside_the_wheel_reads_the_release_sdist(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    repo, upstream = small
    manifest = load_manifest(repo / "patches/series.toml")
    from_git = generate(manifest, resolve(manifest, repo), PristineSource(manifest, git_repo=upstream), tmp_path / "g")
    sdist = _sdist_of(upstream, tmp_path / "vllm_ascend-0.0.1.tar.gz")
    source = PristineSource(manifest, sdist=sdist)
    assert generate(manifest, resolve(manifest, repo), source, tmp_path / "s") == from_git


def test_an_edit_of_a_file_the_sdist_lacks_is_refused(small: tuple[Path, Path], tmp_path: Path) -> None:
    repo, _ = small
    manifest = load_manifest(repo / "patches/series.toml")
    source = PristineSource(manifest, sdist=fake_sdist(tmp_path / "empty.tar.gz", "vllm-ascend", "0.0.1"))
    with pytest.raises(ExportError, match=r"config\.yaml is not in the pristine .*release sdist, or the tag of --git"):
        generate(manifest, resolve(manifest, repo), source, tmp_path / "g")


@pytest.mark.parametrize(
    ("version", "top", "error"),
    [
        ("0.0.2", "vllm_ascend-0.0.1", "PKG-INFO does not name 0.0.1"),
        ("0.0.1", "vllm_ascend-0.0.2", "vllm_ascend-0.0.2/PKG-INFO is outside vllm_ascend-0.0.1/"),
    ],
)
def test_an_sdist_of_another_release_is_refused(
    small: tuple[Path, Path], tmp_path: Path, version: str, top: str | None, error: str
) -> None:
    repo, upstream = small
    manifest = load_manifest(repo / "patches/series.toml")
    source = PristineSource(manifest, sdist=_sdist_of(upstream, tmp_path / "other.tar.gz", version, top))
    with pytest.raises(ExportError, match="is not the sdist of vllm-ascend 0.0.1: .*" + error):
        generate(manifest, resolve(manifest, repo), source, tmp_path / "g")


def test_a_repository_without_the_tag_is_refused(small: tuple[Path, Path], tmp_path: Path) -> None:
    repo, upstream = small
    _git(upstream, "tag", "-d", "v0.0.1")
    manifest = load_manifest(repo / "patches/series.toml")
    with pytest.raises(ExportError, match="not a git repository holding vllm-ascend's tag v0.0.1"):
        generate(manifest, resolve(manifest, repo), PristineSource(manifest, git_repo=upstream), tmp_path / "g")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_every_series_registers_its_e2e_test_in_upstreams_suite_config(path: Path) -> None:
    manifest = on_its_own_line(path)
    (target,) = [p for p in resolve(manifest) for t, s in p.sources.items() if s == E2E_SOURCE]
    e2e_path = next(t for t, s in target.sources.items() if s == E2E_SOURCE)
    edits = [e for e in target.spec.edits if e.path.startswith(SCRIPTS + "/")]
    assert edits and all(e2e_path in e.replace and e2e_path not in e.find for e in edits), edits
    # v0.23.0's scope module names every vllm_ascend/ file the series adds, so changing one selects the test.
    added = sorted(t for p in resolve(manifest) for t in p.files if t.startswith("vllm_ascend/"))
    scope = "".join(e.replace for e in edits if e.path.endswith("test_config.yaml"))
    if scope:
        assert [f for f in added if f"    - {f}\n" not in scope] == []


# ------------------------------------ the committed series, applied to the release's tree, upstream's scripts
@pytest.fixture(scope="module", params=MANIFESTS, ids=lambda p: p.stem)
def patched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(a clone at the manifest's tag with the committed series applied, the e2e test's path in it)."""
    manifest = on_its_own_line(request.param)
    workdir = tmp_path_factory.mktemp(manifest.tag)
    clone = patched_tree(manifest, REPO_ROOT, workdir)
    (e2e_path,) = [t for p in resolve(manifest) for t, s in p.sources.items() if s == E2E_SOURCE]
    return clone, e2e_path


def _python(clone: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Upstream's script, run as its workflow runs it: from the checkout's root."""
    return subprocess.run([sys.executable, "-c", code], cwd=clone, capture_output=True, text=True)


def _upstream_check(clone: Path) -> subprocess.CompletedProcess[str]:
    if (clone / SCRIPTS / "coverage.py").exists():  # v0.23.0: pr_test.yaml's "Validate test coverage config"
        return subprocess.run([sys.executable, f"{SCRIPTS}/coverage.py"], cwd=clone, capture_output=True, text=True)
    # v0.18.0: run_suite.py's sanity_check, which its main() runs before any suite (_e2e_test.yaml).
    return _python(
        clone,
        textwrap.dedent(f"""
            import sys
            sys.path.insert(0, "{SCRIPTS}")
            import run_suite
            run_suite.sanity_check(run_suite.load_suites())
            print("sanity_check passed")
        """),
    )


def _series_base(clone: Path) -> str:
    """The parent of the series' first commit: the release's tag, or the main line's commit."""
    return _git(clone, "log", "--reverse", "--format=%H", "--author=Balance Scheduling", "HEAD").split()[0] + "^"


def _without_registration(clone: Path) -> None:
    _git(clone, "checkout", "-q", _series_base(clone), "--", SCRIPTS)


def test_upstreams_suite_check_passes_with_the_series_and_fails_without_the_registration(
    patched: tuple[Path, str],
) -> None:
    clone, e2e_path = patched
    assert (clone / e2e_path).is_file()
    with_series = _upstream_check(clone)
    assert with_series.returncode == 0 and f"✗ {e2e_path}" not in with_series.stdout, with_series.stdout
    _without_registration(clone)
    try:
        without = _upstream_check(clone)
        # The releases' checks fail; main's coverage.py (exit 0 since) reports the file uncovered.
        assert without.returncode == 1 or "1 uncovered" in without.stdout, without.stdout + without.stderr
        assert e2e_path in without.stdout + without.stderr
    finally:
        _git(clone, "checkout", "-q", "HEAD", "--", SCRIPTS)


def test_the_series_python_files_pass_upstreams_own_lint_tools(patched: tuple[Path, str]) -> None:
    """ruff with the tag's configuration (the tag pins the ruff of this environment, 0.14.0) and the
    tag's pre-commit checks written in Python (forbidden imports such as `re` or `pickle`, ...)."""
    clone, _ = patched
    files = _git(clone, "diff", "--name-only", "--diff-filter=AM", _series_base(clone), "HEAD", "--", "*.py").split()
    assert files
    ruff = str(Path(sys.executable).with_name("ruff"))
    checks = ("check_forbidden_imports", "check_boolean_context_manager")
    tools = [[sys.executable, f"tools/{name}.py"] for name in checks]
    for cmd in ([ruff, "check"], [ruff, "format", "--check"], *tools):
        run = subprocess.run([*cmd, *files], cwd=clone, capture_output=True, text=True)
        assert run.returncode == 0, f"{' '.join(cmd[:2])}:\n{run.stdout}{run.stderr}"


def test_every_file_of_the_series_passes_upstreams_spell_checkers(patched: tuple[Path, str]) -> None:
    """codespell and typos with the arguments of the tree's own pre-commit hooks (the series adds no Markdown
    file, so markdownlint has nothing to check)."""
    clone, _ = patched
    files = _git(clone, "diff", "--name-only", "--diff-filter=AM", _series_base(clone), "HEAD").split()
    assert files and not [f for f in files if f.endswith(".md")]
    hooks = {
        hook["id"]: hook.get("args", [])
        for repo in yaml.safe_load((clone / ".pre-commit-config.yaml").read_text())["repos"]
        for hook in repo["hooks"]
    }
    for tool in ("codespell", "typos"):
        cmd = [str(Path(sys.executable).with_name(tool)), *hooks[tool], *files]
        run = subprocess.run(cmd, cwd=clone, capture_output=True, text=True)
        assert run.returncode == 0, f"{tool}:\n{run.stdout}{run.stderr}"


def test_v0_23_selects_the_e2e_test_for_a_balance_change_and_routes_it_to_two_cards(patched: tuple[Path, str]) -> None:
    clone, e2e_path = patched
    if not (clone / SCRIPTS / "select_tests.py").exists():
        pytest.skip("v0.18.0 runs the whole 2-card suite (run_suite.py), there is no selection")
    modules = next(yaml.safe_load_all((clone / SCRIPTS / "test_config.yaml").read_text()))
    (ours,) = [m for m in modules if e2e_path in m.get("tests", [])]
    assert ours["optional"] is True  # selected by its files' changes, not on every PR
    deps = ours["source_file_dependencies"]
    assert deps and [d for d in deps if not (clone / d).is_file()] == []  # no stale entry
    for changed, selected in (("vllm_ascend/core/balance_scheduler.py", True), ("vllm_ascend/ops/linear.py", False)):
        run = subprocess.run(
            [sys.executable, f"{SCRIPTS}/select_tests.py", "--changed-files", changed],
            cwd=clone,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "GITHUB_OUTPUT"},
        )
        assert run.returncode == 0, run.stderr
        groups = next(line for line in run.stdout.splitlines() if line.startswith("test_groups="))
        assert ('"runner":"linux-aarch64-a3-2"' in groups and e2e_path in groups) is selected, groups
