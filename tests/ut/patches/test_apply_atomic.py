"""apply_patches under SIGKILL: killed at steps spread over an apply and over a revert.

Each trial is a real process that kills itself (kill_at_step.py) at a chosen step, on a real tree
with the real ``git apply``; then (in this process, to keep the trials cheap) ``status`` must say
where things stand without changing anything, ``revert`` must give back the pristine tree byte
for byte (files, permission bits and directories), and ``apply`` must give the fully applied
tree. The steps are counted by running
the operation once unkilled; the trials are spread evenly over them (every step with
``BALANCE_KILL_TRIALS=all``), so they follow the series however it grows.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from apply_patches import Status
from tool_runner import call_tool, run_killed_at, snapshot

Tree = dict[str, tuple[bytes, int] | None]
TRIALS = os.environ.get("BALANCE_KILL_TRIALS", "32")  # per operation; "all": every step


class Bench:
    """One target path and its state directory, reset to a saved pristine or applied copy."""

    def __init__(self, tree: Path, series: Path, state_root: Path, work: Path) -> None:
        self.tree, self.series, self.state_root, self.work = tree, series, state_root, work
        self.args = ("--target", tree, "--series", series)
        self.pristine = snapshot(tree)
        self._save("pristine")
        done = call_tool("apply", *self.args)
        assert done.returncode == 0, done.stderr
        self.applied = snapshot(tree)
        self._save("applied")

    def _save(self, name: str) -> None:
        shutil.copytree(self.tree, self.work / name / "tree", symlinks=True)
        if self.state_root.exists():
            shutil.copytree(self.state_root, self.work / name / "state", symlinks=True)

    def reset(self, name: str) -> None:
        for path, saved in ((self.tree, "tree"), (self.state_root, "state")):
            if path.exists():
                shutil.rmtree(path)
            if (self.work / name / saved).exists():
                shutil.copytree(self.work / name / saved, path, symlinks=True)

    def steps(self, command: str) -> list[str]:
        log = self.work / f"steps-{command}.log"
        self.reset("pristine" if command == "apply" else "applied")
        done = run_killed_at(0, log, command, *self.args)
        assert done.returncode == 0, done.stderr
        return [line.split("\t", 1)[1] for line in log.read_text().splitlines()]

    def journal_pending(self) -> bool:
        return any(self.state_root.glob("*/journal"))


@pytest.fixture
def bench(vllm_ascend_tree: Path, series: Path, state_root: Path, tmp_path: Path) -> Bench:
    (tmp_path / "saved").mkdir()
    return Bench(vllm_ascend_tree, series, state_root, tmp_path / "saved")


def _trial(bench: Bench, command: str, step: int) -> tuple[list[str], bool]:
    """Kill ``command`` at ``step``; then status, revert, apply. Returns what went wrong, and
    whether the kill left an unfinished transaction."""
    problems = []
    bench.reset("pristine" if command == "apply" else "applied")
    killed = run_killed_at(step, bench.work / "trial.log", command, *bench.args)
    if killed.returncode != -signal.SIGKILL:
        return [f"not killed (exit {killed.returncode}): {killed.stderr.strip()}"], False
    before_status = snapshot(bench.tree)
    status = call_tool("status", *bench.args)
    pending = bench.journal_pending()
    if status.returncode != (Status.INTERRUPTED.code if pending else 0):
        problems.append(f"status exit {status.returncode} (journal pending: {pending}): {status.stdout.strip()}")
    if (
        pending
        and "`apply` finishes it" not in status.stdout + status.stderr
        and "`revert` finishes it" not in status.stdout + status.stderr
    ):
        problems.append(f"status does not say what the next command does: {status.stdout}")
    if snapshot(bench.tree) != before_status:
        problems.append("status changed the tree")
    reverted = call_tool("revert", *bench.args)
    if reverted.returncode != 0 or snapshot(bench.tree) != bench.pristine:
        problems.append(
            f"revert did not restore the pristine tree (exit {reverted.returncode}): "
            f"{_diff(bench.pristine, snapshot(bench.tree))} {reverted.stderr.strip()}"
        )
    if pending and "found an" not in reverted.stdout:
        problems.append(f"revert did not say it recovered: {reverted.stdout.strip()}")
    applied = call_tool("apply", *bench.args)
    if applied.returncode != 0 or snapshot(bench.tree) != bench.applied:
        problems.append(
            f"apply did not complete (exit {applied.returncode}): "
            f"{_diff(bench.applied, snapshot(bench.tree))} {applied.stderr.strip()}"
        )
    return problems, pending


def spread(steps: list[str], count: str) -> list[int]:
    """Step numbers to kill at: evenly spaced from the first to the last, plus the steps where
    the transaction is committed, where the first file of the tree changes, and where it ends."""
    total = len(steps)
    if count == "all" or int(count) >= total:
        return list(range(1, total + 1))
    chosen = {round(1 + i * (total - 1) / (int(count) - 1)) for i in range(int(count))}
    for i, what in enumerate(steps, start=1):
        if what.startswith("rename ") and (what.endswith("/journal") or "/backups/" in what):
            chosen.add(i)
    return sorted(chosen)


def _diff(expected: Tree, actual: Tree) -> str:
    paths = sorted(p for p in set(expected) | set(actual) if expected.get(p, 0) != actual.get(p, 0))
    return f"differing: {paths}" if paths else ""


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_kill_at_any_step_is_recovered_by_the_next_revert_and_apply(bench: Bench, command: str) -> None:
    steps = bench.steps(command)
    chosen = spread(steps, TRIALS)
    failures, interrupted = [], 0
    for number in chosen:
        problems, pending = _trial(bench, command, number)
        failures += [f"step {number} ({steps[number - 1]}): {problem}" for problem in problems]
        interrupted += pending
    in_tree = sum(str(bench.tree) in steps[number - 1] for number in chosen)
    print(
        f"{command}: {len(chosen)} SIGKILL trials over its {len(steps)} steps ({in_tree} at a "
        f"change to the tree, {interrupted} leaving an unfinished transaction); "
        f"failures: {len(failures)}"
    )
    # At least 30, landing before the journal is committed, inside the transaction, and after.
    assert len(chosen) >= 30 and in_tree >= 8 and 8 <= interrupted < len(chosen)
    assert failures == []


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_the_same_command_again_finishes_what_a_kill_interrupted(bench: Bench, command: str) -> None:
    steps = bench.steps(command)
    # Kills inside the transaction: after the journal is committed, before it is marked done.
    commit = next(i for i, s in enumerate(steps, 1) if s.endswith("/journal"))
    done = next(i for i, s in enumerate(steps, 1) if "/backups/" in s and s.startswith("rename"))
    expected = bench.applied if command == "apply" else bench.pristine
    for number in range(commit + 1, done + 1, max(1, (done - commit) // 5)):
        bench.reset("pristine" if command == "apply" else "applied")
        assert run_killed_at(number, bench.work / "t.log", command, *bench.args).returncode == -signal.SIGKILL
        assert bench.journal_pending(), steps[number - 1]
        again = call_tool(command, *bench.args)
        assert again.returncode == 0, again.stderr
        assert f"found an interrupted {command}" in again.stdout and "finished it" in again.stdout
        assert snapshot(bench.tree) == expected, (number, steps[number - 1])


def test_a_kill_during_the_recovery_is_recovered_too(bench: Bench) -> None:
    apply_steps = bench.steps("apply")
    middle = (
        next(i for i, s in enumerate(apply_steps, 1) if s.startswith("rename") and str(bench.tree) in s) + 1
    )  # after the first file went into place
    for recovery_step in (1, 3, 8):
        bench.reset("pristine")
        assert run_killed_at(middle, bench.work / "a.log", "apply", *bench.args).returncode == -signal.SIGKILL
        killed = run_killed_at(recovery_step, bench.work / "r.log", "revert", *bench.args)
        assert killed.returncode == -signal.SIGKILL
        assert call_tool("status", *bench.args).returncode == Status.INTERRUPTED.code
        assert call_tool("revert", *bench.args).returncode == 0
        assert snapshot(bench.tree) == bench.pristine
