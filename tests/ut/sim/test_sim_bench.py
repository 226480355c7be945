"""bench_overhead.py runs end to end, and loading vllm-ascend's released copy leaves vLLM intact."""

from __future__ import annotations

import random

import bench_overhead
import pytest
import vllm.v1.core.sched.scheduler as vllm_scheduler_module
from balance_fixtures import needs_vllm_ascend
from vllm.v1.engine.core import EngineCoreProc


@needs_vllm_ascend
def test_released_copy_loads_without_rebinding_vllm() -> None:
    scheduler_before = vllm_scheduler_module.Scheduler
    run_before = EngineCoreProc.__dict__["run_engine_core"]
    released, note = bench_overhead.load_released_copy()
    assert released is not None, note
    assert "schedule" in released.__dict__ and issubclass(released, scheduler_before)
    assert vllm_scheduler_module.Scheduler is scheduler_before
    assert EngineCoreProc.__dict__["run_engine_core"] is run_before


def test_tiny_benchmark_prints_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench_overhead.main(["--dp-sizes", "4", "--running", "4", "--steps", "3", "--instances", "2", "--rounds", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "ours on, gate closed ×" in out and "gate read of balance_queue alone" in out
    assert "stock again (A/A) ×" in out and "2 rounds of 2 fresh schedulers per variant, 3 steps each" in out
    header, rule, row = out.splitlines()[2:5]
    assert header.split()[:3] == ["DP", "stock", "µs"] and set(rule) == {"-"}
    assert row.split()[0] == "4" and all(float(cell) > 0 for cell in row.split()[1:])
    # The gate's own parts, for ours' four variants: each timed, so each above 0.
    gate = out.split("the gate's own work inside the whole step")[1].split("\n\n")[0].splitlines()[3:]
    assert [line.split()[1:3] for line in gate] == [
        ["ours", "on,"],
        ["ours", "on,"],
        ["ours", "adaptive,"],
        ["ours", "adaptive,"],
    ]
    assert all(float(cell) > 0 for line in gate for cell in line.split()[-4:])
    # The share of steps the gate was closed: what each variant measured (the adaptive rule has not fitted in 3 steps).
    assert [line.split()[-5] for line in gate] == ["0", "100", "0", "0"]


def test_bad_dp_sizes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        bench_overhead.main(["--dp-sizes", "0,4"])
    assert exc_info.value.code == 2
    assert "DP sizes must be >= 1" in capsys.readouterr().err


def test_the_target_is_ours_worst_beside_stock_against_itself() -> None:
    """The verdict judges ours' four variants only (the adaptive rule pricing holds, the fourth, included): never
    stock against itself (first) or vllm-ascend's copy (last)."""
    line = bench_overhead.target_verdict("ours", [1.5, 1.01, 1.0, 0.99, 1.0, 2.0])
    assert line.endswith("1.010x -> met (stock against itself: 1.500x)")
    assert "1.030x -> NOT met" in bench_overhead.target_verdict("ours", [1.0, 1.0, 1.03, 0.99, 1.0])
    assert "1.040x -> NOT met" in bench_overhead.target_verdict("ours", [1.0, 1.0, 1.0, 0.99, 1.04, 1.0])


def test_each_round_builds_fresh_schedulers_in_a_new_order() -> None:
    """Rounds pool their samples, free their schedulers, and build the variants in an order that changes."""

    class Stub:
        def __init__(self, name: str) -> None:
            self.name, self.scheduler, self.steps = name, object(), 0

        def measure(self, steps: int) -> None:
            self.steps += steps

    variants = [(f"v{i}", object, None, None, "cap") for i in range(6)]
    built: list[str] = []
    by_variant: list[list[Stub]] = [[] for _ in variants]

    def build(name: str, *_: object) -> Stub:
        built.append(name)
        return Stub(name)

    shuffler = random.Random(0)
    for _ in range(3):
        bench_overhead.run_round(by_variant, variants, 2, 5, shuffler, build)  # type: ignore[arg-type]
    assert [[s.name for s in instances] for instances in by_variant] == [[name] * 6 for name, *_ in variants]
    assert all(s.steps == 5 and not hasattr(s, "scheduler") for instances in by_variant for s in instances)
    orders = [built[i : i + 6] for i in range(0, len(built), 6)]
    assert len(orders) == 6 and len({tuple(order) for order in orders}) > 1
