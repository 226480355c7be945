"""The patch-tool tests on a vllm-ascend they cannot use: skipped with the reason, never an abort.

A nested pytest session sees another installed vllm-ascend version: a dist-info earlier on
``sys.path`` (PYTHONPATH) than the real one, which is what importlib.metadata then reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from export_patches import REPO_ROOT
from release_manifest import PROJECT, has_post_releases, needs_release

HERE = Path(__file__).parent
# Both modules are collected (imports included); of their tests, those that need the installed
# release run (or skip), not the slow ones that work on this repository alone.
MODULES = ["test_apply_patches.py", "test_export_patches.py"]
SELECT = "not the_project_manifest_classifies and not the_project_tests_import"


def _pytest_seeing(version: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake-site"
    dist_info = fake / f"vllm_ascend-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    pytest_bin = Path(sys.executable).with_name("pytest")
    return subprocess.run(
        [
            str(pytest_bin),
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'nested'}",
            "-k",
            SELECT,
            *(str(HERE / m) for m in MODULES),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def test_a_version_without_a_manifest_skips_with_the_reason(tmp_path: Path) -> None:
    run = _pytest_seeing("0.0.1", tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "error" not in run.stdout.splitlines()[-1]
    assert "skipped" in run.stdout.splitlines()[-1] and "passed" in run.stdout.splitlines()[-1]
    assert (
        "no patch manifest for the installed vllm-ascend: no manifest matches the installed "
        "release (vllm-ascend 0.0.1)" in run.stdout
    )


@needs_release
@has_post_releases
def test_a_post_release_finds_its_manifest_and_skips_what_needs_the_exact_files(tmp_path: Path) -> None:
    run = _pytest_seeing(f"{PROJECT.version}.post1", tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "no patch manifest" not in run.stdout
    assert f"installed vllm-ascend {PROJECT.version}.post1 is not exactly {PROJECT.version}" in run.stdout
