"""One simulated benchmark run: client, router, lockstep cluster, cost model and recorder.

The clock is simulated and follows vLLM's DP engine loop (``DPEngineCoreProc.run_busy_loop``),
one iteration at a time: take the requests that arrived, schedule a step on every rank (a step is
queued behind the one executing; with async scheduling the queue holds two, so step n+1 is
scheduled before step n's output is known, as vLLM's batch queue does), wait for the oldest
step to finish (the clock advances by the cost model's price of its slowest rank), update the
schedulers with its output, then end the iteration as ``_has_global_unfinished_reqs`` does: the
balance all-gather and ``step_counter += 1``. When every rank is idle the loop keeps stepping
dummy batches until the counter reaches a multiple of 32 (vLLM's wave check), then the wave ends:
the counter resets to 0 and the clock jumps to the next send.
"""

from __future__ import annotations

import heapq
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dpsim.cadence import WAVE_CHECK_STEPS
from dpsim.cluster import Batch, LockstepCluster, prepare_model_dir, sim_request
from dpsim.costmodel import CostProfile
from dpsim.metrics import RunRecorder, RunResult
from dpsim.remote_kv import remote_kv_requests
from dpsim.router import make_router
from dpsim.settings import Arm, SimSettings
from dpsim.speculative import AcceptanceModel
from dpsim.workload import Client, sample_shapes

# Far more iterations than any sane run needs: a stuck run fails instead of spinning forever.
MAX_STEPS_PER_OUTPUT_TOKEN = 50

ProgressHook = Callable[[int], None]


class SimulationStuck(RuntimeError):
    """Requests remain but no rank makes progress (a bug, or a gate that never reopens)."""


def run(
    settings: SimSettings,
    profile: CostProfile,
    arm: Arm,
    model_dir: Path | None = None,
    progress: ProgressHook | None = None,
) -> RunResult:
    """Simulate the whole benchmark once; ``progress(n)`` is told of n newly finished requests."""
    started, cpu_started = time.perf_counter(), time.process_time()
    if model_dir is None:
        model_dir = prepare_model_dir(Path(tempfile.mkdtemp(prefix="dpsim-model-")), settings.max_model_len)
    remote = remote_kv_requests(settings.num_requests, settings.remote_kv_fraction, random.Random(settings.seed + 4))
    cluster = LockstepCluster(
        model_dir,
        dp_size=settings.dp_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        balance=arm.balance,
        gate=arm.gate or settings.gate,
        async_scheduling=profile.async_scheduling,
        num_speculative_tokens=profile.num_speculative_tokens,
        prefill_schedule_interval=arm.interval,
        remote_kv_delay_steps=settings.remote_kv_delay_steps if remote else None,
        remote_kv_step_prefill=settings.remote_kv_step_prefill,
        kv_holding_requests=(settings.concurrency or settings.num_requests) if remote else 0,
    )
    # Same seeds in every arm: identical lengths, client jitter, acceptance and noise draws.
    shapes = sample_shapes(
        settings.num_requests,
        settings.prompt_tokens,
        settings.output_tokens,
        settings.prompt_spread,
        settings.output_spread,
        random.Random(settings.seed),
    )
    client = Client(
        settings.num_requests,
        settings.concurrency,
        settings.request_rate,
        settings.jitter_ms / 1000.0,
        random.Random(settings.seed + 1),
    )
    acceptance = AcceptanceModel(
        settings.num_requests, profile.acceptance_rate_mean, profile.acceptance_rate_spread, settings.seed + 2
    )
    noise = random.Random(settings.seed + 3)
    # The front end's latency, per request (own stream: the other draws stay as they were).
    delay_rng = random.Random(settings.seed + 5)
    delays = (
        [
            profile.arrival_delay_ms
            / 1000.0
            * delay_rng.uniform(1 - profile.arrival_delay_spread, 1 + profile.arrival_delay_spread)
            for _ in range(settings.num_requests)
        ]
        if profile.arrival_delay_ms
        else [0.0] * settings.num_requests
    )
    in_transit: list[tuple[float, int, float]] = []  # (arrival at the engine, index, client's send)
    router = make_router(settings.router, settings.dp_size, cluster.counts, profile.coordinator_publish_ms / 1000.0)
    recorder = RunRecorder(settings.num_requests, remote)
    max_iterations = (
        MAX_STEPS_PER_OUTPUT_TOKEN
        * settings.num_requests
        * (settings.output_tokens + settings.prompt_tokens)
        // max(settings.max_num_seqs, 1)
        + 1000
    )
    depth = 2 if profile.async_scheduling else 1

    def accepted(request_id: str, drafts: int) -> int:
        return acceptance.accepted(int(request_id), drafts) if drafts else 0

    now = 0.0
    device_free_at = 0.0  # when the step executing now ends
    queue: deque[Batch] = deque()
    step_counter = 0  # DPEngineCoreProc.step_counter: same on every rank
    iterations = dummy_steps = 0
    remaining = settings.num_requests
    while remaining:
        for sent_at, index in client.due(now):
            recorder.sent(index, sent_at)
            heapq.heappush(in_transit, (sent_at + delays[index], index, sent_at))
        while in_transit and in_transit[0][0] <= now:
            arrived_at, index, sent_at = heapq.heappop(in_transit)
            rank = router.route(arrived_at)
            cluster.schedulers[rank].add_request(sim_request(str(index), shapes[index], sent_at, index in remote))
        iterations += 1
        if iterations > max_iterations:
            raise SimulationStuck(
                f"{remaining} requests unfinished after {iterations} iterations "
                f"(running per rank: {cluster.running()}, gate closed: {cluster.gate_closed()})"
            )
        if not cluster.has_requests() and not queue:
            if step_counter % WAVE_CHECK_STEPS:
                # Idle ranks keep running dummy batches until the wave check.
                dummy_steps += 1
                now += profile.step_s([0.0] * settings.dp_size, noise)
                step_counter += 1
                continue
            next_send = client.next_send_time()
            if in_transit:
                next_send = in_transit[0][0] if next_send is None else min(next_send, in_transit[0][0])
            if next_send is None:
                raise SimulationStuck(f"{remaining} requests never sent (client bug)")
            step_counter = 0  # the wave ended: the next one starts at 0
            now = max(now, next_send)
            continue
        cluster.now = now
        if cluster.has_requests():
            batch = cluster.schedule(step_counter)
            batch.start = max(now, device_free_at)
            work_ms = [profile.rank_ms(w.prefill_tokens, w.decode_requests) for w in batch.work]
            prefill = any(w.prefill_tokens for w in batch.work)
            shared = profile.shared_ms(
                sum(w.prefill_tokens for w in batch.work), sum(w.decode_requests for w in batch.work)
            )
            batch.end = device_free_at = batch.start + profile.step_s(work_ms, noise, prefill, shared)
            queue.append(batch)
            if len(queue) < depth:
                # vLLM returns without waiting while the batch queue has room.
                cluster.gather()
                step_counter += 1
                continue
        batch = queue.popleft()
        now = cluster.now = max(now, batch.end)
        produced, finished = cluster.finish(batch, accepted)
        for request_id, count in produced:
            recorder.produced(int(request_id), now, count)
        recorder.step(now, batch.work, cluster.running())
        for request_id in finished:
            recorder.done(int(request_id), now)
            client.finished(now + profile.response_delay_ms / 1000.0)
        remaining -= len(finished)
        if finished and progress is not None:
            progress(len(finished))
        cluster.gather()
        step_counter += 1
        router.observe(now)
    counters = {
        "gated_rank_steps": cluster.gated_steps(),
        "deferred_rank_steps": cluster.deferred_steps(),
        "dummy_steps": dummy_steps,
    }
    if remote:
        counters["gated_admissions"] = cluster.gated_admissions
    result = recorder.result(settings.dp_size, counters, time.perf_counter() - started)
    result.summary["sim_cpu_s"] = time.process_time() - cpu_started
    return result
