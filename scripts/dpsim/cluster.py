"""DP ranks as real vLLM schedulers, stepped in lockstep in one process.

Each rank is a real vLLM scheduler: ``BalanceScheduler`` with balance on (or the simulator's
``CapMinusOneScheduler`` for the reverted ``cap-1`` gate rule), vLLM's own ``Scheduler`` with it off. A lockstep step schedules every rank, lets the caller price it, then feeds
each rank a fake model output (one token per decoding request, none mid-prefill) and emulates the
all-gather of ``balance_gather``: every rank's ``len(running)`` lands in every rank's
``balance_queue``, exactly what the collective leaves. A rank with nothing to run still takes
part in the step (MoE DP runs a dummy batch), which the cost model prices as the fixed overhead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offline_vllm import build_scheduler, emulate_gather, fake_model_output, make_vllm_config, write_tiny_model
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from dpsim.workload import RequestShape
from vllm_ascend.core.balance_scheduler import BalanceScheduler

EOS_TOKEN_ID = 1
KV_BLOCK_SIZE = 16


def prepare_model_dir(directory: Path, max_model_len: int) -> Path:
    """The offline tiny model, with a context window long enough for the workload."""
    write_tiny_model(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_model_len)
    config_path.write_text(json.dumps(config))
    return directory


def sim_request(request_id: str, shape: RequestShape, arrival_time: float) -> Request:
    """A request that decodes exactly ``shape.output_tokens`` tokens.

    No block hasher: vLLM's EngineCore passes none unless prefix caching or a KV connector is on,
    and hashing every 16 tokens would cost more than the rest of the simulated step.
    """
    params = SamplingParams(ignore_eos=True, max_tokens=shape.output_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    prompt = [3 + (i % 100) for i in range(shape.prompt_tokens)]
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                   pooling_params=None, arrival_time=arrival_time, block_hasher=None)


class CapMinusOneScheduler(BalanceScheduler):
    """The briefly shipped, reverted gate rule (vllm-ascend PR #7611 -> #8674): closed when some rank is within
    one request of its cap. Kept here, not in the product, to measure the latency/throughput trade-off."""

    @property
    def balance_gate_threshold(self) -> int:
        # Never 0: a threshold of 0 would freeze admission on an empty cluster forever.
        return max(self.max_num_running_reqs - 1, 1)


GATE_RULES: dict[str, type] = {"cap": BalanceScheduler, "cap-1": CapMinusOneScheduler}


def scheduler_class(balance: bool, gate: str) -> type:
    """The one place that picks each rank's class: the class is the balance decision."""
    return GATE_RULES[gate] if balance else Scheduler


@dataclass
class RankWork:
    """What one rank scheduled in a step."""

    prefill_tokens: int
    decode_requests: int
    admitted: int


class LockstepCluster:
    def __init__(self, model_dir: Path, *, dp_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, balance: bool,
                 gate: str) -> None:
        # Enough KV blocks that no rank ever preempts: the effect studied is admission timing.
        blocks_per_request = -(-max_model_len // KV_BLOCK_SIZE) + 1
        config = make_vllm_config(
            model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, dp_size=dp_size,
            num_blocks=max_num_seqs * blocks_per_request + 1)
        # One config object for all ranks: a scheduler only reads the DP size from it.
        self.schedulers: list[Any] = [build_scheduler(scheduler_class(balance, gate), config)
                                      for _ in range(dp_size)]
        self.balance = balance
        self._outputs: list[Any] = []

    def counts(self) -> list[tuple[int, int]]:
        """(waiting, running) of every rank, as the DP coordinator publishes them."""
        return [(len(s.waiting) + len(s.skipped_waiting), len(s.running))
                for s in self.schedulers]

    def running(self) -> list[int]:
        return [len(s.running) for s in self.schedulers]

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def gate_closed(self) -> bool:
        return self.balance and self.schedulers[0].balance_gate_closed()

    def gated_steps(self) -> int:
        return sum(s.balance_gated_steps for s in self.schedulers) if self.balance else 0

    def schedule(self) -> list[RankWork]:
        """First half of a lockstep step: every rank schedules."""
        work = []
        self._outputs = []
        for scheduler in self.schedulers:
            output = scheduler.schedule()
            self._outputs.append(output)
            requests = scheduler.requests
            prefill = decode = 0
            for request_id, tokens in output.num_scheduled_tokens.items():
                request = requests[request_id]
                # schedule() already advanced num_computed_tokens: a decode step has caught up.
                if tokens == 1 and request.num_computed_tokens == request.num_tokens:
                    decode += 1
                else:
                    prefill += tokens
            work.append(RankWork(prefill, decode, len(output.scheduled_new_reqs)))
        return work

    def finish(self) -> tuple[list[str], list[str]]:
        """Second half: fake the model, update every rank, gather the running counts.

        Returns the ids that received a token this step and the ids that finished.
        """
        produced: list[str] = []
        finished: list[str] = []
        for scheduler, output in zip(self.schedulers, self._outputs):
            engine_outputs = scheduler.update_from_output(
                output, fake_model_output(scheduler, output))
            for client_outputs in engine_outputs.values():
                for out in client_outputs.outputs:
                    if out.new_token_ids:
                        produced.append(out.request_id)
                    if out.finish_reason is not None:
                        finished.append(out.request_id)
        self._outputs = []
        if self.balance:
            emulate_gather(self.schedulers)
        return produced, finished
