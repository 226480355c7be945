"""Runs apply_patches.py as a user does (its own process) and looks at the trees it changes."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import apply_patches
from export_patches import REPO_ROOT

SCRIPTS = REPO_ROOT / "scripts"
TOOL = SCRIPTS / "apply_patches.py"
KILLER = Path(__file__).with_name("kill_at_step.py")


def run_tool(*args: str | Path, cwd: Path | None = None, preexec_fn=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], cwd=cwd, capture_output=True, text=True, preexec_fn=preexec_fn
    )


def call_tool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """apply_patches.main in this process (cheaper than run_tool; for the many follow-up runs
    of the kill trials, whose killed runs are processes of their own)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = apply_patches.main([str(arg) for arg in args])
    return subprocess.CompletedProcess(["apply_patches", *map(str, args)], code, out.getvalue(), err.getvalue())


def run_killed_at(step: int, log: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """apply_patches.py killed with SIGKILL at its ``step``-th filesystem step (0: never)."""
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS))
    return subprocess.run(
        [sys.executable, str(KILLER), str(step), str(log), *map(str, args)], capture_output=True, text=True, env=env
    )


def snapshot(root: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every file (content and permission bits) and directory (None) under root."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o7777) if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def with_dist_info(root: Path, version: str) -> Path:
    """Makes root look like a site-packages holding vllm-ascend ``version``."""
    for old in root.glob("vllm_ascend-*.dist-info"):
        shutil.rmtree(old)
    dist_info = root / f"vllm_ascend-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n")
    return root
