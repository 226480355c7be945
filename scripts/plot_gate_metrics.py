#!/usr/bin/env python3
"""Draws what the Grafana gate panels show, from the /metrics series a CPU online e2e run sampled.

The series is the one ``tests/e2e_cpu/drive_waves.py`` scrapes every 0.5 s during a bursty balance-on run (three
bursts of ``vllm bench serve`` with idle gaps); ``BALANCE_E2E_ARTIFACTS=<dir> scripts/online_e2e.sh`` keeps it as
``series-balance-on-v<vllm>.json``. Per DP engine: the gate's state (``vllm:balance_gate_closed``), the gated-step
counter and the running/waiting gauges of vLLM, against seconds since the first scrape.

    .venv/bin/python scripts/plot_gate_metrics.py SERIES.json docs/balance-gate-metrics.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def column(series: list[dict], name: str, engine: str) -> list[float]:
    return [sample["values"].get(name, {}).get(engine, float("nan")) for sample in series]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("series", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    series = json.loads(args.series.read_text())
    times = [sample["t"] for sample in series]
    engines = sorted({e for s in series for e in s["values"].get("vllm:balance_gate_closed", {})})
    figure, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    for engine in engines:
        closed = column(series, "vllm:balance_gate_closed", engine)
        axes[0].step(times, [c + 1.5 * int(engine) for c in closed], where="post", label=f"engine {engine}")
        axes[1].plot(times, column(series, "vllm:balance_gated_steps_total", engine), label=f"gated, engine {engine}")
        axes[1].plot(
            times, column(series, "vllm:balance_waiting_gated_steps_total", engine), "--", label=f"kept out, {engine}"
        )
        axes[2].plot(times, column(series, "vllm:num_requests_running", engine), label=f"running, engine {engine}")
        axes[2].plot(times, column(series, "vllm:num_requests_waiting", engine), ":", label=f"waiting, engine {engine}")
    axes[0].set_ylabel("gate closed\n(offset per engine)")
    axes[0].set_yticks([0, 1, 1.5, 2.5], ["open", "closed", "open", "closed"])
    axes[1].set_ylabel("steps (counter)")
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("seconds since the first scrape (scraped about every 0.5 s)")
    for axis in axes:
        axis.legend(loc="upper left", fontsize=7, ncol=2)
        axis.grid(alpha=0.3)
    figure.suptitle("Balance gate on /metrics: CPU online e2e, DP 2, max_num_seqs 4, three bursts with idle gaps")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(series)} scrapes, engines {engines})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
