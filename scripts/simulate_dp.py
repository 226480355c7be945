#!/usr/bin/env python3
"""Simulate DP serving on real vLLM schedulers: balance scheduling, vLLM's prefill cadence, or none.

Why: the balance-scheduling evidence is one table measured on NPUs. This reproduces its workload
on CPU: N DP ranks, each a real vLLM scheduler (balance on: ``BalanceScheduler``), stepped in
lockstep like MoE DP engine cores with fake model outputs (MTP acceptance drawn per request),
priced by a JSON profile, so anyone can see when balance scheduling helps, compare it with what
vLLM itself offers, and see how the answer depends on each assumption (docs/simulator.md).

    scripts/simulate_dp.py --preset rfc-dsv31 --compare --json out.json --plot out.png
    scripts/simulate_dp.py --preset rfc-dsv31 --compare-policies --json p.json --plot p.png
    scripts/simulate_dp.py --preset rfc-dsv31 --sweep acceptance_rate_spread=0,0.1,0.2
    scripts/simulate_dp.py --preset rfc-dsv31 --compare-gates --remote-kv-fraction 0.25
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # offline_vllm and dpsim

from dpsim.costmodel import CostProfile, ProfileError, load_profile  # noqa: E402
from dpsim.params import ParamError, apply, parse_assignment, parse_sweep  # noqa: E402
from dpsim.router import ROUTERS  # noqa: E402
from dpsim.settings import (  # noqa: E402
    GATE_ARMS,
    GATES,
    OFF_ON,
    POLICIES,
    PRESETS,
    Arm,
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
    ("  first wave (ms)", "ttft_first_wave_ms", "{:.0f}"),
    ("  later (ms)", "ttft_later_ms", "{:.0f}"),
    ("  remote KV (ms)", "ttft_remote_kv_ms", "{:.0f}"),
    ("  local prefill (ms)", "ttft_local_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("TPOT mean (ms)", "tpot_mean_ms", "{:.2f}"),
    ("  remote KV (ms)", "tpot_remote_kv_ms", "{:.2f}"),
    ("  local prefill (ms)", "tpot_local_ms", "{:.2f}"),
    ("TPOT p99 (ms)", "tpot_p99_ms", "{:.2f}"),
    ("ITL p50 (ms)", "itl_p50_ms", "{:.1f}"),
    ("ITL mean (ms)", "itl_mean_ms", "{:.1f}"),
    ("e2e (s)", "e2e_s", "{:.1f}"),
    ("finished", "finished", "{:d}"),
    ("steps", "steps", "{:d}"),
    ("tokens / chunk", "tokens_per_chunk", "{:.2f}"),
    ("admission steps", "admission_steps", "{:d}"),
    ("stalled decode steps", "stalled_decode_steps", "{:d}"),
    ("gated rank-steps", "gated_rank_steps", "{:d}"),
    ("admitted while gated", "gated_admissions", "{:d}"),
    ("deferred rank-steps", "deferred_rank_steps", "{:d}"),
    ("mean running / rank", "mean_running_per_rank", "{:.1f}"),
    ("simulation wall (s)", "sim_wall_s", "{:.1f}"),
    ("simulation CPU (s)", "sim_cpu_s", "{:.1f}"),
)
NO_CHANGE = {"finished", "sim_wall_s", "sim_cpu_s", "gated_rank_steps", "deferred_rank_steps", "gated_admissions"}
# Headline figures of a sweep line.
SWEEP_KEYS = (("tok/s", "output_tok_s"), ("TPOT", "tpot_mean_ms"), ("TTFT", "ttft_mean_ms"))


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
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", default="rfc-dsv31", help=f"base settings; one of: {', '.join(PRESETS)}")
    parser.add_argument("--profile", type=Path, help="JSON profile (default: the preset's)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compare", action="store_true", help="run balance off and on")
    mode.add_argument(
        "--compare-policies",
        action="store_true",
        help="run " + ", ".join(a.label for a in POLICIES) + " (vLLM's "
        "--prefill-schedule-interval reproduced on the step counter)",
    )
    mode.add_argument(
        "--sweep",
        metavar="PARAM=v1,v2,...",
        help="balance off and on for each value of one profile or settings "
        "parameter (e.g. acceptance_rate_spread=0,0.1,0.2)",
    )
    mode.add_argument(
        "--compare-gates",
        action="store_true",
        help="run " + ", ".join(a.label for a in GATE_ARMS) + " (whether requests holding KV, e.g. loaded "
        "remote KV, may enter under the gate; with --remote-kv-fraction)",
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --sweep: fit the profile's costs on the preset's baseline row "
        "again for each value before predicting balance on (the "
        "sensitivity of the prediction, not of both rows)",
    )
    mode.add_argument(
        "--calibrate",
        type=Path,
        metavar="OUT.json",
        help="fit the profile's step costs on the preset's published baseline "
        "(balance-off) row only and write the calibrated profile here",
    )
    mode.add_argument(
        "--balance", choices=("off", "on"), default="on", help="single run with balance scheduling off or on"
    )
    mode.add_argument(
        "--fit-trace",
        type=Path,
        metavar="RUNS.json",
        help="fit the step costs on a real engine's step trace (scripts/bench_engine.py's runs.json), one arm "
        "(--arm); prints the fit of every cost structure; with --profile-out writes the profile",
    )
    mode.add_argument(
        "--check-against",
        type=Path,
        metavar="RUNS.json",
        help="preset real-cpu: fit the costs on the bench's balance-off arm (runs.json, or bench.json beside "
        "it), simulate every regime and arm, print predicted vs measured change vs off",
    )
    parser.add_argument("--arm", default="off", help="with --fit-trace: the bench arm to fit on")
    parser.add_argument("--regimes", help="with --fit-trace: comma-separated bench regimes to fit on (default: all)")
    parser.add_argument(
        "--fit-model",
        choices=("max", "sum", "both"),
        default="both",
        help="cost structure of --fit-trace/--check-against: slowest rank's work, totals over ranks, or both",
    )
    parser.add_argument("--profile-out", type=Path, help="with --fit-trace: write the fitted profile here")
    parser.add_argument("--hold-out", help="with --check-against: fit without this regime's runs (predict it)")
    parser.add_argument(
        "--seeds",
        type=_positive_int,
        default=1,
        help="preset real-cpu: the mean over this many seeds per regime and arm",
    )
    parser.add_argument(
        "--fit-delay",
        action="store_true",
        help="with --check-against: fit the front end's arrival_delay_ms on the off arm's TTFT as well "
        "(default: the profile's)",
    )
    parser.add_argument(
        "--calibrate-knob",
        choices=("prefill_ms_per_token", "prefill_step_overhead_ms"),
        help="with --calibrate: the prefill cost to fit (default: the preset's)",
    )
    parser.add_argument(
        "--interval", type=_positive_int, default=1, help="single run: vLLM's --prefill-schedule-interval (1: off)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PARAM=VALUE",
        help="override one profile or settings parameter (repeatable)",
    )
    parser.add_argument(
        "--gate",
        choices=GATES,
        help="gate rule when balance is on: 'adaptive' (the product's default: holds only up to the measured cost of "
        "a prefill step), 'cap' (some rank at max_num_seqs), 'cap-1' (within one of it) or 'admit-kv-holding' (cap, "
        "but requests holding KV still enter under it, vLLM >= 0.32's PAUSED_NEW)",
    )
    group = parser.add_argument_group("deployment (overrides the preset)")
    group.add_argument("--dp-size", type=_positive_int)
    group.add_argument("--max-num-seqs", type=_positive_int, help="per-rank cap")
    group.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="per-rank token budget per step, shared by prefill chunks and decodes (k+1 tokens each under MTP)",
    )
    group = parser.add_argument_group("workload (overrides the preset)")
    group.add_argument("--num-requests", type=_positive_int)
    group.add_argument(
        "--concurrency", type=_positive_int, help="closed loop: requests in flight (caps Poisson arrivals too)"
    )
    group.add_argument("--no-concurrency-limit", action="store_true", help="Poisson arrivals without a concurrency cap")
    group.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s")
    group.add_argument("--prompt-tokens", type=_positive_int)
    group.add_argument("--output-tokens", type=_positive_int)
    group.add_argument(
        "--prompt-spread", type=float, help="lengths uniform in [L(1-s), L(1+s)] (vllm bench's range ratio)"
    )
    group.add_argument("--output-spread", type=float, help="as --prompt-spread, for outputs")
    group.add_argument("--jitter-ms", type=float, help="each send delayed by uniform [0, J] ms (client-side asymmetry)")
    group.add_argument(
        "--router",
        choices=ROUTERS,
        help="'lb' = vLLM's DP load balancer (4*waiting+running), 'round-robin' ignores load",
    )
    group.add_argument("--seed", type=int)
    group.add_argument(
        "--remote-kv-fraction",
        type=float,
        help="share of requests arriving with their prompt's KV remote (P/D decode side; fake async connector)",
    )
    group.add_argument("--remote-kv-delay-steps", type=_positive_int, help="model steps a remote KV load takes")
    parser.add_argument("--json", type=Path, help="write {arm: {...}} (sweep: a list) here")
    parser.add_argument("--plot", type=Path, help="write the comparison figure (PNG) here")
    parser.add_argument(
        "--plot-start-s", type=float, help="start of the running-count panels (default: a quarter into the run)"
    )
    parser.add_argument(
        "--plot-window-s", type=float, default=60.0, help="time span of the running-count panels (0: to the end)"
    )
    parser.add_argument(
        "--jobs", type=_positive_int, default=2, help="processes for the runs of a comparison (they are independent)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Preset, SimSettings, CostProfile]:
    """Preset + overrides + profile, or exit with a clear message (status 2)."""
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; available: {', '.join(PRESETS)}")
    preset = PRESETS[args.preset]
    settings = with_overrides(
        preset.settings,
        dp_size=args.dp_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        prompt_spread=args.prompt_spread,
        output_spread=args.output_spread,
        jitter_ms=args.jitter_ms,
        router=args.router,
        profile=args.profile,
        gate=args.gate,
        seed=args.seed,
        remote_kv_fraction=args.remote_kv_fraction,
        remote_kv_delay_steps=args.remote_kv_delay_steps,
    )
    if args.no_concurrency_limit:
        if args.concurrency is not None:
            parser.error("--concurrency and --no-concurrency-limit contradict each other")
        settings = dataclasses.replace(settings, concurrency=None)
    found = problems(settings)
    if found:
        parser.error("; ".join(found))
    try:
        profile = load_profile(settings.profile)
        settings, profile = apply(settings, profile, dict(parse_assignment(text) for text in args.set))
    except (ProfileError, ParamError) as exc:
        parser.error(str(exc))
    return preset, settings, profile


@dataclass(frozen=True)
class Job:
    key: str
    settings: SimSettings
    profile: CostProfile
    arm: Arm


def _run_job(job: Job, model_dir: Path, show_progress: bool, position: int) -> Any:
    import torch
    from dpsim.simulation import run
    from tqdm import tqdm

    torch.set_num_threads(1)
    with tqdm(
        total=job.settings.num_requests,
        desc=job.key,
        unit="req",
        position=position,
        file=sys.stderr,
        disable=not show_progress,
        leave=True,
        dynamic_ncols=True,
    ) as bar:
        return run(job.settings, job.profile, job.arm, model_dir=model_dir, progress=bar.update)


def run_jobs(jobs: list[Job], processes: int, show_progress: bool) -> dict[str, Any]:
    from dpsim.cluster import prepare_model_dir

    model_dir = prepare_model_dir(
        Path(tempfile.mkdtemp(prefix="dpsim-model-")), max(job.settings.max_model_len for job in jobs)
    )
    if processes == 1 or len(jobs) == 1:
        return {job.key: _run_job(job, model_dir, show_progress, 0) for job in jobs}
    # fork: the children inherit the imported vLLM instead of importing it again.
    with ProcessPoolExecutor(max_workers=min(processes, len(jobs)), mp_context=get_context("fork")) as pool:
        futures = [
            pool.submit(_run_job, job, model_dir, show_progress, position % processes)
            for position, job in enumerate(jobs)
        ]
        return {job.key: future.result() for job, future in zip(jobs, futures)}


def _change(base: float, value: float) -> str:
    if not base or math.isnan(base) or math.isnan(value):
        return ""
    return f"{(value - base) / base * 100:+.1f}%"


def _fmt(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def same_workload(settings: SimSettings, preset: Preset) -> bool:
    """Whether the paper's figures are comparable: only profile, seed or gate rule changed."""
    ignored = {"profile": preset.settings.profile, "seed": preset.settings.seed, "gate": preset.settings.gate}
    return dataclasses.replace(settings, **ignored) == preset.settings


# What the benchmark client did: a published row can be calibrated on with any deployment
# assumption (DP size, router...), never with another workload.
WORKLOAD_FIELDS = (
    "num_requests",
    "concurrency",
    "request_rate",
    "prompt_tokens",
    "output_tokens",
    "prompt_spread",
    "output_spread",
)


def same_client_workload(settings: SimSettings, preset: Preset) -> bool:
    return all(getattr(settings, f) == getattr(preset.settings, f) for f in WORKLOAD_FIELDS)


def _layout(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_table(summaries: dict[str, dict[str, Any]], arms: list[Arm], preset: Preset, with_paper: bool = True) -> str:
    """Arms side by side (changes vs the first arm), then the paper's figures when comparable."""
    paper = {a.name: preset.paper[a.name] for a in arms if with_paper and a.name in preset.paper}
    two = len(arms) == 2
    header = ["metric"] + [a.label for a in arms] + (["change"] if two else [])
    for name in paper:
        header += [f"paper {name}", f"{name} vs paper"]
    if two and len(paper) == 2:
        header.append("paper change")
    rows = [header]
    base = summaries[arms[0].name]
    for label, key, fmt in TABLE_ROWS:
        if all(key not in summaries[a.name] for a in arms):
            continue  # a figure of a mechanism these runs do not have (remote KV)
        row = [label]
        for index, arm in enumerate(arms):
            value = summaries[arm.name].get(key)
            cell = _fmt(fmt, value)
            if not two and index and key not in NO_CHANGE and value is not None:
                cell += f" {_change(float(base.get(key, math.nan)), float(value)):>7}"
            row.append(cell)
        if two:
            off, on = (summaries[a.name].get(key) for a in arms)
            row.append(
                _change(float(off), float(on)) if key not in NO_CHANGE and off is not None and on is not None else ""
            )
        for name, figures in paper.items():
            if key in figures:
                row += [fmt.format(figures[key]), _change(figures[key], float(summaries[name].get(key, math.nan)))]
            else:
                row += ["", ""]
        if two and len(paper) == 2:
            off_p, on_p = (paper[a.name].get(key) for a in arms)
            row.append(_change(off_p, on_p) if off_p is not None and on_p is not None else "")
        rows.append(row)
    return _layout(rows)


def format_sweep(
    name: str, values: list[str], summaries: dict[str, dict[str, Any]], fitted: dict[str, CostProfile] | None = None
) -> str:
    header = [name, "off tok/s", "on tok/s"] + [f"{label} on vs off" for label, _ in SWEEP_KEYS]
    header += ["off TTFT ms", "on TTFT ms", "off TPOT ms", "on TPOT ms"]
    if fitted:
        header.append("fitted costs (overhead, decode, per token, per prefill step; ms)")
    rows = [header]
    for value in values:
        key = f"{name}={value}"
        off, on = summaries[f"{key} off"], summaries[f"{key} on"]
        rows.append(
            [value, f"{off['output_tok_s']:.1f}", f"{on['output_tok_s']:.1f}"]
            + [_change(off[k], on[k]) for _, k in SWEEP_KEYS]
            + [
                f"{off['ttft_mean_ms']:.0f}",
                f"{on['ttft_mean_ms']:.0f}",
                f"{off['tpot_mean_ms']:.2f}",
                f"{on['tpot_mean_ms']:.2f}",
            ]
        )
        if fitted:
            p = fitted[key]
            rows[-1].append(
                f"{p.step_overhead_ms:g}, {p.decode_ms_per_request:g}, "
                f"{p.prefill_ms_per_token:g}, {p.prefill_step_overhead_ms:g}"
            )
    return _layout(rows)


def describe(settings: SimSettings, profile: CostProfile) -> str:
    arrivals = (
        f"closed loop, concurrency {settings.concurrency}"
        if settings.request_rate is None
        else f"Poisson {settings.request_rate} req/s, concurrency cap {settings.concurrency}"
    )
    mtp = (
        f"MTP k={profile.num_speculative_tokens} acceptance "
        f"{profile.acceptance_rate_mean:g}±{profile.acceptance_rate_spread:g}"
        if profile.num_speculative_tokens
        else "no MTP"
    )
    return (
        f"DP {settings.dp_size} x max_num_seqs {settings.max_num_seqs}, "
        f"max_num_batched_tokens {settings.max_num_batched_tokens}; "
        f"{settings.num_requests} requests {settings.prompt_tokens}"
        f"(±{settings.prompt_spread:.0%})/{settings.output_tokens}"
        f"(±{settings.output_spread:.0%}) tokens, {arrivals}, jitter {settings.jitter_ms} ms, "
        f"router {settings.router}; gate {settings.gate}; profile {profile.name}: "
        f"{profile.step_overhead_ms:g} ms + {profile.decode_ms_per_request:g} ms/decode req + "
        f"{profile.prefill_ms_per_token:g} ms/prefill token + "
        f"{profile.prefill_step_overhead_ms:g} ms/prefill step, noise cv "
        f"{profile.step_noise_cv:g}, {mtp}, async scheduling "
        f"{'on' if profile.async_scheduling else 'off'}, coordinator publish "
        f"{profile.coordinator_publish_ms:g} ms; seed {settings.seed}"
        + (
            f"; every rank pays {profile.prefill_ms_per_token_all_ranks:g} ms per prefill token and "
            f"{profile.decode_ms_per_request_all_ranks:g} ms per decoding request of any rank"
            if profile.prefill_ms_per_token_all_ranks or profile.decode_ms_per_request_all_ranks
            else ""
        )
        + (
            f"; arrival delay {profile.arrival_delay_ms:g} ms ± {profile.arrival_delay_spread:.0%}"
            if profile.arrival_delay_ms
            else ""
        )
        + (
            f"; remote KV {settings.remote_kv_fraction:.0%} of requests, loads take "
            f"{settings.remote_kv_delay_steps} steps, their one-token step priced as "
            f"{'prefill' if settings.remote_kv_step_prefill else 'decode'}"
            if settings.remote_kv_fraction
            else ""
        )
    )


def _payload(summary: dict[str, Any], settings: SimSettings, profile: CostProfile) -> dict:
    used = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(settings).items()}
    return {**summary, "settings": used, "profile": {"name": profile.name, **profile.values()}}


def _calibrated(
    args: argparse.Namespace,
    preset: Preset,
    settings: SimSettings,
    profile: CostProfile,
    parser: argparse.ArgumentParser,
) -> tuple[CostProfile, dict[str, Any]]:
    """``profile`` with its costs fitted on the preset's baseline row, and that row's summary."""
    from dpsim.calibration import calibrate

    if "off" not in preset.paper or not same_client_workload(settings, preset):
        parser.error(
            "calibrating needs a preset with a published baseline row, and its "
            f"workload unchanged ({', '.join(WORKLOAD_FIELDS)})"
        )
    knob = args.calibrate_knob or preset.calibrate_knob

    def run_off(profiles: list[CostProfile]) -> list[dict[str, Any]]:
        jobs = [Job(f"off {i}", settings, p, OFF_ON[0]) for i, p in enumerate(profiles)]
        results = run_jobs(jobs, args.jobs, not args.no_progress)
        return [results[job.key].summary for job in jobs]

    print(
        f"calibrating {settings.profile}: {knob} on {preset.source}'s baseline {' and '.join(preset.calibrate_on)}",
        flush=True,
    )
    return calibrate(profile, preset.paper["off"], preset.calibrate_on, knob, run_off, lambda s: print(s, flush=True))


def calibrate_profile(
    args: argparse.Namespace,
    preset: Preset,
    settings: SimSettings,
    profile: CostProfile,
    parser: argparse.ArgumentParser,
) -> int:
    try:
        calibrated, _ = _calibrated(args, preset, settings, profile, parser)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data = json.loads(settings.profile.read_text())
    data.update(calibrated.values())
    args.calibrate.parent.mkdir(parents=True, exist_ok=True)
    args.calibrate.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.calibrate}", flush=True)
    return 0


def fit_trace(args: argparse.Namespace) -> int:
    from dpsim.trace_fit import describe_fits, fit_all, load_runs, profile_data, steps_of

    runs = load_runs(args.fit_trace, args.arm, args.regimes.split(",") if args.regimes else None)
    if not runs:
        print(f"error: no runs of arm {args.arm!r} in {args.fit_trace}", file=sys.stderr)
        return 1
    fits = fit_all(steps_of(runs))
    print(f"{len(runs)} run(s) of arm {args.arm}: " + ", ".join(sorted({r["regime"] for r in runs})))
    print(describe_fits(fits))
    if args.profile_out is not None:
        data = profile_data(fits[args.fit_model], fits, str(args.fit_trace))
        from dpsim.costmodel import profile_from_dict

        profile_from_dict(data, str(args.profile_out))  # checked like any profile before it is written
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        args.profile_out.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.profile_out} (model {args.fit_model})")
    return 0


def real_engine_sims(args: argparse.Namespace, profile: CostProfile, settings_over: dict[str, str]):
    """{(regime, arm): (settings, arm, cost overrides)} -> {(regime, arm): summary}, every run at once;
    with ``--seeds N`` each figure is the mean over seeds 0..N-1 (small closed loops depend on chance)."""
    from dpsim.costmodel import with_values

    def run_sims(keys: dict[tuple[str, str], Any]) -> dict[tuple[str, str], dict[str, Any]]:
        jobs, names = [], {}
        for (regime, arm_name), (settings, arm, costs) in keys.items():
            s, p = apply(settings, with_values(profile, costs, "fit"), settings_over)
            for seed in range(args.seeds):
                key = f"{regime} {arm_name} seed {seed}"
                names[key] = (regime, arm_name)
                jobs.append(Job(key, dataclasses.replace(s, seed=s.seed + seed), p, arm))
        results = run_jobs(jobs, args.jobs, not args.no_progress)
        grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for key, result in results.items():
            grouped.setdefault(names[key], []).append(result.summary)
        return {
            name: {
                k: sum(x[k] for x in summaries) / len(summaries)
                for k in summaries[0]
                if all(isinstance(x.get(k), (int, float)) and not isinstance(x.get(k), bool) for x in summaries)
            }
            for name, summaries in grouped.items()
        }

    return run_sims


def check_real(args: argparse.Namespace, profile: CostProfile) -> int:
    from dpsim.real_check import check
    from dpsim.settings import REAL_CPU_REGIMES
    from dpsim.trace_fit import describe_fits

    if args.hold_out is not None and args.hold_out not in REAL_CPU_REGIMES:
        print(f"error: unknown regime {args.hold_out!r}; one of {', '.join(REAL_CPU_REGIMES)}", file=sys.stderr)
        return 2
    overrides = dict(parse_assignment(text) for text in args.set)
    settings_over = {k: v for k, v in overrides.items() if k in SimSettings.__dataclass_fields__}
    text, fit, fits = check(
        args.check_against,
        real_engine_sims(args, profile, settings_over),
        args.hold_out,
        args.fit_model,
        fit_delay=args.fit_delay,
    )
    print("fitted on the balance-off arm" + (f" without {args.hold_out}" if args.hold_out else "") + ":")
    print(describe_fits(fits))
    print(f"mechanisms: {', '.join(f'{k}={v}' for k, v in profile.values().items() if k not in fit.coefficients)}")
    print("change vs off in % (sim: predicted; real: measured medians; re-priced: measured schedule at one speed)")
    print(text, flush=True)
    return 0


def policies_real(args: argparse.Namespace, profile: CostProfile) -> int:
    """``--preset real-cpu --compare-policies``: the bench's arms over every regime, the shipped profile."""
    from dpsim.real_check import table
    from dpsim.settings import REAL_CPU_ARMS, REAL_CPU_REGIMES

    overrides = dict(parse_assignment(text) for text in args.set)
    settings_over = {k: v for k, v in overrides.items() if k in SimSettings.__dataclass_fields__}
    keys = {(g, a): (s, arm, {}) for g, s in REAL_CPU_REGIMES.items() for a, arm in REAL_CPU_ARMS.items()}
    predicted = real_engine_sims(args, profile, settings_over)(keys)
    print(describe(REAL_CPU_REGIMES["closed-4-fixed"], profile).split("; profile")[1])
    print("predicted change vs off in %")
    print(table(predicted, None, list(REAL_CPU_REGIMES)), flush=True)
    for (g, a), summary in predicted.items():
        print(
            f"  {g:17} {a:18} {summary['output_tok_s']:7.1f} tok/s  TPOT {summary['tpot_mean_ms']:6.2f}  "
            f"TTFT {summary['ttft_mean_ms']:6.0f}  steps {summary['steps']}  gated {summary.get('gated_rank_steps', 0)}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fit_trace is not None:
        return fit_trace(args)
    preset, settings, profile = resolve(parser, args)
    if args.check_against is not None or (args.preset == "real-cpu" and args.compare_policies):
        if args.preset != "real-cpu":
            parser.error("--check-against goes with --preset real-cpu")
        status = check_real(args, profile) if args.check_against is not None else policies_real(args, profile)
        print(f"wall time {time.perf_counter() - started:.1f} s", flush=True)
        return status
    if args.calibrate is not None:
        status = calibrate_profile(args, preset, settings, profile, parser)
        print(f"wall time {time.perf_counter() - started:.1f} s", flush=True)
        return status
    if args.interval > 1 and (args.compare or args.compare_policies or args.compare_gates or args.sweep):
        parser.error("--interval is for a single run (the comparisons choose their own)")
    if args.recalibrate and not args.sweep:
        parser.error("--recalibrate goes with --sweep")
    sweep: tuple[str, list[str]] | None = None
    if args.sweep:
        try:
            sweep = parse_sweep(args.sweep)
            variants = [(f"{sweep[0]}={v}", *apply(settings, profile, {sweep[0]: v})) for v in sweep[1]]
        except ParamError as exc:
            parser.error(str(exc))
        fitted: dict[str, dict[str, Any]] = {}
        if args.recalibrate:
            try:
                for index, (key, s, p) in enumerate(variants):
                    print(f"{key}:", flush=True)
                    calibrated, fitted[f"{key} off"] = _calibrated(args, preset, s, p, parser)
                    variants[index] = (key, s, calibrated)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
        # A recalibrated variant's baseline run is the calibration's last run (deterministic).
        jobs = [
            Job(f"{key} {arm.name}", s, p, arm)
            for key, s, p in variants
            for arm in OFF_ON
            if f"{key} {arm.name}" not in fitted
        ]
        arms: list[Arm] = list(OFF_ON)
    else:
        if args.compare_policies:
            arms = list(POLICIES)
        elif args.compare_gates:
            arms = list(GATE_ARMS)
        elif args.compare:
            arms = list(OFF_ON)
        else:
            arms = [
                Arm(
                    args.balance if args.interval == 1 else f"{args.balance}+interval-{args.interval}",
                    args.balance == "on",
                    args.interval,
                )
            ]
        jobs = [Job(arm.name, settings, profile, arm) for arm in arms]
    print(describe(settings, profile), flush=True)
    results = run_jobs(jobs, args.jobs, not args.no_progress)
    summaries = {key: result.summary for key, result in results.items()}
    if sweep is not None:
        summaries.update(fitted)
        print(
            format_sweep(sweep[0], sweep[1], summaries, {key: p for key, _, p in variants} if fitted else None),
            flush=True,
        )
        payload: Any = [
            {"value": v, **{arm.name: _payload(summaries[f"{key} {arm.name}"], s, p) for arm in OFF_ON}}
            for v, (key, s, p) in zip(sweep[1], variants)
        ]
    else:
        print(format_table(summaries, arms, preset, same_workload(settings, preset)), flush=True)
        payload = {key: _payload(summary, settings, profile) for key, summary in summaries.items()}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None and sweep is None:
        from dpsim.plotting import save_comparison_plot, save_policies_plot

        title = describe(settings, profile)
        if args.compare_policies:
            save_policies_plot(results, arms, args.plot, title)
        else:
            save_comparison_plot(
                results, args.plot, title, start_s=args.plot_start_s, window_s=args.plot_window_s or None
            )
        print(f"wrote {args.plot}", file=sys.stderr)
    walls = [s["sim_wall_s"] for s in summaries.values()]
    print(
        f"wall time {time.perf_counter() - started:.1f} s ({len(jobs)} run(s), "
        f"{min(args.jobs, len(jobs))} process(es); longest run {max(walls):.1f} s)",
        flush=True,
    )
    unfinished = {
        n: s["num_requests"] - s["finished"] for n, s in summaries.items() if s["finished"] != s["num_requests"]
    }
    if unfinished:
        print(f"error: requests did not finish: {unfinished}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's per-object INFO lines
    sys.exit(main())
