"""The comparison figure: per-rank running counts over time, and TPOT / TTFT distributions.

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

COLORS = {"off": "tab:red", "on": "tab:blue"}


def _running_panel(axis: plt.Axes, name: str, result: RunResult, start_s: float,
                   window_s: float | None) -> None:
    times = np.array(result.step_times)
    running = np.array(result.running)
    if times.size == 0:
        axis.set_title(f"balance {name}: no steps")
        return
    end = start_s + window_s if window_s else times[-1]
    shown = (times >= start_s) & (times <= end)
    for rank in range(running.shape[1]):
        axis.step(times[shown], running[shown, rank], where="post", linewidth=0.8,
                  label=f"rank {rank}")
    axis.set_title(f"balance {name}: running requests per DP rank")
    axis.set_xlabel("simulated time (s)")
    axis.set_ylabel("len(running)")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    if running.shape[1] <= 8:
        axis.legend(loc="lower right", fontsize=7, ncol=2)


def _histogram(axis: plt.Axes, results: dict[str, RunResult], attribute: str,
               label: str) -> None:
    series = {name: np.array(getattr(result, attribute)) for name, result in results.items()}
    values = np.concatenate([v for v in series.values() if v.size]) if series else np.array([])
    if values.size == 0:
        axis.set_title(f"{label}: no data")
        return
    bins = np.linspace(values.min(), values.max() + 1e-9, 50)
    for name, data in series.items():
        axis.hist(data, bins=bins, alpha=0.55, color=COLORS.get(name),
                  label=f"balance {name} (mean {data.mean():.1f} ms)")
    axis.set_xlabel(label)
    axis.set_ylabel("requests")
    axis.legend(fontsize=8)


def save_comparison_plot(results: dict[str, RunResult], path: Path, title: str,
                         start_s: float | None = None, window_s: float | None = None) -> None:
    names = list(results)
    if start_s is None:
        # Past the first wave (every rank fills up at once), where the ranks' rhythms differ;
        # the same window for every run so the panels compare.
        ends = [r.step_times[-1] for r in results.values() if r.step_times]
        start_s = min(ends) / 4 if ends else 0.0
    figure, axes = plt.subplots(2, max(len(names), 2), figsize=(13, 8.5), squeeze=False)
    for column, name in enumerate(names):
        _running_panel(axes[0][column], name, results[name], start_s, window_s)
    for column in range(len(names), axes.shape[1]):
        axes[0][column].axis("off")
    _histogram(axes[1][0], results, "tpot_ms", "TPOT per request (ms)")
    _histogram(axes[1][1], results, "ttft_ms", "TTFT per request (ms)")
    figure.suptitle(textwrap.fill(title, 160), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
