#!/usr/bin/env python
"""Multi-process soak of balance scheduling in vLLM's DP engine loop (MoE lockstep, CPU only).

Starts ``--dp`` OS processes joined in a real ``torch.distributed`` gloo group on 127.0.0.1.
Each runs a real vLLM balance scheduler (``VLLM_ASCEND_BALANCE_SCHEDULING=1``, built through the
plugin) inside a ``BalanceDPEngineCoreProc`` driven step by step like
``DPEngineCoreProc.run_busy_loop`` (see ``soak/rank.py``); the model, a grammar backend and a
KV transfer are CPU fakes (``soak/fakes.py``, ``fake_remote_kv.py``).

    python scripts/dp_soak.py --dp 4 --requests 400 --scenario all --timeout 300

Prints one JSON summary line ``{"submitted", "finished", "gathers_per_rank", "max_step_skew",
"hung", "seconds", ...}`` and exits 1 on a hang (watchdog: no result within --timeout), a lost or
duplicated request, unequal gather counts, ranks that gathered different values, a rank whose
own gathered slot is not its running count, or a request admitted while the gate was closed.

    python scripts/dp_soak.py --dp 4 --stock-ranks 1,3

runs the given ranks as stock vLLM (a node without balance scheduling): the start-up agreement
must refuse the group on every balanced rank and every process must exit. The summary is then
``{"stock_ranks", "refused", "refusals", "seconds_to_last_exit", "stock_failed_after_s" (from the
first balanced rank's exit to the last stock rank's failure), "hung", "ok", "problems"}``
(``VLLM_ASCEND_BALANCE_AGREEMENT_TIMEOUT_S`` bounds the agreement's wait).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # offline_vllm, soak

from soak.plan import SCENARIOS  # noqa: E402

CAP = 4  # max_num_seqs per rank: small, so the gate closes often


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _configs(model_dir: Path, dp: int) -> dict[str, Any]:
    from fake_remote_kv import async_kv_transfer_config
    from offline_vllm import make_vllm_config

    kv = async_kv_transfer_config()
    common = {"max_num_seqs": CAP, "max_num_batched_tokens": 256, "dp_size": dp}
    return {
        "plain": make_vllm_config(model_dir, **common),
        "kv": make_vllm_config(model_dir, kv_transfer_config=kv, **common),
    }


def run_soak(
    dp: int,
    requests: int,
    seed: int,
    scenario: str,
    timeout: float,
    model_dir: Path | None = None,
    start_method: str = "fork",
    stock_ranks: tuple[int, ...] = (),
    stall_rank: int | None = None,
) -> dict[str, Any]:
    """Run the soak; return the summary (``ok`` False and ``problems`` listed on failure).

    ``stock_ranks``: ranks that run vLLM's stock engine class (the mismatch run).
    ``stall_rank`` (for the watchdog's test): a rank that never joins, so the run hangs by construction.
    """
    os.environ["VLLM_ASCEND_BALANCE_SCHEDULING"] = "1"
    os.environ.setdefault("VLLM_ASCEND_BALANCE_GATE_RULE", "cap")  # the gate closes from the counts alone
    os.environ.setdefault("VLLM_PLUGINS", "ascend_balance_scheduling")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import multiprocessing

    from offline_vllm import write_tiny_model
    from soak.rank import rank_main

    if dp < 2:
        raise SystemExit("--dp must be at least 2 (DP lockstep needs peers)")
    if stock_ranks and not (set(stock_ranks) < set(range(dp))):
        raise SystemExit(f"--stock-ranks must name some, not all, of the ranks 0..{dp - 1}")
    scenarios = list(SCENARIOS) if scenario == "all" else [scenario]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dp-soak-") as scratch:
        model_dir = model_dir or write_tiny_model(Path(scratch) / "tiny-mixtral", moe=True)
        configs = _configs(model_dir, dp)
        assert configs["plain"].model_config.is_moe
        # fork: ranks inherit the imported vLLM (spawn costs each rank a full vLLM import).
        context = multiprocessing.get_context(start_method)
        port = _free_port()
        paths = [Path(scratch) / f"rank{r}.json" for r in range(dp)]
        processes = [
            context.Process(
                target=rank_main,
                name=f"dp-soak-rank{r}",
                args=(
                    r,
                    dp,
                    port,
                    configs,
                    scenarios,
                    requests,
                    seed,
                    str(paths[r]),
                    r in stock_ranks,
                    r == stall_rank,
                ),
            )
            for r in range(dp)
        ]
        launched = time.monotonic()
        for process in processes:
            process.start()
        deadline = started + timeout
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0.1))
        last_exit = time.monotonic() - launched
        hung = [p.name for p in processes if p.is_alive()]
        for process in processes:
            if process.is_alive():  # only the processes started above, by their handle
                process.kill()
                process.join()
        results = [json.loads(p.read_text()) if p.exists() else None for p in paths]
    if stock_ranks:
        summary = summarize_mismatch(results, list(stock_ranks), hung)
        summary["seconds_to_last_exit"] = None if hung else round(last_exit, 1)
        return summary
    summary = summarize(results, scenarios, hung)
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["start_method"] = start_method
    summary["rank_run_seconds"] = [r.get("run_seconds") if r else None for r in results]
    return summary


def summarize_mismatch(results: list[dict[str, Any] | None], stock_ranks: list[int], hung: list[str]) -> dict[str, Any]:
    """A group with stock ranks: every balanced rank must be refused by the agreement, and every
    stock rank must fail (at its first collective, when the balanced ranks are gone)."""
    problems: list[str] = [f"{name} still running at the timeout (killed)" for name in hung]
    refusals: dict[int, str] = {}
    for rank, result in enumerate(results):
        error = (result or {}).get("error")
        last_line = error.strip().splitlines()[-1] if error else None
        if result is None:
            problems.append(f"rank {rank} wrote no result")
        elif rank in stock_ranks:
            if error is None:
                problems.append(f"stock rank {rank} did not fail")
        elif last_line and last_line.startswith("RuntimeError: Balance scheduling: DP rank"):
            refusals[rank] = last_line
        else:
            problems.append(f"balanced rank {rank} was not refused by the agreement: {last_line}")
    ended = {rank: r["ended"] for rank, r in enumerate(results) if r is not None}
    balanced_ended = [at for rank, at in ended.items() if rank not in stock_ranks]
    stock_ended = [at for rank, at in ended.items() if rank in stock_ranks]
    refused = len(refusals) == len(results) - len(stock_ranks)
    return {
        "stock_ranks": stock_ranks,
        "refused": refused,
        "refusals": refusals,
        "seconds_to_last_exit": None,
        "stock_failed_after_s": round(max(stock_ended) - min(balanced_ended), 2)
        if stock_ended and balanced_ended
        else None,
        "hung": bool(hung),
        "ok": not problems,
        "problems": problems,
    }


def summarize(results: list[dict[str, Any] | None], scenarios: list[str], hung: list[str]) -> dict[str, Any]:
    problems: list[str] = [f"{name} still running at the timeout (killed)" for name in hung]
    submitted: list[str] = []
    finished: list[str] = []
    gathers = [0] * len(results)
    skew = 0
    per_scenario: dict[str, Any] = {}
    for rank, result in enumerate(results):
        if result is None:
            problems.append(f"rank {rank} wrote no result")
        elif "error" in result:
            problems.append(f"rank {rank} failed:\n{result['error']}")
    complete = [r for r in results if r is not None and "error" not in r]
    if len(complete) == len(results):
        for scenario in scenarios:
            ranks = [r["scenarios"][scenario] for r in complete]
            for rank, data in enumerate(ranks):
                submitted += data["submitted"]
                finished += data["finished"]
                gathers[rank] += data["gathers"]
                problems += [f"{scenario} rank {rank}: gate violation {v}" for v in data["gate_violations"]]
                if data["own_slot_mismatches"]:
                    problems.append(
                        f"{scenario} rank {rank}: own gathered slot != len(running) {data['own_slot_mismatches']} times"
                    )
                if data["left_in_scheduler"]:
                    problems.append(f"{scenario} rank {rank}: {data['left_in_scheduler']} requests left unfinished")
            if len({d["gathers"] for d in ranks}) != 1:
                problems.append(f"{scenario}: unequal gathers {[d['gathers'] for d in ranks]}")
            if len({d["digest"] for d in ranks}) != 1:
                problems.append(f"{scenario}: ranks gathered different balance_queue values")
            waves = [d["wave_steps"] for d in ranks]
            if len({len(w) for w in waves}) != 1:
                problems.append(f"{scenario}: ranks ran different numbers of waves")
            else:
                skew = max([skew] + [max(s) - min(s) for s in zip(*waves)])
            per_scenario[scenario] = {
                "requests": sum(len(d["submitted"]) for d in ranks),
                "waves": len(waves[0]),
                "gathers": ranks[0]["gathers"],
                "gated_steps_per_rank": [d["balance_gated_steps"] for d in ranks],
                "dummy_steps_per_rank": [d["dummy_steps"] for d in ranks],
            }
        lost = sorted(set(submitted) - set(finished))
        if lost:
            problems.append(f"{len(lost)} requests never finished: {lost[:10]}")
        if len(finished) != len(set(finished)) or set(finished) - set(submitted):
            problems.append("requests finished twice or without being submitted")
    return {
        "submitted": len(submitted),
        "finished": len(set(finished) & set(submitted)),
        "gathers_per_rank": gathers,
        "max_step_skew": skew,
        "hung": bool(hung),
        "seconds": None,
        "ok": not problems,
        "scenarios": per_scenario,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="DP ranks (OS processes), >= 2")
    parser.add_argument("--requests", type=int, default=40, help="requests over all scenarios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenario", default="all", choices=[*SCENARIOS, "all"])
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="watchdog: seconds until unfinished ranks count as hung"
    )
    parser.add_argument(
        "--start-method",
        default="fork",
        choices=["fork", "spawn"],
        help="how rank processes start (spawn: each imports vLLM itself)",
    )
    parser.add_argument(
        "--stock-ranks",
        default="",
        help="comma-separated ranks running stock vLLM (e.g. 1,3): the start-up "
        "agreement must refuse the group, no process may hang",
    )
    args = parser.parse_args(argv)
    stock_ranks = tuple(int(rank) for rank in args.stock_ranks.split(",") if rank.strip())
    summary = run_soak(
        args.dp,
        args.requests,
        args.seed,
        args.scenario,
        args.timeout,
        start_method=args.start_method,
        stock_ranks=stock_ranks,
    )
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
