"""A vLLM worker whose forward is fake: it returns sampled token ids, and nothing else happens.

What stays real around it: the engine core, the scheduler (with the balance gate), the KV-cache
manager (block accounting), structured output (xgrammar compiles each request's grammar and fills
the bitmask), detokenization, the API server. The worker only has to hand back, per scheduled
request, the token ids the model would have sampled:

* a request whose scheduled tokens end before its last known token (a partial prefill chunk, or
  a recomputation after preemption) samples nothing, as vLLM's model runner discards them;
* a structured-output request samples a token its grammar bitmask allows, chosen so the output
  closes quickly: end of sequence if allowed, else ``"``, ``}``, ``]``, ``1``, else the allowed
  token with the lowest id. A JSON schema's required keys are forced by the grammar, so the text
  is e.g. ``{"city":"","population":1}`` — valid JSON that matches the schema;
* any other request samples one fixed ordinary token (never EOS), so it ends at ``max_tokens``.

``BALANCE_E2E_FORWARD_MS`` (default 2) sleeps that long per forward, so requests arriving while
a step runs are batched as they would be on a device.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker import worker_base
from vllm.v1.worker.worker_base import WorkerBase

# Enough blocks for every running request at max_model_len on a tiny test server.
NUM_KV_BLOCKS = 4096
_HEAD_SIZE = 16
# In a string '"' closes it; after a value '}' or ']' closes the container; a number is "1".
_CLOSING_TOKENS = ('"', "}", "]", "1")
_FILLER_TOKEN = "a"


class FakeForwardWorker(WorkerBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_s = float(os.environ.get("BALANCE_E2E_FORWARD_MS", "2")) / 1000.0
        # request id -> [number of known tokens (prompt + sampled), tokens computed so far]
        self._requests: dict[str, list[int]] = {}
        self._last_step: list[tuple[str, bool]] = []  # (request id, samples a token)
        self.forward_steps = 0
        self.dummy_steps = 0

    # ---- start-up, as the engine core drives it --------------------------------------------
    def init_device(self) -> None:
        self.device = torch.device("cpu")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_config.tokenizer)
        vocab = tokenizer.get_vocab()
        self._eos = int(tokenizer.eos_token_id)
        self._priority = [self._eos] + [vocab[t] for t in _CLOSING_TOKENS]
        self._filler = vocab[_FILLER_TOKEN]

    def load_model(self) -> None:
        pass

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {
            "model.layers.0.self_attn.attn": FullAttentionSpec(
                block_size=self.cache_config.block_size, num_kv_heads=1, head_size=_HEAD_SIZE, dtype=torch.float32
            )
        }

    def determine_available_memory(self) -> int:
        spec = next(iter(self.get_kv_cache_spec().values()))
        return NUM_KV_BLOCKS * spec.page_size_bytes

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        pass

    def compile_or_warm_up_model(self) -> Any:
        # vLLM 0.23 reports (language model, encoder) times; 0.18 one float.
        times = getattr(worker_base, "CompilationTimes", None)
        return times(language_model=0.0, encoder=0.0) if times is not None else 0.0

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    # ---- steps ------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        """Records which requests sample this step; ``sample_tokens`` then picks the tokens.

        As vLLM's model runner: an empty output when nothing is scheduled (the engine then
        samples nothing), else ``None`` (the engine calls ``sample_tokens`` next).
        """
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._requests[new.req_id] = [len(new.prompt_token_ids), new.num_computed_tokens]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self._requests[req_id][1] = computed
        step = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self._requests[req_id]
            state[1] += num_tokens
            step.append((req_id, state[1] >= state[0]))
        self._last_step = step
        if not step:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.forward_steps += 1
        time.sleep(self._forward_s)
        return None

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        rows: dict[str, np.ndarray] = {}
        if grammar_output is not None:
            bitmask = np.asarray(grammar_output.grammar_bitmask)
            rows = {r: bitmask[i] for i, r in enumerate(grammar_output.structured_output_request_ids)}
        req_ids, sampled = [], []
        for req_id, samples in self._last_step:
            req_ids.append(req_id)
            if not samples:
                sampled.append([])
                continue
            token = self._pick(rows[req_id]) if req_id in rows else self._filler
            self._requests[req_id][0] += 1
            sampled.append([token])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    def _pick(self, row: np.ndarray) -> int:
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little").nonzero()[0]
        if allowed.size == 0:
            raise RuntimeError("grammar bitmask allows no token")
        allowed_set = set(allowed.tolist())
        for token in self._priority:
            if token in allowed_set:
                return token
        return int(allowed[0])

    def execute_dummy_batch(self) -> None:
        self.dummy_steps += 1

    def take_draft_token_ids(self) -> None:
        return None
