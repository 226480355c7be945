"""export_patches: the manifest decides the series, the series is reproducible, --check catches drift."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from export_patches import (
    REPO_ROOT,
    ExportError,
    Manifest,
    PristineSource,
    check,
    generate,
    load_manifest,
    resolve,
)


def test_the_project_manifest_classifies_every_file_in_its_scope() -> None:
    """A new file under vllm_ascend/ or tests/ must be exported or excluded explicitly."""
    patches = resolve(load_manifest(), REPO_ROOT)
    targets = {path for patch in patches for path in patch.files}
    assert "vllm_ascend/core/balance_scheduler.py" in targets
    assert "vllm_ascend/patch/platform/patch_balance_schedule.py" in targets
    assert not any(path.startswith("tests/ut/patches/") for path in targets)


def test_files_map_to_vllm_ascend_paths_and_only_tests_are_rewritten(
        repo: Path, manifest: Manifest) -> None:
    feature, tests = resolve(manifest, repo)
    assert sorted(feature.files) == ["vllm_ascend/core/balance_example.py",
                                     "vllm_ascend/patch/platform/patch_balance_schedule.py"]
    # Sources are exported byte for byte: the docstring keeps the pip-install name.
    assert b"vllm_ascend_balance.patch_balance_schedule" in \
        feature.files["vllm_ascend/patch/platform/patch_balance_schedule.py"]
    assert sorted(tests.files) == ["tests/ut/core/helper.py", "tests/ut/core/test_example.py"]
    assert tests.files["tests/ut/core/test_example.py"].startswith(
        b"from vllm_ascend.patch.platform import patch_balance_schedule\n")


def test_an_unclassified_file_is_refused_by_name(repo: Path, manifest: Manifest) -> None:
    (repo / "tests/ut/sim").mkdir(parents=True)
    (repo / "tests/ut/sim/test_new.py").write_text("")
    with pytest.raises(ExportError, match=r"tests/ut/sim/test_new.py"):
        resolve(manifest, repo)


def test_two_files_mapping_to_one_target_are_refused(repo: Path, manifest: Manifest) -> None:
    (repo / "tests/ut/engine/helper.py").write_text("")
    with pytest.raises(ExportError, match="both map to tests/ut/core/helper.py"):
        resolve(manifest, repo)


def test_the_series_is_reproducible_and_git_formatted(
        repo: Path, manifest: Manifest, pristine: PristineSource, tmp_path: Path) -> None:
    patches = resolve(manifest, repo)
    first = generate(manifest, patches, pristine, tmp_path / "a")
    second = generate(manifest, patches, pristine, tmp_path / "b")
    assert first == second
    assert sorted(first) == ["0001-Feature-Example.patch", "0002-Test-Example-tests.patch"]
    text = first["0001-Feature-Example.patch"].decode()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH 1/2] [Feature] Example" in text
    assert "From: Test Author <test@example.invalid>" in text
    assert "\n-    import vllm_ascend.patch.platform.patch_balance_schedule  # noqa\n" in text
    assert "\n+    register()\n" in text
    # The blob ids are git's, so `git am -3` on a real checkout can fall back to a 3-way merge.
    pristine_init = pristine.read("vllm_ascend/patch/platform/__init__.py")
    assert pristine_init is not None
    blob = hashlib.sha1(b"blob %d\0" % len(pristine_init) + pristine_init).hexdigest()
    assert f"index {blob}.." in text


def test_check_passes_on_a_current_series(repo: Path, manifest: Manifest,
                                          pristine: PristineSource, series: Path) -> None:
    assert check(manifest, repo, pristine) == []


def test_check_names_the_stale_patch_and_file(repo: Path, manifest: Manifest,
                                              pristine: PristineSource, series: Path) -> None:
    (repo / "vllm_ascend/core/balance_example.py").write_text('"""Example."""\nVALUE = 2\n')
    problems = check(manifest, repo, pristine)
    assert "stale: patches/series/0001-Feature-Example.patch" in problems
    assert ("after git am, vllm_ascend/core/balance_example.py differs from "
            "vllm_ascend/core/balance_example.py") in problems


def test_check_reports_a_series_that_does_not_apply(repo: Path, manifest: Manifest,
                                                    pristine: PristineSource,
                                                    series: Path) -> None:
    patch = series / "0001-Feature-Example.patch"
    patch.write_text(patch.read_text().replace(
        " if envs.VLLM_ASCEND_BALANCE_SCHEDULING:", " if envs.SOMETHING_ELSE:"))
    problems = check(manifest, repo, pristine)
    assert any("does not apply" in p and "vllm_ascend/patch/platform/__init__.py" in p
               for p in problems), problems


def test_check_reports_missing_and_extra_patch_files(repo: Path, manifest: Manifest,
                                                     pristine: PristineSource,
                                                     series: Path) -> None:
    (series / "0002-Test-Example-tests.patch").rename(series / "0002-old-name.patch")
    problems = check(manifest, repo, pristine)
    assert "missing from patches/series: 0002-Test-Example-tests.patch" in problems
    assert "not produced by the manifest any more: patches/series/0002-old-name.patch" in problems


def test_an_edit_whose_anchor_moved_upstream_is_refused(
        repo: Path, pristine: PristineSource, tmp_path: Path) -> None:
    toml = repo / "patches" / "series.toml"
    toml.write_text(toml.read_text().replace("import vllm_ascend.patch.platform.patch_balance_"
                                             "schedule  # noqa", "import moved  # noqa", 1))
    manifest = load_manifest(toml)
    with pytest.raises(ExportError, match="occurs 0 times"):
        generate(manifest, resolve(manifest, repo), pristine, tmp_path / "gen")


def test_installed_pristine_source_ignores_files_other_distributions_added(
        pristine: PristineSource) -> None:
    # This project's pip install puts balance_scheduler.py into vllm_ascend/core; it is not
    # vllm-ascend's, so the pristine release has no such file.
    assert pristine.read("vllm_ascend/core/balance_scheduler.py") is None
    assert pristine.read("tests/ut/conftest.py") is None
    content = pristine.read("vllm_ascend/patch/platform/patch_balance_schedule.py")
    assert content is not None and b"class BalanceScheduler(Scheduler)" in content


def test_a_wheel_is_read_when_given(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm_ascend-0.18.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_ascend/patch/platform/__init__.py", "# from the wheel\n")
    source = PristineSource(load_manifest(), wheel=wheel)
    assert source.read("vllm_ascend/patch/platform/__init__.py") == b"# from the wheel\n"
    assert source.read("vllm_ascend/core/absent.py") is None
    assert source.origin == str(wheel)


def test_cli_check_exit_status(repo: Path, series: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "export_patches.py"),
                               "--root", str(repo), "--manifest",
                               str(repo / "patches" / "series.toml"), *args],
                              capture_output=True, text=True)

    current = run("--check")
    assert current.returncode == 0, current.stderr
    (repo / "scripts/helper.py").write_text("HELP = 2\n")
    stale = run("--check")
    assert stale.returncode == 1
    assert "stale: patches/series/0002-Test-Example-tests.patch" in stale.stderr
    assert run().returncode == 0  # regenerates
    assert run("--check").returncode == 0
