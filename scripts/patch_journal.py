"""Atomic, journaled change of a set of files in a directory tree (the engine of apply_patches).

Why: patching vllm-ascend in place must never leave it half-patched. A killed process (an OOM
killer, a closed terminal) or a write that fails midway must leave a tree that the next run puts
right by itself, and no original file may ever be lost. One transaction:

1. records everything before touching the tree, in the target's state directory (outside the
   tree): ``journal.partial/`` gets the content of every path before and after the change, and
   ``journal.json`` (paths, sha256 and mode of each side, directories absent on each side); it is
   then renamed to ``journal/``. A kill before that rename leaves the tree untouched;
2. stages every new content beside its target (``<file>.balance-tmp``; an empty one beside each
   file to delete), so a read-only directory or a full disk fails before any file changes;
3. renames each staged file over its target, or deletes the target: one atomic step per file;
4. marks itself done by renaming ``journal/`` to ``backups/<n>-<time>-<operation>/``.

A ``journal/`` found by a later run is an interrupted transaction. It holds both contents of every
path, and each path is compared by content, so it can be driven to either side from any point it
stopped at, and driving it again after another kill is just as safe. A failed write drives it back
at once. The caller holds :meth:`StateDir.lock` around all of this.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

TMP_SUFFIX = ".balance-tmp"
BEFORE, AFTER = "before", "after"

# Test hook: called before every change this module makes to a tree or a state directory, and
# halfway through every file it writes; the tests kill the process from it at a chosen step.
checkpoint: Callable[[str], None] | None = None


class JournalError(RuntimeError):
    """The transaction could not be completed nor rolled back; the journal is kept."""


def _step(what: str) -> None:
    if checkpoint is not None:
        checkpoint(what)


# ------------------------------------------------------------------ filesystem steps (checkpointed)
def _write(path: Path, data: bytes, mode: int) -> None:
    _step(f"write {path}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        half = len(data) // 2
        _write_all(fd, data[:half])
        _step(f"halfway through {path}")  # a kill here leaves a torn file: only ever a staged one
        _write_all(fd, data[half:])
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _rename(source: Path, dest: Path) -> None:
    _step(f"rename {source} -> {dest}")
    os.replace(source, dest)


def _unlink(path: Path) -> None:
    _step(f"unlink {path}")
    path.unlink()


def _mkdir(path: Path) -> None:
    _step(f"mkdir {path}")
    path.mkdir()


def _rmdir(path: Path) -> None:
    _step(f"rmdir {path}")
    path.rmdir()


def _rmtree(path: Path) -> None:
    _step(f"rmtree {path}")
    shutil.rmtree(path)


def _makedirs(path: Path) -> None:
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        _mkdir(directory)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _current(path: Path) -> tuple[str, int] | None:
    """(sha256, permission bits) of a regular file, None when absent."""
    if not path.is_file():
        return None
    return sha256(path.read_bytes()), path.stat().st_mode & 0o7777


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


# ------------------------------------------------------------------------------- transactions
@dataclass(frozen=True)
class Change:
    """One path of the tree: its content and mode before and after (None: absent)."""

    path: str
    before: bytes | None
    after: bytes | None
    mode_before: int | None = None
    mode_after: int | None = None


@dataclass(frozen=True)
class Pending:
    """An interrupted transaction, as its journal recorded it."""

    directory: Path
    record: dict

    @property
    def operation(self) -> str:
        return self.record["operation"]

    @property
    def applied_side(self) -> str:
        """The side on which the series is applied (AFTER for apply, BEFORE for revert)."""
        return self.record["applied_side"]

    def progress(self, root: Path) -> tuple[int, int]:
        """How many paths already hold their AFTER content, of how many."""
        done = sum(
            1
            for change in self.record["changes"]
            if _matches(_current(root / change["path"]), change, AFTER)
            and not _matches(_current(root / change["path"]), change, BEFORE)
        )
        changing = sum(
            1
            for change in self.record["changes"]
            if (change[BEFORE], change["mode_before"]) != (change[AFTER], change["mode_after"])
        )
        return done, changing


def _matches(current: tuple[str, int] | None, change: dict, side: str) -> bool:
    if change[side] is None:
        return current is None
    return current == (change[side], change[f"mode_{side}"])


class StateDir:
    """The state directory of one target: its lock, its journal and its last few backups."""

    def __init__(self, directory: Path, root: Path, keep: int = 5) -> None:
        self.directory = directory
        self.root = root
        self.keep = keep

    @property
    def journal(self) -> Path:
        return self.directory / "journal"

    @property
    def partial(self) -> Path:
        return self.directory / "journal.partial"

    @property
    def backups(self) -> Path:
        return self.directory / "backups"

    @contextlib.contextmanager
    def lock(self, shared: bool = False) -> Iterator[None]:
        """One operation per target at a time (released by the kernel when a process dies).

        ``shared``: only reading; creates nothing when the directory does not exist yet.
        """
        if shared and not self.directory.is_dir():
            yield
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        if not shared:
            (self.directory / "target").write_text(f"{self.root}\n")
        with open(self.directory / "lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield

    def pending(self) -> Pending | None:
        if not self.journal.is_dir():
            return None
        try:
            record = json.loads((self.journal / "journal.json").read_text())
        except (OSError, ValueError) as error:
            raise JournalError(f"the journal {self.journal} is unreadable ({error}); it was changed by hand") from None
        return Pending(self.journal, record)

    def backup_list(self) -> list[Path]:
        """Completed transactions, oldest first."""
        if not self.backups.is_dir():
            return []
        return sorted((p for p in self.backups.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("-", 1)[0]))

    def last_record(self, operation: str) -> tuple[Path, dict] | None:
        """The backup and journal of the newest completed transaction with this operation name."""
        for backup in reversed(self.backup_list()):
            if backup.name.endswith(f"-{operation}"):
                try:
                    return backup, json.loads((backup / "journal.json").read_text())
                except (OSError, ValueError):
                    continue
        return None

    def read_side(self, record_dir: Path, side: str, path: str) -> bytes:
        return (record_dir / side / path).read_bytes()

    # ------------------------------------------------------------------------------ running
    def run(
        self,
        operation: str,
        changes: list[Change],
        applied_side: str,
        absent_after: list[str] = (),
        meta: dict | None = None,
    ) -> Path:
        """Carry out the changes atomically; returns the backup directory (the finished journal).

        ``absent_after``: directories (relative) the change removes when they end up empty.
        Raises OSError (after rolling back: the tree is as before) when a write fails, and
        JournalError when even the rollback failed (the journal stays for the next run).
        """
        if self.journal.exists():
            raise JournalError(f"an interrupted transaction is pending in {self.journal}")
        if self.partial.exists():
            _rmtree(self.partial)  # an earlier run died before it touched the tree
        record = {
            "operation": operation,
            "root": str(self.root),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "applied_side": applied_side,
            "meta": meta or {},
            "changes": [],
            "absent_dirs": {BEFORE: self._absent_dirs(changes), AFTER: sorted(absent_after)},
        }
        _mkdir(self.partial)
        for change in changes:
            record["changes"].append(
                {
                    "path": change.path,
                    BEFORE: None if change.before is None else sha256(change.before),
                    AFTER: None if change.after is None else sha256(change.after),
                    "mode_before": change.mode_before,
                    "mode_after": change.mode_after,
                }
            )
            for side, content in ((BEFORE, change.before), (AFTER, change.after)):
                if content is not None:
                    _makedirs((self.partial / side / change.path).parent)
                    _write(self.partial / side / change.path, content, 0o644)
        _write(self.partial / "journal.json", json.dumps(record, indent=1).encode(), 0o644)
        _fsync_dir(self.partial)
        _rename(self.partial, self.journal)  # from here on, the transaction is recorded
        _fsync_dir(self.directory)
        pending = Pending(self.journal, record)
        try:
            self._converge(pending, AFTER)
        except OSError as error:
            try:
                self._converge(pending, BEFORE)
            except OSError as second:
                raise JournalError(f"{error}; rolling back failed too: {second}") from None
            self._finish(f"{operation}-rolled-back")
            raise
        return self._finish(operation)

    def recover(self, pending: Pending, side: str) -> tuple[Path, list[str]]:
        """Drive an interrupted transaction to one side; returns its backup and the paths that had
        changed since (their content is kept in the backup's ``found/``)."""
        found = self._save_foreign(pending)
        try:
            self._converge(pending, side)
        except OSError as error:
            raise JournalError(str(error)) from None
        how = "finished" if side == AFTER else "rolled-back"
        return self._finish(f"{pending.operation}-{how}"), found

    def _save_foreign(self, pending: Pending) -> list[str]:
        """Paths holding neither side's content (edited after the interruption): keep a copy."""
        found = []
        for change in pending.record["changes"]:
            current = _current(self.root / change["path"])
            if current is not None and not (_matches(current, change, BEFORE) or _matches(current, change, AFTER)):
                copy = pending.directory / "found" / change["path"]
                _makedirs(copy.parent)
                _write(copy, (self.root / change["path"]).read_bytes(), 0o644)
                found.append(change["path"])
        return found

    def _absent_dirs(self, changes: list[Change]) -> list[str]:
        absent = set()
        for change in changes:
            parent = (self.root / change.path).parent
            while parent != self.root and not parent.is_dir():
                absent.add(parent.relative_to(self.root).as_posix())
                parent = parent.parent
        return sorted(absent)

    def _converge(self, pending: Pending, side: str) -> None:
        """Make every journaled path hold its content of ``side``: stage all, then swap."""
        writes, deletes = [], []
        for change in pending.record["changes"]:
            if _matches(_current(self.root / change["path"]), change, side):
                continue
            (writes if change[side] is not None else deletes).append(change)
        for change in writes:
            target = self.root / change["path"]
            _makedirs(target.parent)
            _write(tmp_path(target), self.read_side(pending.directory, side, change["path"]), change[f"mode_{side}"])
        for change in deletes:
            # Proves the directory writable before anything of the tree changes.
            _write(tmp_path(self.root / change["path"]), b"", 0o600)
        for change in writes:
            target = self.root / change["path"]
            _rename(tmp_path(target), target)
        for change in deletes:
            _unlink(self.root / change["path"])
        for change in pending.record["changes"]:
            staged = tmp_path(self.root / change["path"])
            if staged.exists():
                _unlink(staged)
        for directory in sorted(pending.record["absent_dirs"][side], key=lambda d: -d.count("/")):
            path = self.root / directory
            if path.is_dir() and not any(path.iterdir()):
                _rmdir(path)

    def _finish(self, name: str) -> Path:
        existing = self.backup_list()
        number = int(existing[-1].name.split("-", 1)[0]) + 1 if existing else 1
        if not self.backups.is_dir():
            _mkdir(self.backups)
        dest = self.backups / f"{number:04d}-{time.strftime('%Y%m%d-%H%M%S')}-{name}"
        _rename(self.journal, dest)  # done: the journal becomes a backup
        self._prune()
        return dest

    def _prune(self) -> None:
        """Keep the last ``keep`` backups, and always the newest apply (revert reads it)."""
        backups = self.backup_list()
        applies = [b for b in backups if b.name.endswith("-apply")]
        keep = set(backups[-self.keep :]) | set(applies[-1:])
        for backup in backups:
            if backup not in keep:
                _rmtree(backup)
