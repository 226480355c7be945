#!/usr/bin/env python3
"""Applies, reverts or reports the balance-scheduling patch series on a vllm-ascend tree.

For users who prefer patching vllm-ascend over installing this project as a plugin. The target is
either a vllm-ascend source checkout (the whole series, tests included) or the site-packages
directory of an installed vllm-ascend (only the ``vllm_ascend/`` part: a wheel has no tests).

Every change is checked first with ``git apply --check`` (all patches at once, so nothing is
half-applied), the files it touches are copied to a backup directory, and applying an applied
series (or reverting a clean tree) changes nothing. When the series does not apply, the error
names the file and prints the hunk that conflicts.

    scripts/apply_patches.py status  [--target DIR | --installed]
    scripts/apply_patches.py apply   [--target DIR | --installed] [--dry-run]
    scripts/apply_patches.py revert  [--target DIR | --installed] [--dry-run]

Without ``--series`` it uses the series of the manifest (``patches/*.toml``) whose ``[base]
version`` is the installed vllm-ascend's.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from export_patches import REPO_ROOT, ExportError, load_manifest

BACKUP_DIR_NAME = ".vllm-ascend-balance-backup"


class ApplyError(RuntimeError):
    """A problem the user must resolve; printed without a traceback."""


class State(str, enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICT = "conflict (neither applies nor reverts cleanly)"


@dataclass(frozen=True)
class Target:
    root: Path
    installed: bool  # site-packages: only vllm_ascend/ paths of the series apply

    @property
    def include(self) -> list[str]:
        return ["--include=vllm_ascend/*"] if self.installed else []


def find_target(target: Path | None, installed: bool) -> Target:
    if installed:
        spec = importlib.util.find_spec("vllm_ascend")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ApplyError("vllm_ascend is not installed in this Python environment")
        return Target(Path(next(iter(spec.submodule_search_locations))).parent, True)
    if target is None:
        raise ApplyError("give --target DIR (a vllm-ascend checkout or site-packages) "
                         "or --installed")
    root = target.resolve()
    if not (root / "vllm_ascend").is_dir():
        raise ApplyError(f"{root} has no vllm_ascend/ directory: not a vllm-ascend tree")
    is_site = any(root.glob("vllm_ascend-*.dist-info"))
    return Target(root, is_site)


def default_series() -> Path:
    """The series cut against the installed vllm-ascend release (see export_patches)."""
    try:
        return REPO_ROOT / load_manifest().output
    except ExportError as error:
        raise ApplyError(f"{error}\nGive a series with --series.") from None


def series_files(series: Path) -> list[Path]:
    patches = sorted(series.glob("*.patch"))
    if not patches:
        raise ApplyError(f"no *.patch files in {series}")
    return patches


def _git_apply(target: Target, patches: list[Path], *flags: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # A site-packages inside some git work tree must not make git apply paths relative to that
    # repository (it would skip them as "outside the directory").
    env["GIT_CEILING_DIRECTORIES"] = str(target.root.parent)
    # Reversed, the series is undone last patch first.
    ordered = list(reversed(patches)) if "-R" in flags else patches
    cmd = ["git", "apply", *flags, *target.include, *map(str, ordered)]
    return subprocess.run(cmd, cwd=target.root, env=env, capture_output=True, text=True)


def touched_paths(target: Target, patches: list[Path]) -> list[str]:
    result = _git_apply(target, patches, "--numstat")
    if result.returncode != 0:
        raise ApplyError(f"cannot read the series: {result.stderr.strip()}")
    return sorted({line.split("\t", 2)[2] for line in result.stdout.splitlines() if line})


def state(target: Target, patches: list[Path]) -> State:
    if _git_apply(target, patches, "--check", "-R").returncode == 0:
        return State.APPLIED
    if _git_apply(target, patches, "--check").returncode == 0:
        return State.NOT_APPLIED
    return State.CONFLICT


def conflict_report(target: Target, patches: list[Path], reverse: bool) -> str:
    """git apply's complaint plus the text of each hunk it names."""
    flags = ("--check", "-R") if reverse else ("--check",)
    stderr = _git_apply(target, patches, *flags).stderr.strip()
    lines = [stderr]
    for path, line in re.findall(r"patch failed: (.+?):(\d+)", stderr):
        hunk = _find_hunk(patches, path, int(line), reverse)
        if hunk:
            lines.append(f"--- conflicting hunk in {path} (line {line}) ---\n{hunk}")
    for path in re.findall(r"error: (.+?): already exists in working directory", stderr):
        lines.append(f"{path} already exists in {target.root}"
                     + (" (is this project pip-installed there too? use the plugin or the "
                        "patches, not both: pip uninstall vllm-ascend-balance-scheduling)"
                        if target.installed else ""))
    return "\n".join(lines)


def _find_hunk(patches: list[Path], path: str, line: int, reverse: bool) -> str | None:
    """The hunk of ``path`` starting at ``line`` (old side, or new side when reversing)."""
    header = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")
    for patch in patches:
        hunks: list[tuple[int, list[str]]] = []
        current = None
        for text in patch.read_text().splitlines():
            if text.startswith("diff --git "):
                current = text.split(" b/", 1)[1]
            elif current == path and (match := header.match(text)):
                hunks.append((int(match.group(2 if reverse else 1)), [text]))
            elif current == path and hunks and not text.startswith(("--- ", "+++ ")):
                hunks[-1][1].append(text)
        for start, lines in hunks:
            if start == line:
                return "\n".join(lines)
    return None


def backup(target: Target, paths: list[str]) -> Path:
    """Copy the files the series touches (those that exist) to a new backup directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = target.root / BACKUP_DIR_NAME / stamp
    suffix = 0
    while dest.exists():
        suffix += 1
        dest = target.root / BACKUP_DIR_NAME / f"{stamp}-{suffix}"
    dest.mkdir(parents=True)
    absent = []
    for path in paths:
        source = target.root / path
        if source.exists():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / path)
        else:
            absent.append(path)
    (dest / "ABSENT").write_text("".join(f"{p}\n" for p in absent))
    return dest


def apply(target: Target, patches: list[Path], dry_run: bool) -> str:
    current = state(target, patches)
    if current is State.APPLIED:
        return f"already applied to {target.root}: nothing to do"
    if current is State.CONFLICT:
        raise ApplyError(f"the series does not apply to {target.root}:\n"
                         + conflict_report(target, patches, reverse=False))
    paths = touched_paths(target, patches)
    if dry_run:
        return f"dry run: the series applies cleanly to {target.root}; it would change:\n  " \
               + "\n  ".join(paths)
    saved = backup(target, paths)
    result = _git_apply(target, patches)
    if result.returncode != 0:  # checked above; only a concurrent change gets here
        raise ApplyError(f"git apply failed after a clean check: {result.stderr.strip()}; "
                         f"originals are in {saved}")
    return f"applied {len(patches)} patches to {target.root} ({len(paths)} files); " \
           f"originals backed up in {saved}"


def revert(target: Target, patches: list[Path], dry_run: bool) -> str:
    current = state(target, patches)
    if current is State.NOT_APPLIED:
        return f"not applied to {target.root}: nothing to revert"
    if current is State.CONFLICT:
        raise ApplyError(f"the series cannot be reverted cleanly from {target.root} (files "
                         f"changed since it was applied? backups: {target.root / BACKUP_DIR_NAME})"
                         ":\n" + conflict_report(target, patches, reverse=True))
    paths = touched_paths(target, patches)
    if dry_run:
        return f"dry run: the series reverts cleanly from {target.root}; it would change:\n  " \
               + "\n  ".join(paths)
    saved = backup(target, paths)
    result = _git_apply(target, patches, "-R")
    if result.returncode != 0:
        raise ApplyError(f"git apply -R failed after a clean check: {result.stderr.strip()}; "
                         f"the patched files are in {saved}")
    return f"reverted {len(patches)} patches from {target.root}; patched files backed up in " \
           f"{saved}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["apply", "revert", "status"])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", type=Path,
                       help="a vllm-ascend source checkout, or a site-packages directory")
    where.add_argument("--installed", action="store_true",
                       help="the vllm-ascend installed in this Python environment")
    parser.add_argument("--series", type=Path,
                        help="a directory of *.patch files (default: the series of the manifest "
                             "for the installed vllm-ascend release)")
    parser.add_argument("--dry-run", action="store_true", help="check only, change nothing")
    args = parser.parse_args(argv)
    try:
        target = find_target(args.target, args.installed)
        patches = series_files(args.series or default_series())
        if args.command == "status":
            kind = "installed vllm-ascend (vllm_ascend/ only)" if target.installed else "checkout"
            print(f"{target.root} [{kind}]: {state(target, patches).value}")
        elif args.command == "apply":
            print(apply(target, patches, args.dry_run))
        else:
            print(revert(target, patches, args.dry_run))
    except ApplyError as error:
        print(f"apply_patches: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
