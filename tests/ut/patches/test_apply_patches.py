"""apply_patches: checked, journaled, reversible; versions, states, paths and backups as documented."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import patch_journal
import pytest
from apply_patches import ApplyError, Status, find_target, main
from export_patches import PATCHES_DIR, load_manifest, manifest_versions
from release_manifest import INIT, NEW_FILES, PROJECT, REGISTER_CALL, has_post_releases, needs_release
from tool_runner import run_tool, snapshot, with_dist_info


def only_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def backups(state_root: Path) -> list[Path]:
    return sorted(p for p in state_root.glob("*/backups/*") if p.is_dir())


def test_apply_is_checked_backed_up_idempotent_and_reverts_exactly(
    vllm_ascend_tree: Path, series: Path, state_root: Path
) -> None:
    original = snapshot(vllm_ascend_tree)
    args = ("--target", vllm_ascend_tree, "--series", series)
    assert run_tool("status", *args).returncode == 0

    dry = run_tool("apply", *args, "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("dry run") and INIT in dry.stdout
    assert snapshot(vllm_ascend_tree) == original and not state_root.exists()

    done = run_tool("apply", *args)
    assert done.returncode == 0, done.stderr
    patched = snapshot(vllm_ascend_tree)
    assert all(path in patched for path in NEW_FILES)
    assert REGISTER_CALL.encode() in patched[INIT][0]
    # The backup is outside the tree, in the target's own state directory.
    (backup,) = backups(state_root)
    assert str(backup) in done.stdout and state_root not in vllm_ascend_tree.parents
    assert (backup / "before" / INIT).read_bytes() == original[INIT][0]
    assert not any(name.endswith(patch_journal.TMP_SUFFIX) for name in patched)

    again = run_tool("apply", *args)
    assert "nothing to do" in again.stdout and snapshot(vllm_ascend_tree) == patched

    assert run_tool("revert", *args).returncode == 0
    assert snapshot(vllm_ascend_tree) == original  # new directories (tests/ut/core) gone too
    assert "nothing to revert" in run_tool("revert", *args).stdout


def test_a_conflict_names_the_hunk_and_changes_nothing(vllm_ascend_tree: Path, series: Path, state_root: Path) -> None:
    init = vllm_ascend_tree / INIT
    init.write_text(
        init.read_text().replace("patch_balance_schedule  # noqa", "patch_balance_schedule  # noqa: edited")
    )
    before = snapshot(vllm_ascend_tree)
    args = ("--target", vllm_ascend_tree, "--series", series)
    status = run_tool("status", *args)
    assert status.returncode == Status.CONFLICT.code
    assert f"differing from what patches/series expects: {INIT}" in status.stdout
    failed = run_tool("apply", *args)
    assert failed.returncode == 1
    assert f"patch failed: {INIT}:" in failed.stderr
    assert f"--- conflicting hunk in {INIT}" in failed.stderr
    assert f"+{REGISTER_CALL}" in failed.stderr
    assert snapshot(vllm_ascend_tree) == before
    assert backups(state_root) == []


def test_an_edit_after_apply_is_reported_and_revert_force_restores_the_originals(
    vllm_ascend_tree: Path, series: Path, state_root: Path
) -> None:
    original = snapshot(vllm_ascend_tree)
    args = ("--target", vllm_ascend_tree, "--series", series)
    assert run_tool("apply", *args).returncode == 0
    init = vllm_ascend_tree / INIT
    edited = init.read_text().replace(f"{REGISTER_CALL}\n", f"{REGISTER_CALL}  # edited\n")
    init.write_text(edited)

    status = run_tool("status", *args)
    assert status.returncode == Status.MODIFIED.code
    assert f"no longer reverts: {INIT}" in status.stdout and "revert --force" in status.stdout
    refused = run_tool("revert", *args)
    assert refused.returncode == 1 and f"conflicting hunk in {INIT}" in refused.stderr

    forced = run_tool("revert", *args, "--force")
    assert forced.returncode == 0, forced.stderr
    assert snapshot(vllm_ascend_tree) == original
    assert (backups(state_root)[-1] / "before" / INIT).read_text() == edited  # the edit is kept


def test_an_edit_outside_the_hunks_is_reported_and_reverted_around(vllm_ascend_tree: Path, series: Path) -> None:
    args = ("--target", vllm_ascend_tree, "--series", series)
    assert run_tool("apply", *args).returncode == 0
    init = vllm_ascend_tree / INIT
    init.write_text("# a local note\n" + init.read_text())
    status = run_tool("status", *args)
    assert status.returncode == Status.MODIFIED.code
    assert f"applied, then edited: {INIT}" in status.stdout and "keeps these edits" in status.stdout
    assert run_tool("revert", *args).returncode == 0
    assert init.read_text().startswith("# a local note\n")
    assert run_tool("status", *args).returncode == 0


def test_an_installed_vllm_ascend_gets_only_the_package_part(site_packages: Path, series: Path) -> None:
    assert find_target(site_packages, installed=False).installed
    assert run_tool("apply", "--target", site_packages, "--series", series).returncode == 0
    assert (site_packages / "vllm_ascend/core/balance_example.py").exists()
    assert not (site_packages / "tests").exists()


def test_the_plugin_installed_in_the_same_place_is_named(site_packages: Path, series: Path) -> None:
    (site_packages / "vllm_ascend_balance_scheduling-0.1.0.dist-info").mkdir()
    args = ("--target", site_packages, "--series", series)
    for command in ("apply", "revert"):
        refused = run_tool(command, *args)
        assert refused.returncode == 1
        assert "pip uninstall vllm-ascend-balance-scheduling" in only_line(refused.stderr)
    status = run_tool("status", *args)
    assert status.returncode == Status.PLUGIN.code and "pip uninstall" in status.stdout


def test_a_directory_without_vllm_ascend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ApplyError, match="not a vllm-ascend tree"):
        find_target(tmp_path, installed=False)


def test_relative_paths_are_resolved_from_the_current_directory(
    vllm_ascend_tree: Path, series: Path, tmp_path: Path
) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    args = ("--target", os.path.relpath(vllm_ascend_tree, cwd), "--series", os.path.relpath(series, cwd))
    assert run_tool("apply", *args, cwd=cwd).returncode == 0
    status = run_tool("status", *args, cwd=cwd)
    assert status.returncode == 0 and status.stdout.strip().endswith("applied (patches/series)")


# ------------------------------------------------------------------------------------ versions
def test_the_series_follows_the_targets_version_not_the_running_pythons(vllm_ascend_tree: Path) -> None:
    """The project's real series: chosen by each target's dist-info."""
    releases = {version: path for path, (_, version) in manifest_versions().items()}
    assert PROJECT is not None and len(releases) >= 2
    other = next(version for version in releases if version != PROJECT.version)
    for version, expect in ((PROJECT.version, 0), (other, Status.CONFLICT.code)):
        with_dist_info(vllm_ascend_tree, version)
        status = run_tool("status", "--target", vllm_ascend_tree)
        # This release's series applies to its pristine files; the other's is chosen for the
        # other version (and does not apply to files of this release).
        assert status.returncode == expect, status.stdout
        assert load_manifest(releases[version]).output in status.stdout


def test_a_version_without_a_series_is_one_line_naming_both(vllm_ascend_tree: Path) -> None:
    with_dist_info(vllm_ascend_tree, "0.0.1")
    listing = ", ".join(sorted(version for _, version in manifest_versions().values()))
    status = run_tool("status", "--target", vllm_ascend_tree)
    assert status.returncode == Status.NO_SERIES.code
    assert "no series for vllm-ascend 0.0.1" in status.stdout
    assert f"series exist for {listing}" in status.stdout
    for command in ("apply", "revert"):
        refused = run_tool(command, "--target", vllm_ascend_tree)
        assert refused.returncode == 1
        assert "no series for vllm-ascend 0.0.1" in only_line(refused.stderr)
    # An explicit series of another release: one line naming both versions.
    with_dist_info(vllm_ascend_tree, PROJECT.version)
    # A release's series (the main line's manifest names a commit: no "vllm-ascend-v<version>" directory).
    other = next(path for path, (_, v) in manifest_versions().items() if v != PROJECT.version and "+" not in v)
    other_version = manifest_versions()[other][1]
    refused = run_tool("apply", "--target", vllm_ascend_tree, "--series", PATCHES_DIR / f"vllm-ascend-v{other_version}")
    line = only_line(refused.stderr)
    assert f"is the series for vllm-ascend {other_version}" in line
    assert f"is vllm-ascend {PROJECT.version}" in line


@has_post_releases
def test_a_post_release_uses_the_base_series_only_when_its_files_are_the_releases(
    vllm_ascend_tree: Path, series: Path, repo: Path
) -> None:
    post = f"{PROJECT.version}.post1"
    with_dist_info(vllm_ascend_tree, post)
    args = ("--target", vllm_ascend_tree, "--manifests", repo / "patches")
    original = snapshot(vllm_ascend_tree)
    status = run_tool("status", *args)
    assert status.returncode == 0
    assert f"{post} uses the {PROJECT.version} series: every file it touches is identical" in status.stdout
    assert run_tool("apply", *args).returncode == 0
    assert run_tool("status", *args).stdout.count("applied (patches/series)") == 1
    assert run_tool("revert", *args).returncode == 0
    assert snapshot(vllm_ascend_tree) == original

    # The post-release changed a file the series touches (outside any hunk): refused, one line.
    init = vllm_ascend_tree / INIT
    init.write_text(init.read_text() + "# changed in the post-release\n")
    refused = run_tool("apply", *args)
    assert refused.returncode == 1
    line = only_line(refused.stderr)
    assert f"vllm-ascend {post}" in line and f"differs from {PROJECT.version} in {INIT}" in line
    assert run_tool("status", *args).returncode == Status.NO_SERIES.code
    # A pre-release of the same numbers is another release.
    with_dist_info(vllm_ascend_tree, f"{PROJECT.version}rc1")
    assert "no series for" in only_line(run_tool("apply", *args).stderr)


def _git(root: Path, *args: str) -> None:
    env = dict(
        os.environ,
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@e.invalid",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@e.invalid",
    )
    subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)


def test_a_checkouts_version_is_its_release_tag_or_its_version_file(
    vllm_ascend_tree: Path, series: Path, repo: Path, state_root: Path
) -> None:
    args = ("--target", vllm_ascend_tree, "--manifests", repo / "patches", "--state-dir", state_root)
    version_file = vllm_ascend_tree / "vllm_ascend" / "_version.py"
    version_file.write_text(f"__version__ = version = '{PROJECT.version}'\n")
    status = run_tool("status", *args)
    assert status.returncode == 0
    assert f"[checkout {PROJECT.version}]: not applied (patches/series)" in status.stdout
    version_file.unlink()

    _git(vllm_ascend_tree, "init", "-q")
    _git(vllm_ascend_tree, "add", "-A")
    _git(vllm_ascend_tree, "commit", "-qm", "release")
    _git(vllm_ascend_tree, "tag", f"v{PROJECT.version}")
    status = run_tool("status", *args)
    assert f"[checkout {PROJECT.version}]: not applied" in status.stdout
    (vllm_ascend_tree / "NEWS").write_text("later\n")
    _git(vllm_ascend_tree, "add", "-A")
    _git(vllm_ascend_tree, "commit", "-qm", "later")
    status = run_tool("status", *args)
    assert status.returncode == 0 and f"[checkout {PROJECT.version} +1 commits]" in status.stdout
    _git(vllm_ascend_tree, "tag", "v0.0.1")
    assert run_tool("status", *args).returncode == Status.NO_SERIES.code
    # Apply and revert work on the checkout, and leave nothing for `git add -A` to pick up.
    _git(vllm_ascend_tree, "tag", "-d", "v0.0.1")
    assert run_tool("apply", *args).returncode == 0
    assert run_tool("revert", *args).returncode == 0
    porcelain = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=vllm_ascend_tree, capture_output=True, text=True, check=True
    ).stdout
    assert porcelain == ""


# ------------------------------------------------------------------------ state directory
def test_backups_live_outside_the_target_one_directory_per_target_and_are_pruned(
    vllm_ascend_tree: Path, series: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_ASCEND_BALANCE_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    second = tmp_path / "second"
    shutil.copytree(vllm_ascend_tree, second)
    for tree in (vllm_ascend_tree, second):
        for command in ("apply", "revert") * 4:
            done = run_tool(command, "--target", tree, "--series", series, "--keep-backups", "3")
            assert done.returncode == 0, done.stderr
    targets = sorted((tmp_path / "xdg" / "vllm-ascend-balance").iterdir())
    assert len(targets) == 2
    assert {(t / "target").read_text().strip() for t in targets} == {str(vllm_ascend_tree), str(second)}
    for state in targets:
        names = [p.name for p in sorted((state / "backups").iterdir())]
        # The last three (among them the newest apply, whose originals `revert --force` needs).
        assert [n.split("-")[0] for n in names] == ["0006", "0007", "0008"], names
        assert names[1].endswith("-apply")


def test_a_state_directory_inside_the_target_or_its_work_tree_is_refused(vllm_ascend_tree: Path, series: Path) -> None:
    inside = run_tool(
        "apply", "--target", vllm_ascend_tree, "--series", series, "--state-dir", vllm_ascend_tree / "backups"
    )
    assert inside.returncode == 1 and "is inside" in only_line(inside.stderr)
    _git(vllm_ascend_tree.parent, "init", "-q")  # the target is somewhere in a work tree
    beside = run_tool(
        "apply",
        "--target",
        vllm_ascend_tree,
        "--series",
        series,
        "--state-dir",
        vllm_ascend_tree.parent / "state-in-work-tree",
    )
    assert beside.returncode == 1 and "is inside" in only_line(beside.stderr)
    assert not (vllm_ascend_tree / "backups").exists()


# ------------------------------------------------------------------ reinstall leaves orphans
def _wheel(tmp_path: Path, tree: Path, version: str) -> Path:
    """A wheel of vllm-ascend ``version`` holding the tree's files (what a reinstall writes)."""
    wheel = tmp_path / f"vllm_ascend-{version}-py3-none-any.whl"
    dist_info = f"vllm_ascend-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted(tree.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(tree).as_posix())
        archive.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n")
        archive.writestr(
            f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


def _pip_install(wheel: Path, root: Path) -> Path:
    """Installs the wheel under root (never into this environment); returns its site-packages."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    # --ignore-installed: write the files, never uninstall anything (this environment's own
    # vllm-ascend has the same name); over an earlier install it rewrites the wheel's files and
    # leaves any other file, which is what `pip install --force-reinstall` does in site-packages.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "--no-compile",
            "--disable-pip-version-check",
            "--root",
            str(root),
            str(wheel),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    (site,) = {p.parent for p in root.rglob("vllm_ascend-*.dist-info")}
    return site


@needs_release
def test_series_files_left_by_a_reinstall_are_reported_and_cleaned(
    vllm_ascend_tree: Path, series: Path, tmp_path: Path
) -> None:
    wheel = _wheel(tmp_path, vllm_ascend_tree, PROJECT.version)
    site = _pip_install(wheel, tmp_path / "root")
    args = ("--target", site, "--series", series)
    pristine = snapshot(site)
    assert run_tool("apply", *args).returncode == 0
    applied = snapshot(site)

    _pip_install(wheel, tmp_path / "root")  # the reinstall
    status = run_tool("status", *args)
    assert status.returncode == Status.PARTIAL.code
    assert "files the series adds are left over" in status.stdout
    assert "vllm_ascend/core/balance_example.py" in status.stdout
    assert "`revert` removes them" in status.stdout
    cleaned = run_tool("revert", *args)
    assert cleaned.returncode == 0, cleaned.stderr
    assert snapshot(site) == pristine
    assert run_tool("status", *args).returncode == 0

    # `apply` over the same leftovers completes the series instead.
    assert run_tool("apply", *args).returncode == 0
    _pip_install(wheel, tmp_path / "root")
    completed = run_tool("apply", *args)
    assert completed.returncode == 0 and "completed the series" in completed.stdout
    assert snapshot(site) == applied


# ----------------------------------------------------------------------------- failed writes
_libc = ctypes.CDLL(None, use_errno=True)


def _without_dac_override() -> None:
    """preexec_fn: as root, honour permission bits (drop CAP_DAC_OVERRIDE from this process)."""
    if os.geteuid() == 0 and _libc.prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, DAC_OVERRIDE
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_read_only_directory_fails_the_write_and_leaves_the_tree_as_it_was(
    vllm_ascend_tree: Path, series: Path, command: str
) -> None:
    args = ("--target", vllm_ascend_tree, "--series", series)
    if command == "revert":
        assert run_tool("apply", *args).returncode == 0
    before = snapshot(vllm_ascend_tree)
    # Apply writes __init__.py here last; revert deletes the new files of core/ first.
    read_only = vllm_ascend_tree / ("vllm_ascend/patch/platform" if command == "apply" else "vllm_ascend/core")
    read_only.chmod(0o555)
    try:
        failed = run_tool(command, *args, preexec_fn=_without_dac_override)
    finally:
        read_only.chmod(0o755)
    assert failed.returncode == 1
    assert "Permission denied" in failed.stderr and "rolled back" in failed.stderr
    assert snapshot(vllm_ascend_tree) == before
    assert run_tool("status", *args).returncode == 0


def test_a_write_failing_after_files_were_replaced_rolls_back(
    vllm_ascend_tree: Path, series: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The failure comes after some renames into the tree (a disk error, say)."""
    before = snapshot(vllm_ascend_tree)
    renames = []

    def fail_on_third_rename(what: str) -> None:
        if what.startswith("rename ") and str(vllm_ascend_tree) in what.split(" -> ")[-1]:
            renames.append(what)
            if len(renames) == 3:
                raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(patch_journal, "checkpoint", fail_on_third_rename)
    code = main(["apply", "--target", str(vllm_ascend_tree), "--series", str(series)])
    assert code == 1 and "injected I/O error" in capsys.readouterr().err
    assert len(renames) >= 3  # two files had been replaced when it failed
    assert snapshot(vllm_ascend_tree) == before


# ------------------------------------------------------------------------------- exit codes
def test_status_exit_codes(vllm_ascend_tree: Path, series: Path, repo: Path, tmp_path: Path) -> None:
    args = ("--target", vllm_ascend_tree, "--series", series)
    assert run_tool("status", *args).returncode == 0  # not applied
    assert run_tool("apply", *args).returncode == 0
    assert run_tool("status", *args).returncode == 0  # applied
    (vllm_ascend_tree / "tests/ut/core/helper.py").unlink()
    assert run_tool("status", *args).returncode == Status.PARTIAL.code
    (vllm_ascend_tree / INIT).write_text("# replaced\n")
    assert run_tool("status", *args).returncode == Status.MODIFIED.code
    assert run_tool("revert", *args, "--force").returncode == 0
    assert run_tool("status", *args).returncode == 0
    (vllm_ascend_tree / INIT).write_text("# replaced\n")
    assert run_tool("status", *args).returncode == Status.CONFLICT.code
    with_dist_info(vllm_ascend_tree, "0.0.1")
    assert run_tool("status", "--target", vllm_ascend_tree).returncode == Status.NO_SERIES.code
    (vllm_ascend_tree / "vllm_ascend_balance_scheduling-0.1.0.dist-info").mkdir()
    assert run_tool("status", *args).returncode == Status.PLUGIN.code
    # Status.INTERRUPTED (3) is asserted after kills in test_apply_atomic.py.
    assert run_tool("status", "--target", tmp_path).returncode == 1  # not a vllm-ascend tree
    assert {s.code for s in Status} == {0, 3, 4, 5, 6, 7, 8}
