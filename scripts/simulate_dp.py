#!/usr/bin/env python3
"""Simulate DP serving on real vLLM schedulers, with balance scheduling off and on.

Why: the balance-scheduling evidence is one table measured on NPUs. This reproduces its workload
on CPU: N DP ranks, each a real ``BalanceScheduler``, stepped in lockstep like MoE DP engine cores
with fake model outputs, priced by a JSON cost profile, so anyone can see when balance
scheduling helps and tune it (docs/simulator.md).

    scripts/simulate_dp.py --preset rfc-dsv31 --compare --json out.json \\
        --plot docs/balance-rfc-dsv31.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # offline_vllm and dpsim

from dpsim.costmodel import CostProfile, ProfileError, load_profile  # noqa: E402
from dpsim.router import ROUTERS  # noqa: E402
from dpsim.settings import (  # noqa: E402
    GATES,
    PRESETS,
    Preset,
    SimSettings,
    problems,
    with_overrides,
)

# (label, summary key, format)
TABLE_ROWS = (
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("request/s", "request_s", "{:.3f}"),
    ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("TPOT mean (ms)", "tpot_mean_ms", "{:.2f}"),
    ("TPOT p99 (ms)", "tpot_p99_ms", "{:.2f}"),
    ("e2e (s)", "e2e_s", "{:.1f}"),
    ("finished", "finished", "{:d}"),
    ("steps", "steps", "{:d}"),
    ("admission steps", "admission_steps", "{:d}"),
    ("stalled decode steps", "stalled_decode_steps", "{:d}"),
    ("gated rank-steps", "gated_rank_steps", "{:d}"),
    ("mean running / rank", "mean_running_per_rank", "{:.1f}"),
    ("simulation wall (s)", "sim_wall_s", "{:.1f}"),
)
PAPER_KEYS = {"output_tok_s", "tpot_mean_ms", "ttft_mean_ms", "e2e_s"}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="rfc-dsv31",
                        help=f"base settings; one of: {', '.join(PRESETS)}")
    parser.add_argument("--profile", type=Path, help="JSON cost profile (default: the preset's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compare", action="store_true", help="run balance off and on")
    mode.add_argument("--balance", choices=("off", "on"), default="on",
                      help="single run with balance scheduling off or on")
    parser.add_argument("--gate", choices=GATES, help="gate rule when balance is on: 'cap' "
                        "(some rank at max_num_seqs) or 'cap-1' (within one of it)")
    group = parser.add_argument_group("deployment (overrides the preset)")
    group.add_argument("--dp-size", type=_positive_int)
    group.add_argument("--max-num-seqs", type=_positive_int, help="per-rank cap")
    group.add_argument("--max-num-batched-tokens", type=_positive_int,
                       help="per-rank token budget per step (chunked prefill)")
    group = parser.add_argument_group("workload and asymmetry sources (overrides the preset)")
    group.add_argument("--num-requests", type=_positive_int)
    group.add_argument("--concurrency", type=_positive_int,
                       help="closed loop: requests in flight (caps Poisson arrivals too)")
    group.add_argument("--no-concurrency-limit", action="store_true",
                       help="Poisson arrivals without a concurrency cap")
    group.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s")
    group.add_argument("--prompt-tokens", type=_positive_int)
    group.add_argument("--output-tokens", type=_positive_int)
    group.add_argument("--prompt-spread", type=float,
                       help="lengths uniform in [L(1-s), L(1+s)] (vllm bench's range ratio)")
    group.add_argument("--output-spread", type=float, help="as --prompt-spread, for outputs")
    group.add_argument("--jitter-ms", type=float,
                       help="each send delayed by uniform [0, J] ms (client-side asymmetry)")
    group.add_argument("--router", choices=ROUTERS,
                       help="'lb' = vLLM's DP load balancer (4*waiting+running), "
                            "'round-robin' ignores load")
    group.add_argument("--lb-stats-interval-ms", type=float,
                       help="age limit of the load balancer's snapshot (vLLM: 100)")
    group.add_argument("--seed", type=int)
    parser.add_argument("--json", type=Path, help="write {'off': {...}, 'on': {...}} here")
    parser.add_argument("--plot", type=Path, help="write the comparison figure (PNG) here")
    parser.add_argument("--plot-start-s", type=float,
                        help="start of the running-count panels (default: a quarter into the run)")
    parser.add_argument("--plot-window-s", type=float, default=60.0,
                        help="time span of the running-count panels (0: to the end)")
    parser.add_argument("--jobs", type=_positive_int, default=2,
                        help="processes for --compare (the two runs are independent)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def resolve(parser: argparse.ArgumentParser,
            args: argparse.Namespace) -> tuple[Preset, SimSettings, CostProfile]:
    """Preset + overrides + profile, or exit with a clear message (status 2)."""
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; available: {', '.join(PRESETS)}")
    preset = PRESETS[args.preset]
    settings = with_overrides(
        preset.settings, dp_size=args.dp_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_requests=args.num_requests,
        concurrency=args.concurrency, request_rate=args.request_rate,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        prompt_spread=args.prompt_spread, output_spread=args.output_spread,
        jitter_ms=args.jitter_ms, router=args.router,
        lb_stats_interval_ms=args.lb_stats_interval_ms, profile=args.profile, gate=args.gate,
        seed=args.seed)
    if args.no_concurrency_limit:
        if args.concurrency is not None:
            parser.error("--concurrency and --no-concurrency-limit contradict each other")
        settings = dataclasses.replace(settings, concurrency=None)
    found = problems(settings)
    if found:
        parser.error("; ".join(found))
    try:
        profile = load_profile(settings.profile)
    except ProfileError as exc:
        parser.error(str(exc))
    return preset, settings, profile


def _run_one(settings: SimSettings, profile: CostProfile, balance: bool, model_dir: Path,
             show_progress: bool, position: int) -> Any:
    import torch
    from tqdm import tqdm

    from dpsim.simulation import run

    torch.set_num_threads(1)
    name = "on" if balance else "off"
    label = f"balance {name}" + (f" (gate {settings.gate})" if balance else "")
    with tqdm(total=settings.num_requests, desc=label, unit="req", position=position,
              file=sys.stderr, disable=not show_progress, leave=True, dynamic_ncols=True) as bar:
        return run(settings, profile, balance, model_dir=model_dir, progress=bar.update)


def run_all(settings: SimSettings, profile: CostProfile, modes: list[bool], jobs: int,
            show_progress: bool) -> dict[str, Any]:
    from dpsim.cluster import prepare_model_dir

    model_dir = prepare_model_dir(Path(tempfile.mkdtemp(prefix="dpsim-model-")),
                                  settings.max_model_len)
    names = ["on" if balance else "off" for balance in modes]
    if jobs == 1 or len(modes) == 1:
        return {name: _run_one(settings, profile, balance, model_dir, show_progress, 0)
                for name, balance in zip(names, modes)}
    # fork: the children inherit the imported vLLM instead of importing it again.
    with ProcessPoolExecutor(max_workers=min(jobs, len(modes)),
                             mp_context=get_context("fork")) as pool:
        futures = [pool.submit(_run_one, settings, profile, balance, model_dir, show_progress,
                               position) for position, balance in enumerate(modes)]
        return {name: future.result() for name, future in zip(names, futures)}


def _change(off: float, on: float) -> str:
    if not off or math.isnan(off) or math.isnan(on):
        return ""
    return f"{(on - off) / off * 100:+.1f}%"


def same_workload(settings: SimSettings, preset: Preset) -> bool:
    """Whether the paper's figures are comparable: only profile, seed or gate rule changed."""
    ignored = {"profile": preset.settings.profile, "seed": preset.settings.seed,
               "gate": preset.settings.gate}
    return dataclasses.replace(settings, **ignored) == preset.settings


def format_table(summaries: dict[str, dict[str, Any]], preset: Preset,
                 with_paper: bool = True) -> str:
    names = list(summaries)
    paper = preset.paper if with_paper and set(names) == {"off", "on"} else {}
    header = ["metric"] + [f"balance {n}" for n in names]
    if len(names) == 2:
        header.append("change")
    if paper:
        header += ["paper off", "paper on", "paper change"]
    rows = [header]
    for label, key, fmt in TABLE_ROWS:
        values = [summaries[n].get(key) for n in names]
        row = [label] + [fmt.format(v) if v is not None and not (
            isinstance(v, float) and math.isnan(v)) else "-" for v in values]
        if len(names) == 2:
            row.append(_change(float(values[0]), float(values[1]))
                       if key not in {"finished", "sim_wall_s"} else "")
        if paper:
            if key in PAPER_KEYS:
                off, on = getattr(paper["off"], key), getattr(paper["on"], key)
                row += [fmt.format(off), fmt.format(on), _change(off, on)]
            else:
                row += ["", "", ""]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def describe(settings: SimSettings, profile: CostProfile) -> str:
    arrivals = (f"closed loop, concurrency {settings.concurrency}"
                if settings.request_rate is None else
                f"Poisson {settings.request_rate} req/s, concurrency cap {settings.concurrency}")
    return (f"DP {settings.dp_size} x max_num_seqs {settings.max_num_seqs}, "
            f"max_num_batched_tokens {settings.max_num_batched_tokens}; "
            f"{settings.num_requests} requests {settings.prompt_tokens}"
            f"(±{settings.prompt_spread:.0%})/{settings.output_tokens}"
            f"(±{settings.output_spread:.0%}) tokens, {arrivals}, jitter {settings.jitter_ms} ms, "
            f"router {settings.router}"
            + (f" (stats every {settings.lb_stats_interval_ms} ms)" if settings.router == "lb"
               else "")
            + f"; gate {settings.gate}; profile {profile.name} "
            f"({profile.step_overhead_ms} ms + {profile.decode_ms_per_request} ms/decode req + "
            f"{profile.prefill_ms_per_token} ms/prefill token); seed {settings.seed}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset, settings, profile = resolve(parser, args)
    modes = [False, True] if args.compare else [args.balance == "on"]
    print(describe(settings, profile), flush=True)
    results = run_all(settings, profile, modes, args.jobs, not args.no_progress)
    summaries = {name: result.summary for name, result in results.items()}
    print(format_table(summaries, preset, same_workload(settings, preset)), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        used = {k: str(v) if isinstance(v, Path) else v
                for k, v in dataclasses.asdict(settings).items()}
        payload = {name: {**summary, "settings": used} for name, summary in summaries.items()}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        from dpsim.plotting import save_comparison_plot

        save_comparison_plot(results, args.plot, describe(settings, profile),
                             start_s=args.plot_start_s, window_s=args.plot_window_s or None)
        print(f"wrote {args.plot}", file=sys.stderr)
    unfinished = {n: s["num_requests"] - s["finished"] for n, s in summaries.items()
                  if s["finished"] != s["num_requests"]}
    if unfinished:
        print(f"error: requests did not finish: {unfinished}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's per-object INFO lines
    sys.exit(main())
