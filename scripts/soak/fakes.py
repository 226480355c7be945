"""Stand-ins for what cannot exist on a CPU soak: the model, a grammar backend, a KV transfer.

Everything else is vLLM's: the scheduler, the requests, the engine-core methods.

* ``FakeExecutor``: one token per scheduled request (EOS never; requests end at max_tokens);
  reports remote-KV loads as finished after their delay; counts steps; checks the gate.
* ``FakeGrammar`` / ``FakeGrammarBackend``: a JSON-mode request waits in WAITING_FOR_FSM until
  its grammar future resolves (after a planned number of steps), then accepts every token.
The KV connector is the tests' ``fake_remote_kv`` (requests marked ``do_remote_prefill`` wait in
WAITING_FOR_REMOTE_KVS until this executor reports their load finished, after a planned delay).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from offline_vllm import runner_output
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

SAMPLED_TOKEN = 5


class FakeGrammar(StructuredOutputGrammar):
    """A real ``StructuredOutputGrammar`` (vLLM >= 0.24 asserts the type) that accepts every token."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        bitmask[batch_index].fill_(-1)

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


class FakeGrammarBackend:
    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return torch.zeros((max_num_seqs, 4), dtype=torch.int32)

    def destroy(self) -> None:
        pass


class FakeExecutor:
    """The model executor the engine core calls: ``execute_model`` / ``execute_dummy_batch``."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.steps = 0  # model or dummy executions on this rank
        self.dummy_steps = 0
        self.gate_violations: list[str] = []
        self.gated_steps = 0
        self.ready_at: dict[str, int] = {}  # remote-KV request id -> step its KV arrives
        self.kv_delay: dict[str, int] = {}  # planned delay, armed when the load starts
        self.grammar_at: dict[int, list[Future]] = {}  # step -> grammar futures to resolve

    def add_grammar(self, future: Future, delay: int) -> None:
        self.grammar_at.setdefault(self.steps + delay, []).append(future)

    def _tick(self) -> None:
        self.steps += 1
        for step in [s for s in self.grammar_at if s <= self.steps]:
            for future in self.grammar_at.pop(step):
                future.set_result(FakeGrammar())

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        self._tick()
        scheduler = self.scheduler
        # The gate read balance_queue in this step's schedule(); nothing has changed it since.
        if scheduler.balance_gate_closed():
            self.gated_steps += 1
            admitted = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            if admitted:
                self.gate_violations.append(
                    f"step {self.steps}: admitted {admitted} with balance_queue "
                    f"{[int(t.item()) for t in scheduler.balance_queue]}"
                )
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [[] if scheduler.requests[r].is_prefill_chunk else [SAMPLED_TOKEN] for r in req_ids]
        output = runner_output(req_ids, sampled, kv_connector_output=self._kv_output())
        future: Future = Future()
        future.set_result(output)
        return future

    def _kv_output(self) -> KVConnectorOutput | None:
        connector = self.scheduler.connector
        if connector is None:
            return None
        for request_id in connector.loading:
            self.ready_at.setdefault(request_id, self.steps + self.kv_delay.get(request_id, 1))
        done = {r for r in connector.loading if self.ready_at[r] <= self.steps}
        connector.loading -= done
        connector.loaded |= done
        return KVConnectorOutput(finished_recving=done or None)

    def execute_dummy_batch(self) -> None:
        self._tick()
        self.dummy_steps += 1
