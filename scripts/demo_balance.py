"""A short, readable demonstration of the balance gate on real vLLM schedulers.

Two DP ranks step in lockstep (as MoE DP engine cores do), each a real ``BalanceScheduler``
(vLLM 0.18 ``Scheduler`` + the gate). After every step each rank's running count is shared as
``balance_gather`` would leave it. The same workload runs with balance off, then on, and the
demo prints per step what each rank admitted and how many requests it runs:

    .venv/bin/python scripts/demo_balance.py [--steps N]

With balance on, rank 1 does not admit new requests while rank 0 is at its cap, so admissions
(prefills, which stall every rank) happen together instead of trickling in step after step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_PLUGINS", "ascend_balance_scheduling")

CAP = 4


def run(model_dir: Path, balance: bool, steps: int) -> list[str]:
    from offline_vllm import build_scheduler, emulate_gather, make_request, make_vllm_config, step
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ascend.core.balance_scheduler import BalanceScheduler

    config = make_vllm_config(model_dir, max_num_seqs=CAP, dp_size=2)
    ranks = [build_scheduler(BalanceScheduler if balance else Scheduler, config) for _ in range(2)]
    # Rank 0: a full batch of long requests. Rank 1: short requests arriving continuously.
    for i in range(CAP):
        ranks[0].add_request(make_request(f"long{i}", num_prompt_tokens=32, max_tokens=12))
    lines = []
    for index in range(steps):
        if index % 2 == 0:
            ranks[1].add_request(make_request(f"s{index}", num_prompt_tokens=32, max_tokens=3 + index % 5))
        admitted: list[list[str]] = []
        for scheduler in ranks:
            output, _ = step(scheduler)
            admitted.append([r.req_id for r in output.scheduled_new_reqs])
        counts = [len(s.running) for s in ranks]
        if balance:
            emulate_gather(ranks)
        prefill = any(admitted)
        gate = "closed" if balance and ranks[1].balance_gate_closed() else "open"
        lines.append(
            f"{index:>4}  {counts[0]:>3} {counts[1]:>3}   {gate:<6}  "
            f"{'PREFILL' if prefill else '       '}  "
            f"r0+{','.join(admitted[0]) or '-':<22} r1+{','.join(admitted[1]) or '-'}"
        )
    prefill_steps = sum("PREFILL" in line for line in lines)
    lines.append(f"steps with a prefill (every rank waits for it): {prefill_steps} of {steps}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="lockstep steps to show")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    from offline_vllm import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "tiny-llama")
        for balance in (False, True):
            print(f"\n=== balance scheduling {'ON' if balance else 'OFF'} (DP=2, max_num_seqs={CAP})")
            print("step  run0 run1  next   phase    admitted this step   (run = running after the step;")
            print("                 gate                       next gate = from the counts just gathered)")
            for line in run(model_dir, balance, args.steps):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
