"""One simulated benchmark run: client, router, lockstep cluster, cost model and recorder.

The clock is simulated: each lockstep step advances it by the cost model's price of the slowest
rank. Requests sent while a step runs reach their rank before the next step, as the engine's
input queue does. When no rank has work, the clock jumps to the next send (the DP ranks idle).
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dpsim.cluster import LockstepCluster, prepare_model_dir, sim_request
from dpsim.costmodel import CostProfile
from dpsim.metrics import RunRecorder, RunResult
from dpsim.router import make_router
from dpsim.settings import SimSettings
from dpsim.workload import Client, sample_shapes

# Far more steps than any sane run needs: a stuck run fails instead of spinning forever.
MAX_STEPS_PER_OUTPUT_TOKEN = 50

ProgressHook = Callable[[int], None]


class SimulationStuck(RuntimeError):
    """Requests remain but no rank makes progress (a bug, or a gate that never reopens)."""


def run(settings: SimSettings, profile: CostProfile, balance: bool,
        model_dir: Path | None = None, progress: ProgressHook | None = None) -> RunResult:
    """Simulate the whole benchmark once; ``progress(n)`` is told of n newly finished requests."""
    started = time.perf_counter()
    if model_dir is None:
        model_dir = prepare_model_dir(Path(tempfile.mkdtemp(prefix="dpsim-model-")),
                                      settings.max_model_len)
    cluster = LockstepCluster(
        model_dir, dp_size=settings.dp_size, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len, balance=balance, gate=settings.gate)
    # Same seed for both runs of a comparison: identical lengths and client jitter draws.
    shapes = sample_shapes(settings.num_requests, settings.prompt_tokens, settings.output_tokens,
                           settings.prompt_spread, settings.output_spread,
                           random.Random(settings.seed))
    client = Client(settings.num_requests, settings.concurrency, settings.request_rate,
                    settings.jitter_ms / 1000.0, random.Random(settings.seed + 1))
    router = make_router(settings.router, settings.dp_size, cluster.counts,
                         settings.lb_stats_interval_ms / 1000.0)
    recorder = RunRecorder(settings.num_requests)
    max_steps = MAX_STEPS_PER_OUTPUT_TOKEN * settings.num_requests * (
        settings.output_tokens + settings.prompt_tokens) // max(settings.max_num_seqs, 1) + 1000

    now = 0.0
    remaining = settings.num_requests
    while remaining:
        for sent_at, index in client.due(now):
            recorder.sent(index, sent_at)
            rank = router.route(sent_at)
            cluster.schedulers[rank].add_request(sim_request(str(index), shapes[index], sent_at))
        if not cluster.has_unfinished():
            next_send = client.next_send_time()
            if next_send is None:
                raise SimulationStuck(f"{remaining} requests never sent (client bug)")
            now = max(now, next_send)
            continue
        work = cluster.schedule()
        slowest = max(profile.rank_ms(w.prefill_tokens, w.decode_requests) for w in work)
        now += profile.step_s(slowest)
        produced, finished = cluster.finish()
        for request_id in produced:
            recorder.produced(int(request_id), now)
        for request_id in finished:
            recorder.done(int(request_id), now)
            client.finished(now)
        remaining -= len(finished)
        if finished and progress is not None:
            progress(len(finished))
        recorder.step(now, work, cluster.running())
        router.observe(now)
        if recorder.steps > max_steps:
            raise SimulationStuck(
                f"{remaining} requests unfinished after {recorder.steps} steps "
                f"(running per rank: {cluster.running()}, gate closed: {cluster.gate_closed()})")
    return recorder.result(settings.dp_size, cluster.gated_steps(),
                           time.perf_counter() - started)
