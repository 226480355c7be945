"""Each mechanism of the simulator, on real vLLM schedulers: MTP speculative decoding, the shared
token budget, async scheduling, and vLLM's prefill schedule interval (reproduced from 0.27.1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dpsim.cluster import LockstepCluster, sim_request
from dpsim.costmodel import profile_from_dict, with_values
from dpsim.settings import Arm, SimSettings
from dpsim.simulation import run
from dpsim.workload import RequestShape

PLAIN = profile_from_dict({"step_overhead_ms": 20, "decode_ms_per_request": 1, "prefill_ms_per_token": 0.05})
MTP = with_values(
    PLAIN, {"num_speculative_tokens": 3, "acceptance_rate_mean": 0.6, "acceptance_rate_spread": 0.4}, "test"
)
# One wave of identical requests, all sent at once, one rank: only MTP can tell them apart.
ONE_WAVE = SimSettings(
    gate="cap",  # the gate's mechanics: upstream's rule closes from the counts alone
    dp_size=1,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    num_requests=8,
    concurrency=8,
    prompt_tokens=40,
    output_tokens=60,
    router="round-robin",
)
NO_DRAFTS = lambda request_id, drafts: 0  # noqa: E731


def _cluster(model: Path, **kwargs: object) -> LockstepCluster:
    options = {
        "dp_size": 1,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 300,
        "balance": False,
        "gate": "cap",  # the gate's mechanics: upstream's rule closes from the counts alone
        **kwargs,
    }
    return LockstepCluster(model, **options)  # type: ignore[arg-type]


def test_fixed_lengths_with_acceptance_spread_finish_at_different_steps(tiny_model: Path) -> None:
    without = run(ONE_WAVE, PLAIN, Arm("off", False), model_dir=tiny_model)
    assert len(set(without.finish_step)) == 1  # same length, same steps: one finish step
    with_mtp = run(ONE_WAVE, MTP, Arm("off", False), model_dir=tiny_model)
    assert len(set(with_mtp.finish_step)) > 3
    assert max(with_mtp.finish_step) < without.finish_step[0]  # k+1 tokens per step at most
    assert with_mtp.summary["tokens_per_chunk"] > 1.5
    no_spread = with_values(MTP, {"acceptance_rate_spread": 0.0, "acceptance_rate_mean": 1.0}, "test")
    all_accepted = run(ONE_WAVE, no_spread, Arm("off", False), model_dir=tiny_model)
    assert len(set(all_accepted.finish_step)) == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_decodes_carry_k_plus_one_tokens_in_the_shared_budget(tiny_model: Path, async_scheduling: bool) -> None:
    cluster = _cluster(
        tiny_model, num_speculative_tokens=3, async_scheduling=async_scheduling, max_num_batched_tokens=100
    )
    scheduler = cluster.schedulers[0]
    for index in range(4):
        scheduler.add_request(sim_request(str(index), RequestShape(10, 50), 0.0))
    first = cluster.schedule(0)
    if async_scheduling:  # the batch queue: the next step is scheduled before this one ends
        second = cluster.schedule(1)
        cluster.finish(first, NO_DRAFTS)
    else:
        cluster.finish(first, NO_DRAFTS)
        second = cluster.schedule(1)
    assert set(second.outputs[0].num_scheduled_tokens.values()) == {4}  # 1 + k drafts each
    assert second.work[0].decode_requests == 4
    assert all(drafts == 3 for _, drafts in second.sampling[0])
    cluster.finish(second, lambda request_id, drafts: 2)
    # A long prompt now shares the step's 100-token budget with 4 decodes of 4 tokens each.
    scheduler.add_request(sim_request("9", RequestShape(200, 5), 0.0))
    third = cluster.schedule(2)
    assert third.work[0].prefill_tokens == 100 - 4 * 4
    assert third.outputs[0].num_scheduled_tokens["9"] == 84


def test_rejected_drafts_are_rolled_back_by_vllm(tiny_model: Path) -> None:
    cluster = _cluster(tiny_model, num_speculative_tokens=3)
    scheduler = cluster.schedulers[0]
    scheduler.add_request(sim_request("0", RequestShape(10, 50), 0.0))
    produced, _ = cluster.finish(cluster.schedule(0), NO_DRAFTS)
    assert produced == [("0", 1)]  # the prefill step samples one token
    produced, _ = cluster.finish(cluster.schedule(1), lambda request_id, drafts: 1)
    assert produced == [("0", 2)]  # one draft accepted + the sampled token
    request = scheduler.requests["0"]
    assert request.num_computed_tokens == request.num_tokens - 1  # 2 rejected drafts undone


def _first_token_step(tiny_model: Path, async_scheduling: bool) -> int:
    """Cap 1, two 3-token requests: the iteration in which the second one gets its first token."""
    settings = SimSettings(
        dp_size=1,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        num_requests=2,
        concurrency=2,
        prompt_tokens=8,
        output_tokens=3,
        router="round-robin",
    )
    profile = with_values(PLAIN, {"async_scheduling": async_scheduling}, "test")
    result = run(settings, profile, Arm("off", False), model_dir=tiny_model)
    return result.finish_step[1] - 2  # finished after its 3 tokens, one per step


def test_async_scheduling_frees_a_slot_one_step_later(tiny_model: Path) -> None:
    """With the batch queue the step after a request's last one is scheduled before its output
    arrives, so the freed slot is seen one step later than with the synchronous scheduler."""
    assert _first_token_step(tiny_model, True) == _first_token_step(tiny_model, False) + 1


def test_async_run_uses_vllms_async_scheduler(tiny_model: Path) -> None:
    cluster = _cluster(tiny_model, async_scheduling=True)
    assert type(cluster.schedulers[0]).__name__ == "AsyncScheduler"


def _admission_steps(tiny_model: Path, interval: int, steps: int = 12) -> list[int]:
    """A rank with one long-decoding request and a new short request arriving every step:
    the step counters at which a new request was admitted."""
    cluster = _cluster(tiny_model, prefill_schedule_interval=interval, max_num_seqs=32)
    scheduler = cluster.schedulers[0]
    scheduler.add_request(sim_request("decoder", RequestShape(8, 200), 0.0))
    admitted = []
    for step in range(steps):
        if step:
            scheduler.add_request(sim_request(str(step), RequestShape(8, 200), 0.0))
        batch = cluster.schedule(step)
        if batch.work[0].admitted:
            admitted.append(step)
        cluster.finish(batch, NO_DRAFTS)
    return admitted


def test_interval_2_admits_prefills_only_on_even_steps(tiny_model: Path) -> None:
    assert _admission_steps(tiny_model, 1) == list(range(12))
    assert _admission_steps(tiny_model, 2) == [0, 2, 4, 6, 8, 10]
    assert _admission_steps(tiny_model, 4) == [0, 4, 8]


def test_deferred_step_holds_chunked_prefill_continuations(tiny_model: Path) -> None:
    """0.27.1's deferred step skips running requests mid-prefill, not only new admissions;
    the decodes still run and the chunk resumes on the next cadence-aligned step."""
    cluster = _cluster(tiny_model, prefill_schedule_interval=2, max_num_batched_tokens=64)
    scheduler = cluster.schedulers[0]
    scheduler.add_request(sim_request("decoder", RequestShape(8, 50), 0.0))
    cluster.finish(cluster.schedule(0), NO_DRAFTS)  # step 0: its prefill; now it decodes
    cluster.finish(cluster.schedule(1), NO_DRAFTS)
    scheduler.add_request(sim_request("long", RequestShape(150, 5), 0.0))
    batch = cluster.schedule(2)  # aligned: admitted, first 63-token chunk
    assert batch.outputs[0].num_scheduled_tokens == {"decoder": 1, "long": 63}
    cluster.finish(batch, NO_DRAFTS)
    batch = cluster.schedule(3)  # throttled: the decode runs, the chunk waits
    assert batch.outputs[0].num_scheduled_tokens == {"decoder": 1}
    assert batch.work[0].deferred
    assert [r.request_id for r in scheduler.running] == ["decoder", "long"]  # order kept
    cluster.finish(batch, NO_DRAFTS)
    batch = cluster.schedule(4)
    assert batch.outputs[0].num_scheduled_tokens == {"decoder": 1, "long": 63}


def test_saturated_rank_stops_deferring(tiny_model: Path) -> None:
    """The PR's guard: a release step that cannot drain the waiting queue disables deferral."""
    cluster = _cluster(tiny_model, prefill_schedule_interval=2, max_num_seqs=2)
    scheduler = cluster.schedulers[0]
    for index in range(4):
        scheduler.add_request(sim_request(str(index), RequestShape(8, 3), 0.0))
    cluster.finish(cluster.schedule(0), NO_DRAFTS)  # admits 2 (the cap), 2 still waiting
    assert cluster.cadences is not None and cluster.cadences[0].capacity_bound
    batch = cluster.schedule(1)  # odd step, but saturated: not deferred
    assert not batch.work[0].deferred


def test_balance_and_interval_compose(tiny_model: Path) -> None:
    """Balance + interval: a throttled step is deferred whatever the gate says, and a gated
    step does not count as one that ran the admission block."""
    cluster = _cluster(tiny_model, balance=True, dp_size=2, prefill_schedule_interval=2, max_num_seqs=2)
    first, second = cluster.schedulers
    for index in range(3):
        first.add_request(sim_request(str(index), RequestShape(8, 20), 0.0))
    second.add_request(sim_request("9", RequestShape(8, 20), 0.0))
    cluster.finish(cluster.schedule(0), NO_DRAFTS)
    cluster.gather()
    assert cluster.gate_closed()  # rank 0 at its cap of 2
    assert cluster.cadences is not None and cluster.cadences[0].capacity_bound
    second.add_request(sim_request("10", RequestShape(8, 20), 0.0))
    batch = cluster.schedule(1)
    assert batch.work[1].deferred and batch.work[1].admitted == 0
    cluster.finish(batch, NO_DRAFTS)
    cluster.gather()
    batch = cluster.schedule(2)  # aligned, but the gate is still closed: rank 1 waits
    assert batch.work[1].admitted == 0 and not batch.work[1].deferred
    assert cluster.gated_steps() >= 2
