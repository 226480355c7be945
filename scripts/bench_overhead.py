#!/usr/bin/env python3
"""What balance scheduling adds to ``Scheduler.schedule()``, measured as ratios in one run.

Why: the gate runs on every step of every DP rank; it must cost next to nothing. For each DP size (the length
of ``balance_queue``) this times ``schedule()`` at 128 running requests (the cap, with a few more waiting) for
vLLM's stock ``Scheduler`` (twice: stock against itself), ours with the gate open, ours with the gate closed,
ours with the adaptive rule and a rank at its cap (with no request waiting anywhere, and with one on every rank: a hold
priced every step) and, when the vllm-ascend wheel is installed, its released
copy (0.18.0) with the gate closed. Variants are interleaved step by step, in a shuffled order, so machine
noise hits them alike, each built afresh in several rounds (``--rounds`` x ``--instances``, in a shuffled order:
where in memory a scheduler lands moves its step by a few per cent) with its samples pooled; the median thread
CPU time per step of each is reported as a ratio to stock, beside stock against itself (A/A), the run's noise floor.
A second table times ``schedule()`` plus ``make_stats()`` (what a step costs with the gate's
metrics on: ours carries its counts to vLLM's /metrics in the stats, see balance_metrics), a
third the whole step (``update_from_output()``, which makes the stats, and the gate's decision on
the gathered rows too), and a fourth the gate's read of ``balance_queue`` alone, against one-tensor
alternatives.

    .venv/bin/python scripts/bench_overhead.py [--dp-sizes 1,8,64,256] [--steps 300] [--instances 4] [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # quiet vLLM's per-object INFO lines; never when imported by tests
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
import vllm.v1.core.sched.scheduler as vllm_scheduler_module  # noqa: E402
from offline_vllm import (  # noqa: E402
    build_scheduler,
    emulate_gather,
    fake_model_output,
    make_request,
    make_vllm_config,
    torch_npu_stubbed_for_import,
    write_tiny_model,
)
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402

from vllm_ascend.core.balance_rule import COLUMNS, ROW, RULE_ENV  # noqa: E402
from vllm_ascend.core.balance_scheduler import BalanceScheduler  # noqa: E402

# vllm-ascend's copy decides from this variable at construction (ours: the class decides).
BALANCE_SCHEDULING_ENV = "VLLM_ASCEND_BALANCE_SCHEDULING"

RELEASED_COPY = "patch/platform/patch_balance_schedule.py"
TARGET_DP, TARGET_RATIO = 64, 1.02
# (name, scheduler class, balance switch, the gathered count of the rank at its cap, gate rule, every rank's waiting).
Variant = tuple[str, type, "str | None", "int | None", str, int]


def load_released_copy() -> tuple[type | None, str]:
    """vllm-ascend's released ``BalanceScheduler``, or None and why not.

    Its package ``__init__`` files import torch_npu, so only this one file is loaded, by path, as
    a stand-alone module (it imports nothing from vllm_ascend). Importing it rebinds vLLM's
    ``Scheduler`` and ``EngineCoreProc.run_engine_core`` globally; both are put back at once.
    """
    try:  # the distribution, not the package: this project installs into ``vllm_ascend`` too
        version = importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None, "vllm-ascend is not installed"
    spec = importlib.util.find_spec("vllm_ascend")  # locates the package, runs nothing
    assert spec is not None and spec.submodule_search_locations
    path = Path(list(spec.submodule_search_locations)[0]) / RELEASED_COPY
    if not path.is_file():
        return None, f"vllm-ascend {version} has no {RELEASED_COPY}"
    saved_scheduler = vllm_scheduler_module.Scheduler
    saved_run = EngineCoreProc.__dict__["run_engine_core"]
    module_spec = importlib.util.spec_from_file_location("vllm_ascend_released_patch_balance_schedule", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        with torch_npu_stubbed_for_import():  # vllm-ascend 0.23's copy imports it at the top
            module_spec.loader.exec_module(module)
            if importlib.util.find_spec("vllm_ascend.ascend_config") is not None:
                # main's copy builds vllm-ascend's AscendConfig in __init__, which imports
                # vllm_ascend.utils (torch_npu at the top, unused here) on first use.
                importlib.import_module("vllm_ascend.utils")
    except Exception as exc:  # the reference column is optional: say why it is missing
        return None, f"cannot load vllm-ascend {version}'s {RELEASED_COPY}: {exc!r}"
    finally:
        vllm_scheduler_module.Scheduler = saved_scheduler
        EngineCoreProc.run_engine_core = saved_run
    return module.BalanceScheduler, f"vllm-ascend {version}"


class Subject:
    """One scheduler at steady state: ``running`` decoding requests at the cap, a few waiting."""

    def __init__(
        self,
        name: str,
        cls: type,
        balance: str | None,
        queue_value: int | None,
        model_dir: Path,
        dp_size: int,
        running: int,
        max_tokens: int,
        rule: str = "cap",
        waiting: int = 0,
    ) -> None:
        self.name = name
        config = make_vllm_config(
            model_dir,
            max_num_seqs=running,
            max_num_batched_tokens=max(running * 16, 2048),
            max_model_len=max_tokens + 16,
            dp_size=dp_size,
            num_blocks=(running + 8) * ((max_tokens + 16) // 16 + 2),
        )
        previous = os.environ.pop(BALANCE_SCHEDULING_ENV, None)
        if balance is not None:
            os.environ[BALANCE_SCHEDULING_ENV] = balance
        os.environ[RULE_ENV] = rule
        try:
            self.scheduler = build_scheduler(cls, config)
        finally:
            os.environ.pop(BALANCE_SCHEDULING_ENV, None)
            os.environ.pop(RULE_ENV, None)
            if previous is not None:
                os.environ[BALANCE_SCHEDULING_ENV] = previous
        # Warm-up steps: no gather. The gathered rows come from a seeded generator, the same for every variant.
        self.queue_value, self.rows_rng, self.closed_steps = None, random.Random(0), 0
        self.row_waiting = waiting  # what every rank's row reports waiting: 1 makes holds worth making or pricing
        for index in range(running + 4):
            self.scheduler.add_request(make_request(f"{name}-{index}", 8, max_tokens))
        for _ in range(3):  # everyone admitted and past prefill
            self._step()
        assert len(self.scheduler.running) == running, (name, len(self.scheduler.running))
        if queue_value is not None:
            # What balance_gather leaves; the last rank holds the value (max scans everything).
            emulate_gather([self.scheduler], [0] * (dp_size - 1) + [queue_value])
        self.samples_ns: list[int] = []
        self.with_stats_ns: list[int] = []  # schedule() + make_stats()
        self.whole_ns: list[int] = []  # schedule() + update_from_output() + the gate's per-gather update
        self.row_ns: list[int] = []  # ours: balance_row() (this rank's values for the gather)
        self.rule_ns: list[int] = []  # ours: balance_update() (the decision on every rank's gathered values)
        self.queue_value = queue_value  # from now on every step ends with the gather's rows (balance on)

    def _step(self) -> tuple[int, int, int, int, int]:
        # CPU time of this thread: other processes on a shared machine do not inflate it.
        started = time.thread_time_ns()
        output = self.scheduler.schedule()
        elapsed = time.thread_time_ns() - started
        self.scheduler.make_stats()  # the stats vLLM makes once per step (ours: with the gate's counts)
        with_stats = time.thread_time_ns() - started
        model_output = fake_model_output(self.scheduler, output)
        started_update = time.thread_time_ns()
        # vLLM's update_from_output makes the step's stats itself (log_stats): the whole step counts them there, once.
        self.scheduler.update_from_output(output, model_output)
        whole = elapsed + time.thread_time_ns() - started_update
        row_ns = rule_ns = 0
        if self.queue_value is not None and hasattr(self.scheduler, "balance_update"):  # ours (not vllm-ascend's copy)
            # What the gather leaves, written untimed (all_gather's job, not the gate's): every rank's row. In one
            # step of four 1-8 ranks prefill a prompt of 128-1024 tokens, and the step costs 100 ms more plus 10 us a
            # token (a fixed extra the adaptive rule can tell from the per-token cost, so it holds: the costlier path).
            rng, dp_size = self.rows_rng, len(self.scheduler.balance_queue)
            prefills = [rng.choice((128, 512, 1024)) for _ in range(rng.randint(1, 8) * (rng.random() < 0.25))]
            step_us = 30_000 + (100_000 + 10 * sum(prefills)) * bool(prefills) + rng.randrange(2_000)
            tokens = (prefills + [0] * dp_size)[: dp_size - 1]  # the other ranks' prefills (as many as there are)
            # The last rank is at its cap: it admits none; with a request waiting on every rank, a hold would align.
            waiting = self.row_waiting
            rows = [[0, waiting, t, step_us] for t in tokens] + [[self.queue_value, waiting, 0, step_us]]
            started_gather = time.thread_time_ns()
            self.scheduler.balance_row()
            row_ns = time.thread_time_ns() - started_gather
            self.scheduler._balance_rows.copy_(torch.tensor(rows, dtype=torch.int32))
            started_gather = time.thread_time_ns()
            self.scheduler.balance_update()
            rule_ns = time.thread_time_ns() - started_gather
            whole += row_ns + rule_ns
            self.closed_steps += self.scheduler.balance_gate_closed()
        return elapsed, with_stats, whole, row_ns, rule_ns

    def measure(self, steps: int) -> None:
        for _ in range(steps):
            samples = self._step()
            for name, value in zip(("samples_ns", "with_stats_ns", "whole_ns", "row_ns", "rule_ns"), samples):
                getattr(self, name).append(value)


def run_round(
    by_variant: list[list[Subject]],
    variants: list[Variant],
    instances_per_variant: int,
    steps: int,
    shuffler: random.Random,
    build: Callable[[str, type, str | None, int | None, str, int], Subject],
) -> None:
    """Build ``--instances`` schedulers per variant, step them all interleaved, keep their samples, drop them.

    Where in memory a scheduler lands moves its step by a few per cent, and a variant built always in the same turn
    lands alike each time: so the build order is shuffled, and each run has several rounds of fresh schedulers. Few
    at once: with 48 schedulers of 1000 steps interleaved their data outgrew a 32 MiB cache, and vLLM's own
    update_from_output() read 1.04-1.05x stock for schedulers that ran less of the gate's code than others at 1.00-1.02.
    """
    built: list[list[Subject]] = [[] for _ in variants]
    for _ in range(instances_per_variant):
        order = list(zip(built, variants))
        shuffler.shuffle(order)
        for instances, variant in order:
            instances.append(build(*variant))
    subjects = [subject for instances in built for subject in instances]
    gc.collect()
    # Collected between steps, untimed: a collection would land on whichever step crossed its threshold.
    gc.disable()
    try:
        for step in range(steps):  # step by step in turn: load spikes hit every variant alike
            # Shuffled: a step runs faster after one of its own class (its code still in the caches), so no
            # variant may always follow the same one.
            shuffler.shuffle(subjects)
            for subject in subjects:
                subject.measure(1)
            if step % 50 == 49:
                gc.collect()
    finally:
        gc.enable()
    for instances, fresh in zip(by_variant, built):
        for subject in fresh:
            del subject.scheduler  # its samples stay; its memory goes before the next round is built
        instances.extend(fresh)


def pooled_us(instances: list[Subject], samples: str, of: Callable[[list[int]], float] = statistics.median) -> float:
    """``of`` (the median unless given) a variant's ``samples`` (a Subject's list of them), its instances' pooled."""
    return of([ns for subject in instances for ns in getattr(subject, samples)]) / 1000.0


def gate_read_costs(dp_size: int, cap: int, repeats: int = 2000) -> dict[str, float]:
    """µs per read of the gathered counts: the first version's per-tensor loop, one contiguous buffer read by torch,
    that buffer's memoryview (stop 36), and what the cap rule reads since stop 37: the counts' column of the gathered
    rows, a strided slice of their flat memoryview."""
    buffer = torch.zeros(dp_size, dtype=torch.int32)
    flat = memoryview(buffer.numpy())
    queue = list(buffer.split(1))  # views: what all_gather would fill, slot by slot
    queue[-1].fill_(cap)
    rows = torch.zeros(dp_size, len(ROW), dtype=torch.int32)
    rows[-1, 0] = cap
    rows_flat = memoryview(rows.numpy().reshape(-1))
    readers: dict[str, Callable[[], Any]] = {
        "loop .item()": lambda: max(int(count.item()) for count in queue),
        "buffer.max()": lambda: int(buffer.max()),
        "buffer.tolist()": lambda: max(buffer.tolist()),
        "memoryview.tolist()": lambda: max(flat.tolist()),
        "rows' count column": lambda: max(rows_flat[COLUMNS[0]]),
    }
    costs = {}
    for name, read in readers.items():
        assert read() == cap, name
        started = time.thread_time_ns()
        for _ in range(repeats):
            read()
        costs[name] = (time.thread_time_ns() - started) / repeats / 1000.0
    return costs


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        if index == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))


def target_verdict(what: str, ratios: list[float]) -> str:
    """The target's line at DP 64: ours' worst variant (the four after stock against itself, ratios[0]; not the
    released copy's)."""
    worst = max(ratios[1:5])
    return (
        f"target: {what} <= {TARGET_RATIO}x stock at DP={TARGET_DP}: {worst:.3f}x -> "
        f"{'met' if worst <= TARGET_RATIO else 'NOT met'} (stock against itself: {ratios[0]:.3f}x)"
    )


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"DP sizes must be >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp-sizes", type=parse_sizes, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--running", type=int, default=128, help="running requests (= the cap)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per instance")
    parser.add_argument(
        "--instances", type=int, default=4, help="schedulers per variant in a round (one alone is 4%% off another)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of fresh schedulers, their samples pooled")
    args = parser.parse_args(argv)
    if min(args.running, args.steps, args.instances, args.rounds) < 1:
        parser.error("--running, --steps, --instances and --rounds must be >= 1")
    torch.set_num_threads(1)

    stock = vllm_scheduler_module.Scheduler
    released, released_note = load_released_copy()
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench-overhead-")))
    max_tokens = args.steps + 64
    if max_tokens + 16 > 4096:
        parser.error("--steps must stay under ~4000 (the tiny model's context)")
    variants: list[Variant] = [
        ("stock", stock, None, None, "cap", 0),
        ("stock again (A/A)", stock, None, None, "cap", 0),
        ("ours on, gate open", BalanceScheduler, "1", 0, "cap", 0),
        ("ours on, gate closed", BalanceScheduler, "1", args.running, "cap", 0),
        ("ours adaptive, a rank at cap", BalanceScheduler, "1", args.running, "adaptive", 0),
        # A request waits on every rank: a hold is priced every step (never made: the full rank never leaves its cap).
        ("ours adaptive, holds priced", BalanceScheduler, "1", args.running, "adaptive", 1),
    ]
    if released is not None:
        # The flag on: vllm-ascend 0.23's copy builds its balance_queue only when its switch is.
        version = importlib.metadata.version("vllm-ascend")
        variants.append((f"v{version} copy, gate closed", released, "1", args.running, "cap", 0))
    print(
        f"schedule() median thread CPU time per step at {args.running} running (cap {args.running}, 4 waiting); "
        f"{args.rounds} rounds of {args.instances} fresh schedulers per variant, {args.steps} steps each, interleaved "
        "step by step; stock again (A/A) is stock against itself: a ratio closer to 1 than it is noise."
    )
    print("reference column: " + (released_note if released is not None else f"absent: {released_note}"))
    names = [name for name, *_ in variants]
    header = ["DP", "stock µs"] + [f"{name} ×" for name in names[1:]]
    rows = [header]
    stats_rows, whole_rows = [header], [header]
    # The gate's own work, in µs, for ours' variants: each part's median and mean (the mean carries the adaptive
    # rule's refit, every 32 steps, which the medians above leave out).
    gate_rows = [["DP", "variant", "gate closed %", "balance_row() median", "mean", "balance_update() median", "mean"]]
    reads = []
    verdict = stats_verdict = whole_verdict = None

    def subject_maker(dp_size: int) -> Callable[[str, type, str | None, int | None, str, int], Subject]:
        def make(name: str, cls: type, flag: str | None, value: int | None, rule: str, waiting: int) -> Subject:
            return Subject(name, cls, flag, value, model_dir, dp_size, args.running, max_tokens, rule, waiting)

        return make

    for dp_size in args.dp_sizes:
        by_variant: list[list[Subject]] = [[] for _ in variants]
        shuffler, make = random.Random(dp_size), subject_maker(dp_size)
        for _ in range(args.rounds):
            run_round(by_variant, variants, args.instances, args.steps, shuffler, make)
        ratios: dict[str, list[float]] = {}
        for table, samples in ((rows, "samples_ns"), (stats_rows, "with_stats_ns"), (whole_rows, "whole_ns")):
            base = pooled_us(by_variant[0], samples)
            ratios[samples] = [pooled_us(instances, samples) / base for instances in by_variant[1:]]
            table.append([str(dp_size), f"{base:.0f}"] + [f"{ratio:.3f}" for ratio in ratios[samples]])
        for name, instances in zip(names[2:6], by_variant[2:6]):
            parts = [
                pooled_us(instances, part, of)
                for part in ("row_ns", "rule_ns")
                for of in (statistics.median, statistics.mean)
            ]
            closed = sum(s.closed_steps for s in instances) / sum(len(s.whole_ns) for s in instances)
            gate_rows.append([str(dp_size), name, f"{100 * closed:.0f}"] + [f"{us:.1f}" for us in parts])
        if dp_size == TARGET_DP:
            verdict = target_verdict("ours with balance on", ratios["samples_ns"])
            stats_verdict = target_verdict("ours with balance on and its metrics", ratios["with_stats_ns"])
            whole_verdict = target_verdict("a whole step of ours, either rule,", ratios["whole_ns"])
        reads.append((dp_size, gate_read_costs(dp_size, args.running)))
    print_table(rows)
    if verdict:
        print(verdict)
    print("\nschedule() + make_stats() per step (the gate's counts ride in ours' stats to /metrics):")
    print_table(stats_rows)
    if stats_verdict:
        print(stats_verdict)
    print(
        "\nthe whole step: schedule() + update_from_output() (which makes the stats) + the gate's update on the rows:"
    )
    print_table(whole_rows)
    if whole_verdict:
        print(whole_verdict)
    print(
        "\nthe gate's own work inside the whole step, µs (median and mean over the steps: the mean carries the refits):"
    )
    print_table(gate_rows)
    print("\ngate read of balance_queue alone (µs per read):")
    read_names = list(reads[0][1])
    print("DP".rjust(5) + "".join(name.rjust(21) for name in read_names))
    for dp_size, costs in reads:
        print(f"{dp_size:5d}" + "".join(f"{costs[name]:21.2f}" for name in read_names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
