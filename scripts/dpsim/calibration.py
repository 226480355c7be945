"""Calibrate a profile's step costs on the published *baseline* (balance-off) row only.

The baseline row pins how long steps are, not what makes them long, so one prefill-cost
parameter (the *knob*: ``prefill_ms_per_token`` or ``prefill_step_overhead_ms``, the preset says
which) is fitted and everything else is an assumption or a known fact. With two targets (TPOT
mean and TTFT mean) the knob and a cost scale x are fitted (``step_overhead_ms`` and
``decode_ms_per_request`` move together; their ratio is an assumption kept from the starting
profile). With TPOT alone (when the decode step's cost is a known fact, as in vLLM PR #44558)
only the knob is fitted. The other figures (output throughput, ITL...) are not fitted, only
reported (checks), and nothing of the row being predicted is used.

Why it converges in a few runs: in a closed-loop benchmark the schedule, counted in steps, barely
depends on the step costs, so TPOT and TTFT are close to linear in (x, knob). Each round fits
that linear model through the last two runs and solves it for the targets (a secant step). In an
open-loop (Poisson) benchmark the schedule does depend on the costs (longer steps, more arrivals
per step), so the secant takes a few more rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpsim.costmodel import CostProfile, with_values

KNOBS = ("prefill_ms_per_token", "prefill_step_overhead_ms")
TARGET_SETS = (("tpot_mean_ms", "ttft_mean_ms"), ("tpot_mean_ms",))
# Targets hit within this relative error end the search. The schedule moves a little with the
# costs (which steps a request lands in), so the figures are not exactly linear and the secant
# can hover within a few per cent: after MAX_ROUNDS the best point is taken if within ACCEPTABLE.
TOLERANCE = 0.01
ACCEPTABLE = 0.03
MAX_ROUNDS = 6

RunOff = Callable[[list[CostProfile]], list[dict[str, Any]]]


@dataclass(frozen=True)
class Point:
    scale: float
    knob: float
    summary: dict[str, Any]

    def __getitem__(self, key: str) -> float:
        return float(self.summary[key])


def _profile(base: CostProfile, knob: str, scale: float, value: float) -> CostProfile:
    return with_values(
        base,
        {
            "step_overhead_ms": round(base.step_overhead_ms * scale, 3),
            "decode_ms_per_request": round(base.decode_ms_per_request * scale, 4),
            knob: round(value, 5),
        },
        "calibration",
    )


def _solve_two(a: Point, b: Point, targets: dict[str, float]) -> tuple[float, float]:
    """(scale, knob) meeting TPOT and TTFT, each modelled as ``u * scale + v * knob`` (every
    time is a sum of step costs), fitted through a and b."""
    det = a.scale * b.knob - b.scale * a.knob
    if abs(det) < 1e-12:
        raise ValueError("calibration points are degenerate (same cost ratio twice)")

    def fit(key: str) -> tuple[float, float]:
        return ((a[key] * b.knob - b[key] * a.knob) / det, (a.scale * b[key] - b.scale * a[key]) / det)

    (u1, v1), (u2, v2) = fit("tpot_mean_ms"), fit("ttft_mean_ms")
    tpot, ttft = targets["tpot_mean_ms"], targets["ttft_mean_ms"]
    det2 = u1 * v2 - u2 * v1
    if abs(det2) < 1e-12:
        raise ValueError("TPOT and TTFT respond alike to both costs: cannot separate them")
    scale, knob = (tpot * v2 - ttft * v1) / det2, (u1 * ttft - u2 * tpot) / det2
    if scale <= 0 or knob < 0:
        raise ValueError(
            f"no positive costs reach the targets (scale {scale:.3f}, prefill "
            f"cost {knob:.4f}): the schedule cannot produce this TTFT/TPOT"
        )
    return scale, knob


def _solve_one(a: Point, b: Point, targets: dict[str, float]) -> tuple[float, float]:
    """(1, knob) meeting the TPOT target, TPOT modelled as ``c + v * knob``."""
    if a.knob == b.knob or a["tpot_mean_ms"] == b["tpot_mean_ms"]:
        raise ValueError("calibration points are degenerate (TPOT does not move with the knob)")
    slope = (b["tpot_mean_ms"] - a["tpot_mean_ms"]) / (b.knob - a.knob)
    knob = b.knob + (targets["tpot_mean_ms"] - b["tpot_mean_ms"]) / slope
    if knob < 0:
        raise ValueError(f"no non-negative prefill cost reaches TPOT {targets['tpot_mean_ms']} ms")
    return 1.0, knob


def calibrate(
    base: CostProfile,
    targets: dict[str, float],
    keys: tuple[str, ...],
    knob: str,
    run_off: RunOff,
    log: Callable[[str], None],
) -> tuple[CostProfile, dict[str, Any]]:
    """The calibrated profile and its baseline summary."""
    if keys not in TARGET_SETS or knob not in KNOBS:
        raise ValueError(f"cannot calibrate {knob} on {keys}")
    start = getattr(base, knob) or (0.1 if knob == KNOBS[0] else 50.0)
    # A small second step: an open-loop run saturates if the prefill cost jumps too far.
    starts = [(1.0, start), (1.0, 1.25 * start)]
    summaries = run_off([_profile(base, knob, s, v) for s, v in starts])
    points = [Point(s, v, m) for (s, v), m in zip(starts, summaries)]
    for point in points:
        log(_line(base, knob, point, targets))
    solve = _solve_two if len(keys) == 2 else _solve_one

    def error(point: Point) -> float:
        return max(abs(point[key] / targets[key] - 1) for key in keys)

    for _ in range(MAX_ROUNDS):
        scale, value = solve(points[-2], points[-1], targets)
        (summary,) = run_off([_profile(base, knob, scale, value)])
        points.append(Point(scale, value, summary))
        log(_line(base, knob, points[-1], targets))
        if error(points[-1]) < TOLERANCE:
            return _profile(base, knob, scale, value), summary
    best = min(points, key=error)
    if error(best) < ACCEPTABLE:
        log(f"  no point within {TOLERANCE:.0%} after {MAX_ROUNDS} rounds: taking the best, within {error(best):.1%}")
        return _profile(base, knob, best.scale, best.knob), best.summary
    raise ValueError(f"no convergence within {MAX_ROUNDS} rounds (best: {_line(base, knob, best, targets)})")


def _line(base: CostProfile, knob: str, point: Point, targets: dict[str, float]) -> str:
    profile = _profile(base, knob, point.scale, point.knob)

    def off(key: str) -> str:
        return f" ({(point[key] / targets[key] - 1) * 100:+.1f}%)" if key in targets else ""

    return (
        f"  overhead {profile.step_overhead_ms:g} ms, decode {profile.decode_ms_per_request:g}"
        f" ms/req, prefill {profile.prefill_ms_per_token:g} ms/token + "
        f"{profile.prefill_step_overhead_ms:g} ms/step -> TPOT {point['tpot_mean_ms']:.2f} ms"
        f"{off('tpot_mean_ms')}, TTFT {point['ttft_mean_ms']:.0f} ms{off('ttft_mean_ms')}, "
        f"output {point['output_tok_s']:.1f} tok/s{off('output_tok_s')}, request/s "
        f"{point['request_s']:.2f}{off('request_s')}"
    )
