"""DP ranks as real vLLM schedulers, stepped in lockstep in one process.

Each rank is a real scheduler object: vLLM's own ``Scheduler``/``AsyncScheduler`` with balance
off, ``BalanceScheduler``/``BalanceAsyncScheduler`` with balance on (``scheduler_class`` is the
one place that chooses). Speculative decoding is vLLM's own: the config carries
``num_speculative_tokens`` k, the scheduler schedules k drafts per decoding request inside the
shared token budget and rolls rejected drafts back in ``update_from_output``.

A lockstep step schedules every rank that has requests (a rank without any runs a dummy batch, as
``DPEngineCoreProc`` does); the caller prices the step and later feeds each rank a fake model
output: nothing for a request mid-prefill, otherwise one sampled token plus the drafts the
acceptance model accepts. With async scheduling the next step is scheduled before this one's
output arrives, exactly as vLLM's batch queue does; the fake output is therefore decided from
what was scheduled, not from the request's state at update time. After every engine-loop
iteration ``emulate_gather`` leaves what ``balance_gather``'s all-gather leaves. With remote-KV
requests in the workload (``dpsim.remote_kv``) every rank has the fake KV connector and each model
output reports the loads that finished.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fake_remote_kv import async_kv_transfer_config
from offline_vllm import build_scheduler, emulate_gather, make_vllm_config, runner_output, write_tiny_model
from vllm.config import SpeculativeConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.request import Request

from dpsim.cadence import PrefillCadence, deferred_prefills
from dpsim.remote_kv import REMOTE_PREFILL, RemoteKVLoads, is_remote_kv
from dpsim.settings import GATES
from dpsim.workload import RequestShape
from vllm_ascend.core.balance_scheduler import BalanceAsyncScheduler, BalanceScheduler

EOS_TOKEN_ID = 1
TOKEN_ID = 5  # what the fake model samples and drafts (never EOS)
KV_BLOCK_SIZE = 16


def prepare_model_dir(directory: Path, max_model_len: int) -> Path:
    """The offline tiny model, with a context window long enough for the workload."""
    write_tiny_model(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_model_len)
    config_path.write_text(json.dumps(config))
    return directory


def sim_request(request_id: str, shape: RequestShape, arrival_time: float, remote_kv: bool = False) -> Request:
    """A request that decodes exactly ``shape.output_tokens`` tokens (``remote_kv``: its prompt's
    KV is loaded from a remote prefill, all but the last token).

    No block hasher: vLLM's EngineCore passes none unless prefix caching or a KV connector is on,
    and hashing every 16 tokens would cost more than the rest of the simulated step.
    """
    params = SamplingParams(ignore_eos=True, max_tokens=shape.output_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    prompt = [3 + (i % 100) for i in range(shape.prompt_tokens)]
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        block_hasher=None,
    )
    if remote_kv:
        request.kv_transfer_params = dict(REMOTE_PREFILL)
    return request


class _CapMinusOneGate:
    """The briefly shipped, reverted gate rule (vllm-ascend PR #8674 went back to ``cap``):
    closed when some rank is within one request of its cap. Kept to measure the trade-off."""

    max_num_running_reqs: int

    @property
    def balance_gate_threshold(self) -> int:
        # Never 0: a threshold of 0 would freeze admission on an empty cluster forever.
        return max(self.max_num_running_reqs - 1, 1)


class CapMinusOneScheduler(_CapMinusOneGate, BalanceScheduler):
    """``BalanceScheduler`` with the ``cap-1`` gate (simulator only)."""


class CapMinusOneAsyncScheduler(_CapMinusOneGate, BalanceAsyncScheduler):
    """``BalanceAsyncScheduler`` with the ``cap-1`` gate (simulator only)."""


class _AdmitKVHoldingGate:
    """The gate without holding the admission cap at 0: a gated step is vLLM's own ``PAUSED_NEW``,
    which on vLLM >= 0.32 still admits requests that hold KV blocks (loaded remote KV, streaming
    continuations) up to the cap. Kept to measure whether the product should allow that; on
    lines where ``PAUSED_NEW`` admits nothing it is the product's gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._balance_held_caps = ()  # the caps a gated step holds at 0: none


class AdmitKVHoldingScheduler(_AdmitKVHoldingGate, BalanceScheduler):
    """``BalanceScheduler`` with the ``admit-kv-holding`` gate (simulator only)."""


class AdmitKVHoldingAsyncScheduler(_AdmitKVHoldingGate, BalanceAsyncScheduler):
    """``BalanceAsyncScheduler`` with the ``admit-kv-holding`` gate (simulator only)."""


def scheduler_class(balance: bool, async_scheduling: bool, gate: str = "adaptive") -> type:
    """The scheduler class of every rank: the one place a policy becomes a class."""
    if gate not in GATES:
        raise ValueError(f"unknown gate rule {gate!r}; choose one of {', '.join(GATES)}")
    if not balance:
        return AsyncScheduler if async_scheduling else Scheduler
    if gate == "cap-1":
        return CapMinusOneAsyncScheduler if async_scheduling else CapMinusOneScheduler
    if gate == "admit-kv-holding":
        return AdmitKVHoldingAsyncScheduler if async_scheduling else AdmitKVHoldingScheduler
    return BalanceAsyncScheduler if async_scheduling else BalanceScheduler


def build_schedulers(cls: type, config: Any, count: int) -> list[Any]:
    # One config object for all ranks: a scheduler only reads the DP size from it.
    return [build_scheduler(cls, config) for _ in range(count)]


@dataclass
class RankWork:
    """What one rank scheduled in a step."""

    prefill_tokens: int
    decode_requests: int
    admitted: int
    deferred: bool = False


@dataclass
class Batch:
    """One lockstep step in flight: each rank's scheduler output (None: dummy batch), the
    requests that sample a token in it (with their scheduled draft count), and its timing."""

    outputs: list[Any]
    sampling: list[list[tuple[str, int]]]
    work: list[RankWork]
    start: float = 0.0
    end: float = 0.0


AcceptedDrafts = Callable[[str, int], int]


class LockstepCluster:
    def __init__(
        self,
        model_dir: Path,
        *,
        dp_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        balance: bool,
        gate: str = "adaptive",
        async_scheduling: bool = False,
        num_speculative_tokens: int = 0,
        prefill_schedule_interval: int = 1,
        remote_kv_delay_steps: int | None = None,
        remote_kv_step_prefill: bool = False,
        kv_holding_requests: int = 0,
    ) -> None:
        """``remote_kv_delay_steps``: configure the fake KV connector, loads taking that many steps
        (None: no connector); ``kv_holding_requests``: how many requests may hold KV blocks without
        running (loads in flight), for the KV cache size; ``remote_kv_step_prefill``: price a
        loaded request's one-token step as prefill."""
        # Enough KV blocks that no rank ever preempts: the effect studied is admission timing.
        blocks_per_request = -(-max_model_len // KV_BLOCK_SIZE) + 1
        # MTP itself needs the DeepSeek draft head; "ngram_gpu" is the drafter-free method vLLM
        # accepts with async scheduling. The scheduler only reads num_speculative_tokens (and,
        # for EAGLE/MTP, reserves KV lookahead slots, irrelevant with this much KV cache).
        speculative = (
            SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=num_speculative_tokens)
            if num_speculative_tokens
            else None
        )
        config = make_vllm_config(
            model_dir,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            dp_size=dp_size,
            async_scheduling=async_scheduling,
            num_blocks=(max_num_seqs + kv_holding_requests) * blocks_per_request + 1,
            speculative_config=speculative,
            **({"kv_transfer_config": async_kv_transfer_config()} if remote_kv_delay_steps else {}),
            additional_config={"scheduler_config": {"balance_gate_rule": "adaptive" if gate == "adaptive" else "cap"}},
        )
        self.scheduler_cls = scheduler_class(balance, async_scheduling, gate)
        self.schedulers: list[Any] = build_schedulers(self.scheduler_cls, config, dp_size)
        # The simulated clock (the run sets it): what the adaptive gate rule times steps with.
        self.now = 0.0
        for scheduler in self.schedulers if balance else ():
            scheduler.balance_clock = lambda: self.now
        self.balance = balance
        self.async_scheduling = async_scheduling
        self.num_speculative_tokens = num_speculative_tokens
        self.cadences = (
            [PrefillCadence(prefill_schedule_interval) for _ in range(dp_size)]
            if prefill_schedule_interval > 1
            else None
        )
        self.loads = RemoteKVLoads(dp_size, remote_kv_delay_steps) if remote_kv_delay_steps else None
        self.remote_kv_step_prefill = remote_kv_step_prefill
        self.gated_admissions = 0  # requests that entered running in a gated rank-step

    def counts(self) -> list[tuple[int, int]]:
        """(waiting, running) of every rank, as the DP coordinator publishes them."""
        # Skipped requests wait in their own queue up to vLLM 0.30, KV-holding ones from 0.31.
        extra = ("skipped_waiting", "kv_holding_waiting")
        return [
            (len(s.waiting) + sum(len(getattr(s, name, ())) for name in extra), len(s.running)) for s in self.schedulers
        ]

    def running(self) -> list[int]:
        return [len(s.running) for s in self.schedulers]

    def has_requests(self) -> bool:
        return any(s.has_requests() for s in self.schedulers)

    def gate_closed(self) -> bool:
        return self.balance and self.schedulers[0].balance_gate_closed()

    def gated_steps(self) -> int:
        return sum(s.balance_gated_steps for s in self.schedulers) if self.balance else 0

    def deferred_steps(self) -> int:
        return sum(c.deferred_steps for c in self.cadences) if self.cadences else 0

    def schedule(self, step_counter: int) -> Batch:
        """Every rank with requests schedules one step (``step_counter``: the DP engine loop's)."""
        batch = Batch([], [], [])
        for rank, scheduler in enumerate(self.schedulers):
            if not scheduler.has_requests():
                batch.outputs.append(None)
                batch.sampling.append([])
                batch.work.append(RankWork(0, 0, 0))
                continue
            cadence = self.cadences[rank] if self.cadences else None
            deferred = cadence is not None and cadence.defers(step_counter, scheduler)
            gated_before = scheduler.balance_gated_steps if self.balance else 0
            if deferred:
                assert cadence is not None
                cadence.deferred_steps += 1
                with deferred_prefills(scheduler):
                    output = scheduler.schedule()
            else:
                output = scheduler.schedule()
            gated = self.balance and scheduler.balance_gated_steps > gated_before
            if cadence is not None:
                cadence.after_step(scheduler, deferred, admission_block_ran=not gated and not output.preempted_req_ids)
            batch.outputs.append(output)
            sampling, work = self._classify(scheduler, output, self.remote_kv_step_prefill)
            work.deferred = deferred
            if gated:
                self.gated_admissions += work.admitted
            batch.sampling.append(sampling)
            batch.work.append(work)
        return batch

    @staticmethod
    def _classify(
        scheduler: Any, output: Any, remote_kv_step_prefill: bool = False
    ) -> tuple[list[tuple[str, int]], RankWork]:
        requests = scheduler.requests
        spec = output.scheduled_spec_decode_tokens
        prefill = decode = 0
        sampling = []
        for request_id, tokens in output.num_scheduled_tokens.items():
            request = requests[request_id]
            # schedule() already advanced num_computed_tokens by this step's tokens.
            before = request.num_computed_tokens - tokens
            prompt_part = min(tokens, request.num_prompt_tokens - before)
            # A loaded remote-KV request's single prompt token: vllm-ascend's model runner keeps
            # such a batch in its decode graph (SpecDecoding: one valid token per request).
            loaded_kv_step = prompt_part == 1 and before == request.num_prompt_tokens - 1 and is_remote_kv(request)
            if loaded_kv_step and not remote_kv_step_prefill:
                decode += 1
            elif prompt_part > 0:
                prefill += prompt_part
            else:
                decode += 1
            if not request.is_prefill_chunk:  # set by schedule() for this step
                sampling.append((request_id, len(spec.get(request_id, ()))))
        return sampling, RankWork(prefill, decode, len(output.scheduled_new_reqs))

    def finish(self, batch: Batch, accepted: AcceptedDrafts) -> tuple[list[tuple[str, int]], list[str]]:
        """Fake the model for ``batch`` and update every rank with it.

        Returns (request id, new tokens) for every request that received tokens, and the ids
        that finished.
        """
        produced: list[tuple[str, int]] = []
        finished: list[str] = []
        for rank, (scheduler, output, sampling) in enumerate(zip(self.schedulers, batch.outputs, batch.sampling)):
            if output is None:
                continue
            drafts = dict(sampling)
            req_ids = list(output.num_scheduled_tokens)
            sampled = [[TOKEN_ID] * (1 + accepted(r, drafts[r])) if r in drafts else [] for r in req_ids]
            kv = {"kv_connector_output": self.loads.output(rank, scheduler.connector)} if self.loads else {}
            model_output = runner_output(req_ids, sampled, **kv)
            engine_outputs = scheduler.update_from_output(output, model_output)
            for client_outputs in engine_outputs.values():
                for out in client_outputs.outputs:
                    if out.new_token_ids:
                        produced.append((out.request_id, len(out.new_token_ids)))
                    if out.finish_reason is not None:
                        finished.append(out.request_id)
            if self.num_speculative_tokens and not self.async_scheduling:
                # EngineCore.post_step: the drafter's proposals for the next step (the async
                # scheduler puts placeholders itself).
                k = self.num_speculative_tokens
                scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), [[TOKEN_ID] * k for _ in drafts]))
        return produced, finished

    def gather(self) -> None:
        """End of an engine-loop iteration: the balance all-gather (balance on only)."""
        if self.balance:
            emulate_gather(self.schedulers)
