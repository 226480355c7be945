"""The simulator's remote-KV requests (fake asynchronous connector) and the ``admit-kv-holding``
gate variant, on real vLLM schedulers: a remote-KV request waits for its load, then runs one
prompt token; under a closed gate the variant admits it once loaded, the product's gate does not."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from dpsim.cluster import (
    AdmitKVHoldingAsyncScheduler,
    AdmitKVHoldingScheduler,
    LockstepCluster,
    scheduler_class,
    sim_request,
)
from dpsim.remote_kv import remote_kv_requests
from dpsim.settings import GATE_ARMS
from dpsim.simulation import run
from dpsim.workload import RequestShape
from offline_vllm import emulate_gather
from test_sim_run import PROFILE, TINY  # the simulator tests' one tiny setting
from vllm.v1.request import RequestStatus

SHAPE = RequestShape(prompt_tokens=40, output_tokens=4)
NO_DRAFTS = lambda request_id, drafts: 0  # noqa: E731


def _cluster(model: Path, **kwargs: Any) -> LockstepCluster:
    options: dict[str, Any] = {
        "dp_size": 1,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
        "max_model_len": 100,
        "balance": False,
        "remote_kv_delay_steps": 3,
        "kv_holding_requests": 4,
        "gate": "cap",  # the gate's mechanics: upstream's rule closes from the counts alone
        **kwargs,
    }
    return LockstepCluster(model, **options)


def _step(cluster: LockstepCluster) -> Any:
    batch = cluster.schedule(0)
    cluster.finish(batch, NO_DRAFTS)
    return batch


def test_remote_kv_indices_are_the_fraction_and_none_without_it() -> None:
    chosen = remote_kv_requests(100, 0.25, random.Random(4))
    assert len(chosen) == 25 and chosen <= set(range(100))
    assert remote_kv_requests(100, 0.0, random.Random(4)) == frozenset()


def test_no_connector_without_remote_kv(tiny_model: Path) -> None:
    cluster = _cluster(tiny_model, remote_kv_delay_steps=None)
    assert cluster.schedulers[0].connector is None and cluster.loads is None


@pytest.mark.parametrize("step_prefill", [False, True])
def test_a_remote_kv_request_waits_for_its_load_then_runs_its_last_prompt_token(
    tiny_model: Path, step_prefill: bool
) -> None:
    cluster = _cluster(tiny_model, remote_kv_step_prefill=step_prefill)
    scheduler = cluster.schedulers[0]
    scheduler.add_request(sim_request("0", SHAPE, 0.0, remote_kv=True))
    first = _step(cluster)  # starts the load: nothing to compute yet
    request = scheduler.requests["0"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert first.outputs[0].num_scheduled_tokens == {}
    assert request.request_id in scheduler.connector.loading
    for _ in range(3):  # the load's three steps (reported in the third one's output)
        assert _step(cluster).outputs[0].num_scheduled_tokens == {}
    assert request.request_id in scheduler.connector.loaded
    running = _step(cluster)
    assert running.outputs[0].num_scheduled_tokens == {"0": 1}  # only the last prompt token
    assert [r.req_id for r in running.outputs[0].scheduled_new_reqs] == ["0"]
    work = running.work[0]
    # Priced as a decode (vllm-ascend keeps one-valid-token batches in the decode graph) or as prefill.
    assert (work.prefill_tokens, work.decode_requests) == ((1, 0) if step_prefill else (0, 1))
    while scheduler.has_requests():
        _step(cluster)
    assert "0" not in scheduler.requests  # finished and freed


def test_a_run_with_remote_kv_splits_its_figures(tiny_model: Path) -> None:
    settings = dataclasses.replace(TINY, remote_kv_fraction=0.5)
    for arm in GATE_ARMS:
        summary = run(settings, PROFILE, arm, model_dir=tiny_model).summary
        assert summary["finished"] == 16 and summary["remote_kv_requests"] == 8
        assert summary["ttft_remote_kv_ms"] > 0 and summary["ttft_local_ms"] > 0
        if arm.gate != "admit-kv-holding":  # the product's gate admits nothing while closed
            assert summary["gated_admissions"] == 0
    plain = run(dataclasses.replace(settings, remote_kv_fraction=0.0), PROFILE, GATE_ARMS[1], model_dir=tiny_model)
    assert "remote_kv_requests" not in plain.summary and "gated_admissions" not in plain.summary


def test_admit_kv_holding_classes() -> None:
    assert scheduler_class(True, False, "admit-kv-holding") is AdmitKVHoldingScheduler
    assert scheduler_class(True, True, "admit-kv-holding") is AdmitKVHoldingAsyncScheduler


@pytest.mark.parametrize("gate", ["cap", "admit-kv-holding"])
def test_under_a_closed_gate_only_the_variant_admits_a_loaded_remote_kv_request(tiny_model: Path, gate: str) -> None:
    cluster = _cluster(tiny_model, dp_size=2, balance=True, gate=gate, remote_kv_delay_steps=1)
    rank0 = cluster.schedulers[0]
    if not hasattr(rank0, "kv_holding_waiting"):
        pytest.skip("this vLLM has no KV-holding queue: PAUSED_NEW admits nothing, both gates are the same")
    cap = rank0.balance_gate_threshold
    rank0.add_request(sim_request("remote", SHAPE, 0.0, remote_kv=True))
    emulate_gather(cluster.schedulers, [0, 0])  # gate open: the load starts
    _step(cluster)
    assert rank0.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    emulate_gather(cluster.schedulers, [0, cap])  # rank 1 at its cap: the gate is closed
    rank0.add_request(sim_request("local", SHAPE, 0.0))
    _step(cluster)  # the load finishes in this step's output
    assert "remote" in rank0.connector.loaded
    gated = cluster.schedule(0)
    assert rank0.balance_gate_closed()
    admitted = [r.req_id for r in gated.outputs[0].scheduled_new_reqs]
    # A request that needs its prompt prefilled never enters under the gate, whichever variant.
    assert admitted == (["remote"] if gate == "admit-kv-holding" else [])
    assert cluster.gated_admissions == len(admitted)
    cluster.finish(gated, NO_DRAFTS)
    emulate_gather(cluster.schedulers, [len(rank0.running), 0])  # gate open again: the rest enter
    reopened = cluster.schedule(0)
    later = [r.req_id for r in reopened.outputs[0].scheduled_new_reqs]
    assert later == (["local"] if gate == "admit-kv-holding" else ["remote", "local"])
