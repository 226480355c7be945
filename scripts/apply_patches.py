#!/usr/bin/env python3
"""Applies, reverts or reports the balance-scheduling patch series on a vllm-ascend tree.

For users who prefer patching vllm-ascend over installing this project as a plugin. The target is
either a vllm-ascend source checkout (the whole series, tests included) or the site-packages
directory of an installed vllm-ascend (only the ``vllm_ascend/`` part: a wheel has no tests).

* The series is the one cut against the *target's* vllm-ascend version (its dist-info, else
  ``git describe``, else ``vllm_ascend/_version.py``); a post-release or local build of a release
  (``0.23.0.post1``) gets that release's series only if every file the series touches is identical
  to the release's (the series' ``index`` lines name each file's git blob).
* Changes are computed in a scratch copy with ``git apply``, then made by one journaled
  transaction (patch_journal.py): a killed run or a failed write never leaves the tree half
  patched; the next ``apply`` finishes an interrupted apply (or undoes an interrupted revert), the
  next ``revert`` undoes it, and ``revert`` is the one command that restores the release's files
  from any state this tool leaves (``revert --force`` also discards edits made after an apply).
* Journal and backups live in a state directory outside the target (one per target, keyed by its
  path; ``--state-dir`` or ``$VLLM_ASCEND_BALANCE_STATE_DIR``; default
  ``$XDG_STATE_HOME/vllm-ascend-balance``), pruned to the last few operations.

    scripts/apply_patches.py status  [--target DIR | --installed]
    scripts/apply_patches.py apply   [--target DIR | --installed] [--dry-run]
    scripts/apply_patches.py revert  [--target DIR | --installed] [--dry-run] [--force]

``status`` exits 0 only when the series is cleanly applied or cleanly absent (codes: --help).
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
from export_patches import PATCHES_DIR, base_release
from patch_journal import AFTER, BEFORE, Change, JournalError, Pending, StateDir, sha256

DISTRIBUTION = "vllm-ascend"
PLUGIN_DIST_INFO = "vllm_ascend_balance_scheduling-*.dist-info"
STATE_ENV = "VLLM_ASCEND_BALANCE_STATE_DIR"
ZERO_BLOB = re.compile(r"^0+$")


class ApplyError(RuntimeError):
    """A problem the user must resolve; printed without a traceback."""


class Status(enum.Enum):
    """What ``status`` reports, with its exit code (0 only for a clean state)."""

    APPLIED = ("applied", 0)
    NOT_APPLIED = ("not applied", 0)
    INTERRUPTED = ("interrupted", 3)
    PARTIAL = ("partly applied", 4)
    MODIFIED = ("modified after apply", 5)
    CONFLICT = ("does not apply", 6)
    NO_SERIES = ("no series for this version", 7)
    PLUGIN = ("the plugin is installed here too", 8)

    @property
    def code(self) -> int:
        return self.value[1]


EXIT_CODES = (
    "\n".join(f"  {s.code}  {s.value[0]}" for s in Status if s.code)
    + "\n  1  the command failed or refused (the message says why and what to run)"
)


# ------------------------------------------------------------------------------------ target
@dataclass(frozen=True)
class Target:
    root: Path
    installed: bool  # site-packages: only vllm_ascend/ paths of the series apply
    version: str | None
    version_source: str  # where the version was read, for messages
    commits_after_tag: int = 0  # a checkout ahead of its release tag

    @property
    def include(self) -> list[str]:
        return ["--include=vllm_ascend/*"] if self.installed else []

    @property
    def kind(self) -> str:
        ahead = f" +{self.commits_after_tag} commits" if self.commits_after_tag else ""
        return f"{'installed vllm-ascend' if self.installed else 'checkout'} {self.version or 'version unknown'}{ahead}"

    def wanted(self, path: str) -> bool:
        return not self.installed or path.startswith("vllm_ascend/")


def find_target(target: Path | None, installed: bool) -> Target:
    if installed:
        spec = importlib.util.find_spec("vllm_ascend")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ApplyError("vllm_ascend is not installed in this Python environment")
        root = Path(next(iter(spec.submodule_search_locations))).parent.resolve()
    elif target is None:
        raise ApplyError("give --target DIR (a vllm-ascend checkout or site-packages) or --installed")
    else:
        root = target.resolve()  # relative to the current directory
    if not (root / "vllm_ascend").is_dir():
        raise ApplyError(f"{root} has no vllm_ascend/ directory: not a vllm-ascend tree")
    dist_infos = sorted(root.glob("vllm_ascend-*.dist-info"))
    if dist_infos:
        if len(dist_infos) > 1:
            raise ApplyError(
                f"{root} holds several vllm-ascend installs ("
                + ", ".join(p.name for p in dist_infos)
                + "): reinstall vllm-ascend"
            )
        return Target(root, True, _dist_info_version(dist_infos[0]), dist_infos[0].name)
    return _checkout(root)


def _dist_info_version(dist_info: Path) -> str | None:
    try:
        text = (dist_info / "METADATA").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"^Version:\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else None


def _checkout(root: Path) -> Target:
    """A checkout's version: its release tag (``git describe``), else its ``_version.py``."""
    if (root / ".git").exists():
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
        described = subprocess.run(
            ["git", "describe", "--tags", "--match", "v[0-9]*"], cwd=root, env=env, capture_output=True, text=True
        )
        match = re.fullmatch(r"v(\S+?)(?:-(\d+)-g[0-9a-f]+)?", described.stdout.strip())
        if described.returncode == 0 and match:
            return Target(
                root, False, match.group(1), f"git describe {described.stdout.strip()}", int(match.group(2) or 0)
            )
    version_file = root / "vllm_ascend" / "_version.py"
    if version_file.is_file():
        match = re.search(
            r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
            version_file.read_text(errors="replace"),
            re.MULTILINE,
        )
        if match:
            return Target(root, False, match.group(1), "vllm_ascend/_version.py")
    return Target(root, False, None, "version unknown")


def plugin_dist_info(target: Target) -> Path | None:
    """This project's pip install in the same site-packages (the plugin and the patches clash)."""
    found = sorted(target.root.glob(PLUGIN_DIST_INFO)) if target.installed else []
    return found[0] if found else None


# ------------------------------------------------------------------------------------ series
@dataclass(frozen=True)
class Series:
    directory: Path
    release: str | None  # the vllm-ascend release it was cut against (None: not a manifest's)
    patches: tuple[Path, ...]
    # path -> (git blob before the series, after it); None: the file does not exist on that side
    blobs: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.directory.parent.name}/{self.directory.name}"


def available_series(manifests: Path) -> dict[str, Path]:
    """release -> series directory, for every manifest in ``manifests``."""
    found = {}
    for path in sorted(manifests.glob("*.toml")):
        base = tomllib.loads(path.read_text()).get("base", {})
        if base.get("distribution") == DISTRIBUTION and "version" in base and "output" in base:
            found[base["version"]] = (manifests.parent / base["output"]).resolve()
    return found


def _listing(available: dict[str, Path]) -> str:
    return ", ".join(sorted(available)) or "none"


def load_series(directory: Path, release: str | None) -> Series:
    patches = tuple(sorted(directory.glob("*.patch")))
    if not patches:
        raise ApplyError(f"no *.patch files in {directory}")
    blobs: dict[str, tuple[str | None, str | None]] = {}
    for patch in patches:
        path = None
        for line in patch.read_text(errors="replace").splitlines():
            if line.startswith("diff --git "):
                path = line.split(" b/", 1)[1]
            elif path and (match := re.match(r"index ([0-9a-f]+)\.\.([0-9a-f]+)", line)):
                old, new = (None if ZERO_BLOB.match(b) else b for b in match.groups())
                blobs[path] = (blobs[path][0] if path in blobs else old, new)
                path = None
    return Series(directory, release, patches, blobs)


def select_series(target: Target, manifests: Path, explicit: Path | None) -> tuple[Series, str]:
    """The series for the target's version, and a note when it was chosen for a follow-up build.

    Raises ApplyError (one line naming both versions and the series that exist) on a mismatch.
    """
    available = available_series(manifests)
    by_directory = {directory: release for release, directory in available.items()}
    where = f"{target.root} ({target.version_source})"
    if explicit is not None:
        directory = explicit.resolve()  # relative to the current directory
        release = by_directory.get(directory)
        if release is None:  # a series no manifest names: its version is the user's business
            return load_series(directory, None), ""
        if target.version is not None and release not in (target.version, base_release(target.version)):
            raise ApplyError(
                f"{directory} is the series for vllm-ascend {release}, but {where} "
                f"is vllm-ascend {target.version} (series exist for "
                f"{_listing(available)}; without --series the target's is used)"
            )
    elif target.version is None:
        raise ApplyError(
            f"cannot tell the vllm-ascend version of {where}: no dist-info, no "
            f"release tag, no vllm_ascend/_version.py; give --series (series exist "
            f"for {_listing(available)})"
        )
    else:
        release = next((r for r in (target.version, base_release(target.version)) if r in available), None)
        if release is None:
            raise ApplyError(
                f"no series for vllm-ascend {target.version} at {where} (series exist for {_listing(available)})"
            )
        directory = available[release]
    series = load_series(directory, release)
    if target.version is None or target.version == release or target.commits_after_tag:
        return series, ""
    # A post-release or local build: usable only where it is the release, file for file.
    differing = [
        path
        for path, (old, new) in sorted(series.blobs.items())
        if target.wanted(path) and not any(_same_blob(target.root / path, blob) for blob in (old, new))
    ]
    if differing:
        raise ApplyError(
            f"vllm-ascend {target.version} at {where} differs from {release} in "
            f"{', '.join(differing)}: the {release} series is not for it (series "
            f"exist for {_listing(available)})"
        )
    return series, (
        f"vllm-ascend {target.version} uses the {release} series: every file it touches is identical to {release}'s"
    )


def _same_blob(path: Path, expected: str | None) -> bool:
    """Whether path holds the git blob ``expected`` (maybe abbreviated); None: path is absent."""
    if not path.is_file():
        return expected is None
    data = path.read_bytes()
    actual = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return expected is not None and actual.startswith(expected)


# ------------------------------------------------------------------------------ git apply
def _git_apply(
    root: Path, patches: tuple[Path, ...], *flags: str, include: list[str]
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # A site-packages inside some git work tree must not make git apply paths relative to that
    # repository (it would skip them as "outside the directory").
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    # Reversed, the series is undone last patch first.
    ordered = list(reversed(patches)) if "-R" in flags else list(patches)
    cmd = ["git", "apply", *flags, *include, *map(str, ordered)]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)


def _includes(target: Target, paths: list[str] | None) -> list[str]:
    return target.include if paths is None else [f"--include={p}" for p in paths]


def touched_paths(target: Target, series: Series) -> list[str]:
    result = _git_apply(target.root, series.patches, "--numstat", include=target.include)
    if result.returncode != 0:
        raise ApplyError(f"cannot read the series: {result.stderr.strip()}")
    return sorted({line.split("\t", 2)[2] for line in result.stdout.splitlines() if line})


def applies(target: Target, series: Series, reverse: bool, paths: list[str] | None = None) -> bool:
    flags = ("--check", "-R") if reverse else ("--check",)
    return _git_apply(target.root, series.patches, *flags, include=_includes(target, paths)).returncode == 0


def plan(target: Target, series: Series, reverse: bool, paths: list[str]) -> list[Change]:
    """What applying (or reverting) the series to ``paths`` changes, computed in a scratch copy."""
    changes = []
    with tempfile.TemporaryDirectory(prefix="apply-patches-") as tmp:
        scratch = Path(tmp) / "tree"
        for path in paths:
            source = target.root / path
            if source.is_file():
                (scratch / path).parent.mkdir(parents=True, exist_ok=True)
                (scratch / path).write_bytes(source.read_bytes())
                (scratch / path).chmod(source.stat().st_mode & 0o7777)
        scratch.mkdir(exist_ok=True)
        flags = ("-R",) if reverse else ()
        result = _git_apply(scratch, series.patches, *flags, include=_includes(target, paths))
        if result.returncode != 0:  # checked on the tree just before: it changed meanwhile
            raise ApplyError(f"the tree changed while checking it: {result.stderr.strip()}")
        for path in paths:
            before, after = _file(target.root / path), _file(scratch / path)
            if before != after:
                changes.append(
                    Change(
                        path,
                        before[0] if before else None,
                        after[0] if after else None,
                        before[1] if before else None,
                        after[1] if after else None,
                    )
                )
    return changes


def _file(path: Path) -> tuple[bytes, int] | None:
    return (path.read_bytes(), path.stat().st_mode & 0o7777) if path.is_file() else None


def conflict_report(target: Target, series: Series, reverse: bool) -> str:
    """git apply's complaint plus the text of each hunk it names."""
    flags = ("--check", "-R") if reverse else ("--check",)
    stderr = _git_apply(target.root, series.patches, *flags, include=target.include).stderr.strip()
    lines = [stderr]
    for path, line in re.findall(r"patch failed: (.+?):(\d+)", stderr):
        hunk = _find_hunk(series.patches, path, int(line), reverse)
        if hunk:
            lines.append(f"--- conflicting hunk in {path} (line {line}) ---\n{hunk}")
    return "\n".join(lines)


def _find_hunk(patches: tuple[Path, ...], path: str, line: int, reverse: bool) -> str | None:
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


# ------------------------------------------------------------------------------------ state
@dataclass
class Inspection:
    status: Status
    summary: str
    way_out: str = ""
    pristine: list[str] = field(default_factory=list)  # paths the series would still change
    applied: list[str] = field(default_factory=list)  # paths holding the series' version
    bad: list[str] = field(default_factory=list)  # paths that neither apply nor revert


def inspect(target: Target, series: Series, state: StateDir) -> Inspection:
    """Where the target stands with the series (no interrupted operation pending)."""
    if applies(target, series, reverse=True):
        edited = _edited_since_apply(target, series, state)
        if edited:
            return Inspection(
                Status.MODIFIED,
                f"applied, then edited: {', '.join(edited)}",
                "`revert` keeps these edits (they are outside the series' hunks)",
                applied=touched_paths(target, series),
            )
        return Inspection(Status.APPLIED, f"applied ({series.name})", applied=touched_paths(target, series))
    if applies(target, series, reverse=False):
        return Inspection(Status.NOT_APPLIED, f"not applied ({series.name})", pristine=touched_paths(target, series))
    found = Inspection(Status.CONFLICT, "")
    for path in touched_paths(target, series):
        if applies(target, series, reverse=False, paths=[path]):
            found.pristine.append(path)
        elif applies(target, series, reverse=True, paths=[path]):
            found.applied.append(path)
        else:
            found.bad.append(path)
    if not found.bad:
        created = [p for p in found.applied if series.blobs.get(p, (None, None))[0] is None]
        if created == found.applied:
            found.summary = (
                "files the series adds are left over (e.g. by pip install "
                f"--force-reinstall vllm-ascend): {', '.join(found.applied)}"
            )
        else:
            found.summary = f"partly applied: {', '.join(found.applied)} applied, {', '.join(found.pristine)} not"
        found.status = Status.PARTIAL
        found.way_out = "`revert` removes them, `apply` completes the series"
    elif found.applied:
        found.status = Status.MODIFIED
        found.summary = f"applied, then edited so that it no longer reverts: {', '.join(found.bad)}"
        found.way_out = (
            "`revert --force` restores the release's files from the backup of the "
            "apply (your edited files are kept in a new backup)"
        )
    else:
        found.summary = f"not applied, and differing from what {series.name} expects: {', '.join(found.bad)}"
        found.way_out = (
            "the series does not apply: restore these files to vllm-ascend "
            f"{series.release or 'the release'}'s (`apply` prints the conflicting "
            "hunks)"
        )
    return found


def _edited_since_apply(target: Target, series: Series, state: StateDir) -> list[str]:
    """Files that differ from what this tool's last apply of this series wrote."""
    last = state.last_record("apply")
    if last is None or last[1].get("meta", {}).get("series") != str(series.directory):
        return []
    edited = []
    for change in last[1]["changes"]:
        current = _file(target.root / change["path"])
        if change[AFTER] is not None and (current is None or sha256(current[0]) != change[AFTER]):
            edited.append(change["path"])
    return edited


def interrupted_summary(pending: Pending, target: Target) -> tuple[str, str]:
    done, total = pending.progress(target.root)
    operation = pending.operation
    finish = "apply" if pending.applied_side == AFTER else "revert"
    undo = "revert" if finish == "apply" else "apply"
    return (
        f"interrupted {operation} ({done} of {total} files changed, started {pending.record['started']})",
        f"`{finish}` finishes it, `{undo}` rolls it back",
    )


def recover(state: StateDir, target: Target, applied: bool, dry_run: bool) -> str:
    """Finish or roll back an interrupted operation so the series ends applied or not; says so
    at once (whatever the command does next)."""
    pending = state.pending()
    if pending is None:
        return ""
    side = pending.applied_side if applied else (BEFORE if pending.applied_side == AFTER else AFTER)
    how = "finished" if side == AFTER else "rolled back"
    summary = interrupted_summary(pending, target)[0]
    if dry_run:
        return f"dry run: found an {summary}; it would be {how} first\n"
    try:
        backup, found = state.recover(pending, side)
    except JournalError as error:
        verb = "finish" if side == AFTER else "roll back"
        raise ApplyError(
            f"found an {summary} and could not {verb} it: {error}; fix the cause and run this command again"
        ) from None
    print(f"found an {summary}: {how} it (journal kept in {backup})", flush=True)
    for path in found:
        print(f"{path} had changed since; that version is kept in {backup / 'found' / path}", flush=True)
    return ""


# ---------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Context:
    target: Target
    state: StateDir
    manifests: Path
    series_arg: Path | None


def refuse_plugin(target: Target) -> None:
    plugin = plugin_dist_info(target)
    if plugin is not None:
        raise ApplyError(
            f"this project is pip-installed in {target.root} too ({plugin.name}): use "
            f"the plugin or the patches, not both: pip uninstall "
            f"vllm-ascend-balance-scheduling"
        )


def _run(
    ctx: Context, operation: str, changes: list[Change], applied_side: str, absent_after: list[str], series: Series
) -> Path:
    meta = {"series": str(series.directory), "version": ctx.target.version}
    try:
        return ctx.state.run(operation, changes, applied_side, absent_after, meta)
    except JournalError as error:
        raise ApplyError(
            f"{operation} failed: {error}. The journal in {ctx.state.directory} "
            f"keeps every original; fix the cause and run `revert`"
        ) from None
    except OSError as error:
        raise ApplyError(f"{operation} failed: {error}; rolled back, {ctx.target.root} is as it was") from None


def apply(ctx: Context, dry_run: bool) -> str:
    target = ctx.target
    refuse_plugin(target)
    message = recover(ctx.state, target, applied=True, dry_run=dry_run)
    if dry_run and message:
        return message.rstrip()
    series, note = select_series(target, ctx.manifests, ctx.series_arg)
    message += f"{note}\n" if note else ""
    found = inspect(target, series, ctx.state)
    if found.status in (Status.APPLIED, Status.MODIFIED) and not found.bad:
        return message + f"already applied to {target.root}: nothing to do"
    if found.status is Status.MODIFIED:
        raise ApplyError(f"{found.summary}; {found.way_out}")
    if found.status is Status.CONFLICT:
        if target.commits_after_tag:
            message += (
                f"note: {target.root} is {target.commits_after_tag} commits after "
                f"v{target.version}, the tag the series was cut against\n"
            )
        raise ApplyError(
            message + f"the series does not apply to {target.root}:\n" + conflict_report(target, series, reverse=False)
        )
    if dry_run:
        return (
            message + f"dry run: the series applies cleanly to {target.root}; it would "
            "change:\n  " + "\n  ".join(found.pristine)
        )
    changes = plan(target, series, reverse=False, paths=found.pristine)
    backup = _run(ctx, "apply", changes, AFTER, [], series)
    done = f"applied {len(series.patches)} patches to {target.root} ({len(changes)} files)"
    if found.applied:
        done = (
            f"completed the series on {target.root} ({len(changes)} files; already there: {', '.join(found.applied)})"
        )
    return message + f"{done}; originals backed up in {backup}"


def revert(ctx: Context, dry_run: bool, force: bool) -> str:
    target = ctx.target
    refuse_plugin(target)
    message = recover(ctx.state, target, applied=False, dry_run=dry_run)
    if dry_run and message:
        return message.rstrip()
    series, note = select_series(target, ctx.manifests, ctx.series_arg)
    message += f"{note}\n" if note else ""
    found = inspect(target, series, ctx.state)
    if found.status is Status.NOT_APPLIED:
        return message + f"not applied to {target.root}: nothing to revert"
    if found.status is Status.CONFLICT:
        raise ApplyError(f"nothing to revert: the series is not applied to {target.root}, and {found.summary}")
    last_apply = ctx.state.last_record("apply")
    if last_apply and last_apply[1]["meta"].get("series") != str(series.directory):
        last_apply = None  # an apply of another series: its originals are not this release's
    if found.bad:  # modified after apply so that it no longer reverts
        if not force:
            raise ApplyError(
                f"the series cannot be reverted cleanly from {target.root}: "
                f"{found.summary}; {found.way_out}:\n" + conflict_report(target, series, reverse=True)
            )
        if last_apply is None:
            raise ApplyError(
                f"{found.summary}, and {ctx.state.directory} has no backup of an "
                "apply to restore from: reinstall vllm-ascend (pip install "
                "--force-reinstall --no-deps vllm-ascend==VERSION) or check the "
                "files out of git, then run `revert` again"
            )
        changes = _restore_plan(target, *last_apply)
        summary = f"restored {len(changes)} files of {target.root} from {last_apply[0]}"
    else:
        paths = found.applied
        if dry_run:
            return (
                message + f"dry run: the series reverts cleanly from {target.root}; it "
                "would change:\n  " + "\n  ".join(paths)
            )
        changes = plan(target, series, reverse=True, paths=paths)
        summary = (
            f"reverted {len(series.patches)} patches from {target.root}"
            if found.status is not Status.PARTIAL
            else f"reverted what was left of the series in {target.root} ({', '.join(paths)})"
        )
    if dry_run:
        return message + f"dry run: would restore from {last_apply[0]}:\n  " + "\n  ".join(c.path for c in changes)
    created = last_apply[1]["absent_dirs"][BEFORE] if last_apply else []
    backup = _run(ctx, "revert", changes, BEFORE, created, series)
    return message + f"{summary}; the files as they were are backed up in {backup}"


def _restore_plan(target: Target, backup: Path, record: dict) -> list[Change]:
    """Every file of an apply's record back to its content before that apply."""
    changes = []
    for change in record["changes"]:
        current = _file(target.root / change["path"])
        original = (backup / BEFORE / change["path"]).read_bytes() if change[BEFORE] else None
        if (current and current[0]) != original:
            changes.append(
                Change(
                    change["path"],
                    current[0] if current else None,
                    original,
                    current[1] if current else None,
                    change["mode_before"],
                )
            )
    return changes


def status(ctx: Context) -> Inspection:
    target = ctx.target
    if plugin_dist_info(target) is not None:
        return Inspection(
            Status.PLUGIN,
            f"{plugin_dist_info(target).name} is here too",
            "use the plugin or the patches, not both: pip uninstall vllm-ascend-balance-scheduling, then `apply`",
        )
    pending = ctx.state.pending()
    if pending is not None:
        return Inspection(Status.INTERRUPTED, *interrupted_summary(pending, target))
    try:
        series, note = select_series(target, ctx.manifests, ctx.series_arg)
    except ApplyError as error:
        return Inspection(
            Status.NO_SERIES,
            str(error),
            "patch a vllm-ascend release that has a series, or install this project as a plugin instead",
        )
    found = inspect(target, series, ctx.state)
    if note and found.status.code == 0:
        found.summary += f"; {note}"
    return found


# -------------------------------------------------------------------------------- state dir
def state_for(target: Target, state_root: Path | None, keep: int) -> StateDir:
    """The target's own state directory: outside the target and outside its git work tree."""
    if state_root is None:
        configured = os.environ.get(STATE_ENV)
        xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        state_root = Path(configured) if configured else Path(xdg) / "vllm-ascend-balance"
    state_root = state_root.resolve()
    for outer in filter(None, (target.root, _work_tree(target.root))):
        if state_root == outer or outer in state_root.parents:
            raise ApplyError(
                f"the state directory {state_root} is inside {outer}: backups would "
                f"end up in the tree; choose another with --state-dir or ${STATE_ENV}"
            )
    key = hashlib.sha256(str(target.root).encode()).hexdigest()[:12]
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(target.root.parts[1:][-3:]))[-60:]
    return StateDir(state_root / f"{label}-{key}", target.root, keep)


def _work_tree(root: Path) -> Path | None:
    result = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    return Path(result.stdout.strip()).resolve() if result.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"status exit codes (0: applied or not applied, cleanly):\n{EXIT_CODES}",
    )
    parser.add_argument("command", choices=["apply", "revert", "status"])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", type=Path, help="a vllm-ascend source checkout, or a site-packages directory")
    where.add_argument("--installed", action="store_true", help="the vllm-ascend installed in this Python environment")
    parser.add_argument(
        "--series",
        type=Path,
        help="a directory of *.patch files (default: the series for the target's vllm-ascend version)",
    )
    parser.add_argument(
        "--manifests", type=Path, default=PATCHES_DIR, help="where the series' manifests are (default: %(default)s)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help=f"where journals and backups go (default: ${STATE_ENV}, else "
        "$XDG_STATE_HOME/vllm-ascend-balance); one subdirectory per target",
    )
    parser.add_argument(
        "--keep-backups", type=int, default=5, metavar="N", help="backups kept per target (default: %(default)s)"
    )
    parser.add_argument("--dry-run", action="store_true", help="check only, change nothing")
    parser.add_argument(
        "--force",
        action="store_true",
        help="revert: restore the release's files even where they were edited "
        "after the apply (the edited files are backed up first)",
    )
    args = parser.parse_args(argv)
    if args.force and args.command != "revert":
        parser.error("--force is an option of revert")
    if args.keep_backups < 1:
        parser.error("--keep-backups must be at least 1")
    try:
        target = find_target(args.target, args.installed)
        ctx = Context(
            target, state_for(target, args.state_dir, args.keep_backups), args.manifests.resolve(), args.series
        )
        if args.command == "status":
            with ctx.state.lock(shared=True):
                found = status(ctx)
            print(f"{target.root} [{target.kind}]: {found.summary}")
            if found.way_out:
                print(f"  next: {found.way_out}")
            return found.status.code
        with ctx.state.lock(shared=args.dry_run):  # a dry run creates nothing
            if args.command == "apply":
                print(apply(ctx, args.dry_run))
            else:
                print(revert(ctx, args.dry_run, args.force))
    except (ApplyError, JournalError) as error:
        print(f"apply_patches: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
