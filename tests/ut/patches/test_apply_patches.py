"""apply_patches: dry run first, backup, idempotent, reversible, and a conflict names its hunk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from apply_patches import (
    BACKUP_DIR_NAME,
    ApplyError,
    State,
    Target,
    apply,
    default_series,
    find_target,
    main,
    revert,
    series_files,
    state,
)
from export_patches import REPO_ROOT
from release_manifest import INIT, NEW_FILES, PROJECT, REGISTER_CALL

DIST_INFO = f"vllm_ascend-{PROJECT.version}.dist-info"


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and BACKUP_DIR_NAME not in p.parts}


def test_apply_is_checked_backed_up_idempotent_and_reverts_exactly(
        vllm_ascend_tree: Path, series: Path) -> None:
    target, patches = find_target(vllm_ascend_tree, installed=False), series_files(series)
    original = snapshot(vllm_ascend_tree)
    assert state(target, patches) is State.NOT_APPLIED

    report = apply(target, patches, dry_run=True)
    assert report.startswith("dry run") and INIT in report
    assert snapshot(vllm_ascend_tree) == original

    report = apply(target, patches, dry_run=False)
    assert state(target, patches) is State.APPLIED
    patched = snapshot(vllm_ascend_tree)
    assert all(path in patched for path in NEW_FILES)
    assert REGISTER_CALL.encode() in patched[INIT]
    (backup,) = (vllm_ascend_tree / BACKUP_DIR_NAME).iterdir()
    assert str(backup) in report
    assert (backup / INIT).read_bytes() == original[INIT]
    assert set((backup / "ABSENT").read_text().split()) == set(NEW_FILES)

    assert "nothing to do" in apply(target, patches, dry_run=False)
    assert snapshot(vllm_ascend_tree) == patched

    revert(target, patches, dry_run=False)
    assert snapshot(vllm_ascend_tree) == original
    assert "nothing to revert" in revert(target, patches, dry_run=False)


def test_a_conflict_names_the_hunk_and_changes_nothing(vllm_ascend_tree: Path,
                                                       series: Path) -> None:
    init = vllm_ascend_tree / INIT
    init.write_text(init.read_text().replace("patch_balance_schedule  # noqa",
                                             "patch_balance_schedule  # noqa: edited"))
    before = snapshot(vllm_ascend_tree)
    target, patches = find_target(vllm_ascend_tree, installed=False), series_files(series)
    assert state(target, patches) is State.CONFLICT
    with pytest.raises(ApplyError) as error:
        apply(target, patches, dry_run=False)
    message = str(error.value)
    assert f"patch failed: {INIT}:" in message
    assert f"--- conflicting hunk in {INIT}" in message
    assert f"+{REGISTER_CALL}" in message
    assert snapshot(vllm_ascend_tree) == before
    assert not (vllm_ascend_tree / BACKUP_DIR_NAME).exists()


def test_revert_after_a_local_edit_is_refused_naming_the_hunk(vllm_ascend_tree: Path,
                                                              series: Path) -> None:
    target, patches = find_target(vllm_ascend_tree, installed=False), series_files(series)
    apply(target, patches, dry_run=False)
    init = vllm_ascend_tree / INIT
    init.write_text(init.read_text().replace(f"{REGISTER_CALL}\n", f"{REGISTER_CALL}  # edited\n"))
    with pytest.raises(ApplyError, match=f"conflicting hunk in {INIT}"):
        revert(target, patches, dry_run=False)


def test_an_installed_vllm_ascend_gets_only_the_package_part(vllm_ascend_tree: Path,
                                                             series: Path) -> None:
    (vllm_ascend_tree / DIST_INFO).mkdir()
    target = find_target(vllm_ascend_tree, installed=False)
    assert target.installed
    apply(target, series_files(series), dry_run=False)
    assert (vllm_ascend_tree / "vllm_ascend/core/balance_example.py").exists()
    assert not (vllm_ascend_tree / "tests").exists()


def test_the_plugin_installed_in_the_same_place_is_named(vllm_ascend_tree: Path,
                                                         series: Path) -> None:
    (vllm_ascend_tree / DIST_INFO).mkdir()
    (vllm_ascend_tree / "vllm_ascend/core/balance_example.py").write_text("# plugin's copy\n")
    with pytest.raises(ApplyError, match="pip uninstall vllm-ascend-balance-scheduling"):
        apply(Target(vllm_ascend_tree, True), series_files(series), dry_run=False)


def test_a_directory_without_vllm_ascend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ApplyError, match="not a vllm-ascend tree"):
        find_target(tmp_path, installed=False)


def test_cli_status_apply_status(vllm_ascend_tree: Path, series: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "apply_patches.py"),
                               *args, "--target", str(vllm_ascend_tree), "--series", str(series)],
                              capture_output=True, text=True)

    assert run("status").stdout.strip().endswith("[checkout]: not applied")
    assert run("apply").returncode == 0
    assert run("status").stdout.strip().endswith("[checkout]: applied")
    (vllm_ascend_tree / INIT).write_text("# replaced\n")
    failed = run("revert")
    assert failed.returncode == 1 and "cannot be reverted cleanly" in failed.stderr


def test_the_default_series_is_the_installed_releases(vllm_ascend_tree: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert default_series() == REPO_ROOT / PROJECT.output
    assert main(["status", "--target", str(vllm_ascend_tree)]) == 0
    # The project's real series: its __init__ hunk applies to the pristine file, the rest adds.
    assert capsys.readouterr().out.strip().endswith("[checkout]: not applied")
