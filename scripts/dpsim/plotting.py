"""The figures: balance off vs on (per-rank running counts over time, TPOT / TTFT
distributions), and the policy comparison (headline figures per policy, TPOT / TTFT / ITL
distributions).

The running counts show the mechanism (with balance on, ranks refill together instead of one
at a time); the distributions show its price and payoff.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # Files only: no display on a server.
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from dpsim.metrics import RunResult  # noqa: E402
from dpsim.settings import Arm  # noqa: E402

COLORS = {
    "off": "tab:red",
    "on": "tab:blue",
    "on-cap": "tab:cyan",
    "interval-2": "tab:green",
    "interval-4": "tab:olive",
    "on+interval-2": "tab:purple",
}
# (title, summary key) of the policy figure's bar panels.
POLICY_BARS = (
    ("output tok/s", "output_tok_s"),
    ("TPOT mean (ms)", "tpot_mean_ms"),
    ("TTFT mean (ms)", "ttft_mean_ms"),
    ("ITL p50 (ms)", "itl_p50_ms"),
)


def _running_panel(axis: plt.Axes, name: str, result: RunResult, start_s: float, window_s: float | None) -> None:
    times = np.array(result.step_times)
    running = np.array(result.running)
    if times.size == 0:
        axis.set_title(f"{name}: no steps")
        return
    end = start_s + window_s if window_s else times[-1]
    shown = (times >= start_s) & (times <= end)
    for rank in range(running.shape[1]):
        axis.step(times[shown], running[shown, rank], where="post", linewidth=0.8, label=f"rank {rank}")
    axis.set_title(f"{name}: running requests per DP rank")
    axis.set_xlabel("simulated time (s)")
    axis.set_ylabel("len(running)")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    if running.shape[1] <= 8:
        axis.legend(loc="lower right", fontsize=7, ncol=2)


def _histogram(axis: plt.Axes, results: dict[str, RunResult], attribute: str, label: str) -> None:
    series = {name: np.array(getattr(result, attribute)) for name, result in results.items()}
    values = np.concatenate([v for v in series.values() if v.size]) if series else np.array([])
    if values.size == 0:
        axis.set_title(f"{label}: no data")
        return
    bins = np.linspace(values.min(), values.max() + 1e-9, 50)
    for name, data in series.items():
        axis.hist(
            data, bins=bins, alpha=0.55, color=COLORS.get(name), label=f"balance {name} (mean {data.mean():.1f} ms)"
        )
    axis.set_xlabel(label)
    axis.set_ylabel("requests")
    axis.legend(fontsize=8)


def _window(results: dict[str, RunResult], start_s: float | None, window_s: float | None) -> tuple[float, float | None]:
    if start_s is None:
        # Past the first wave (every rank fills up at once), where the ranks' rhythms differ;
        # the same window for every run so the panels compare.
        ends = [r.step_times[-1] for r in results.values() if r.step_times]
        start_s = min(ends) / 4 if ends else 0.0
    return start_s, window_s


def save_comparison_plot(
    results: dict[str, RunResult], path: Path, title: str, start_s: float | None = None, window_s: float | None = None
) -> None:
    names = list(results)
    start_s, window_s = _window(results, start_s, window_s)
    figure, axes = plt.subplots(2, max(len(names), 2), figsize=(13, 8.5), squeeze=False)
    for column, name in enumerate(names):
        label = f"balance {name}" if name in ("off", "on") else name
        _running_panel(axes[0][column], label, results[name], start_s, window_s)
    for column in range(len(names), axes.shape[1]):
        axes[0][column].axis("off")
    _histogram(axes[1][0], results, "tpot_ms", "TPOT per request (ms)")
    _histogram(axes[1][1], results, "ttft_ms", "TTFT per request (ms)")
    figure.suptitle(textwrap.fill(title, 160), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _cdf(axis: plt.Axes, results: dict[str, RunResult], arms: list[Arm], attribute: str, label: str) -> None:
    for arm in arms:
        data = np.sort(np.array(getattr(results[arm.name], attribute)))
        if data.size:
            axis.plot(
                data,
                np.arange(1, data.size + 1) / data.size,
                color=COLORS.get(arm.name),
                label=arm.label,
                linewidth=1.2,
            )
    axis.set_xlabel(label)
    axis.set_ylabel("fraction of requests")
    axis.legend(fontsize=7)


def save_policies_plot(results: dict[str, RunResult], arms: list[Arm], path: Path, title: str) -> None:
    figure, axes = plt.subplots(2, len(POLICY_BARS), figsize=(15, 8), squeeze=False)
    labels = [arm.label.replace(" + ", "\n+ ") for arm in arms]
    for axis, (name, key) in zip(axes[0], POLICY_BARS):
        values = [results[arm.name].summary[key] for arm in arms]
        bars = axis.bar(range(len(arms)), values, color=[COLORS.get(a.name) for a in arms])
        axis.bar_label(bars, fmt="%.0f" if max(values) >= 100 else "%.1f", fontsize=7)
        axis.set_xticks(range(len(arms)), labels, fontsize=7)
        axis.set_title(name, fontsize=9)
    _cdf(axes[1][0], results, arms, "tpot_ms", "TPOT per request (ms)")
    _cdf(axes[1][1], results, arms, "ttft_ms", "TTFT per request (ms)")
    # The baseline and the second policy (balance, in --compare-policies) over the same window.
    for axis, arm in zip(axes[1][2:], arms[:2]):
        _running_panel(axis, arm.label, results[arm.name], *_window(results, None, 60.0))
        axis.set_title(f"{arm.label}: running per rank", fontsize=9)
    figure.suptitle(textwrap.fill(title, 170), fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
