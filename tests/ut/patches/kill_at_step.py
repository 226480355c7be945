"""Test helper: runs apply_patches.main with a SIGKILL at its Nth filesystem step.

    kill_at_step.py N LOG apply_patches-arguments...

Every step (patch_journal.checkpoint: before each change to the tree or the state directory, and
halfway through each file write) is appended to LOG; at step N the process kills itself the way
an OOM killer would (N = 0: never, to count the steps). Deterministic, unlike a timed kill.
"""

from __future__ import annotations

import os
import signal
import sys

import apply_patches
import patch_journal


def main() -> int:
    kill_at, log = int(sys.argv[1]), sys.argv[2]
    count = 0

    def checkpoint(what: str) -> None:
        nonlocal count
        count += 1
        with open(log, "a") as handle:
            handle.write(f"{count}\t{what}\n")
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    patch_journal.checkpoint = checkpoint
    return apply_patches.main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
