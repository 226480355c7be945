#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""Builds real vLLM configs, schedulers and requests on CPU, offline.

Shared by the unit tests (``pytest.ini`` puts ``scripts`` on the path), the demo, the simulator,
the soak and the benchmarks (scripts beside it import it as their own directory's module). The
model is a tiny directory generated on disk (a Llama or Mixtral ``config.json`` and a word-level
tokenizer), so nothing is ever loaded from a model hub. Helpers
return real vLLM objects; callers drive them with fake model outputs (``ModelRunnerOutput``), as
vLLM's own scheduler tests do.
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
import json
import sys
import types
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

EOS_TOKEN_ID = 1
VOCAB = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(125)]
BLOCK_SIZE = 16


def tiny_model_config(vocab_size: int, moe: bool) -> dict[str, Any]:
    """A Llama-shaped (or Mixtral-shaped) ``config.json`` small enough for CPU tests."""
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-5,
    }
    if moe:
        config.update({"num_local_experts": 4, "num_experts_per_tok": 2})
    return config


def write_tiny_model(directory: Path, moe: bool = False) -> Path:
    """A Llama-shaped (or Mixtral-shaped, ``moe=True``) model directory with a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_model_config(len(VOCAB), moe)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(directory)
    return directory


def make_vllm_config(
    model_dir: Path,
    *,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 1024,
    dp_size: int = 1,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = False,
    num_blocks: int = 1000,
    kv_transfer_config: KVTransferConfig | None = None,
    scheduler_cls: str | type | None = None,
    additional_config: dict[str, Any] | None = None,
    speculative_config: SpeculativeConfig | None = None,
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir), tokenizer=str(model_dir), dtype="float32", max_model_len=max_model_len, seed=0
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
        **({"scheduler_cls": scheduler_cls} if scheduler_cls is not None else {}),
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    parallel_config = ParallelConfig(data_parallel_size=dp_size)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        **({"additional_config": additional_config} if additional_config is not None else {}),
    )
    # These configs stand in for an accelerator's. On vLLM's CPU build (the v0.32.0-cpu line) the detected CPU
    # platform turns async scheduling off (its kernels gain nothing from it); keep what the caller asked for, as
    # the accelerator platforms do.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    return vllm_config


def kv_cache_config_for(vllm_config: VllmConfig) -> KVCacheConfig:
    num_blocks = vllm_config.cache_config.num_gpu_blocks or 1000
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )


def build_scheduler(scheduler_cls: type, vllm_config: VllmConfig) -> Any:
    """Construct ``scheduler_cls`` exactly as vLLM's EngineCore does (keyword arguments)."""
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config_for(vllm_config),
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False,
        log_stats=True,
        block_size=BLOCK_SIZE,
    )


_none_hash_ready = False


def make_request(
    request_id: str,
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    arrival_time: float | None = None,
    resumable: bool = False,
    mm_features: list[Any] | None = None,
    **sampling: Any,
) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens, **sampling)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    seed = zlib.crc32(request_id.encode())  # stable across processes, unlike hash()
    prompt = [3 + (seed + i) % 100 for i in range(num_prompt_tokens)]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        resumable=resumable,
        mm_features=mm_features,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def make_json_request(
    vllm_config: VllmConfig, request_id: str, num_prompt_tokens: int = 8, max_tokens: int = 4
) -> Request:
    """A JSON-mode (structured-output) request, validated as vLLM's input processor does.

    The caller must also hand it to ``scheduler.structured_output_manager.grammar_init`` (as
    ``EngineCore.add_request`` does); it waits in ``WAITING_FOR_FSM`` until the grammar compiles.
    """
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tokenizers import cached_tokenizer_from_config

    request = make_request(
        request_id, num_prompt_tokens, max_tokens, structured_outputs=StructuredOutputsParams(json={"type": "object"})
    )
    request.sampling_params.verify(
        vllm_config.model_config,
        None,
        vllm_config.structured_outputs_config,
        cached_tokenizer_from_config(vllm_config.model_config),
    )
    return request


@contextlib.contextmanager
def torch_npu_stubbed_for_import() -> Iterator[None]:
    """An empty ``torch_npu`` module while vllm-ascend code that merely imports it is imported.

    vllm-ascend 0.23's balance module imports ``vllm_ascend.utils``, which imports torch_npu at
    the top and uses none of it at import time. The stub is removed afterwards: a lasting one
    would mislead libraries that probe for torch_npu. Does nothing where torch_npu exists.
    """
    stubbed = importlib.util.find_spec("torch_npu") is None
    if stubbed:
        sys.modules["torch_npu"] = types.ModuleType("torch_npu")
    try:
        yield
    finally:
        if stubbed:
            sys.modules.pop("torch_npu", None)


def runner_output(req_ids: list[str], sampled: list[list[int]], **extra: Any) -> ModelRunnerOutput:
    """The model executor's output for ``req_ids``: ``sampled[i]`` are request i's new token ids."""
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        **extra,
    )


def fake_model_output(scheduler: Any, scheduler_output: Any, token_id: int = 5) -> ModelRunnerOutput:
    """One sampled token per scheduled request, none for a request still mid-prefill."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return runner_output(req_ids, [[] if scheduler.requests[r].is_prefill_chunk else [token_id] for r in req_ids])


def gathered(rows: Sequence[Sequence[int]]) -> memoryview:
    """What the gather leaves for ranks given as (count, waiting requests, prefill tokens, step us), as the adaptive
    rule reads it: their ``balance_rule.ROW``s, rank after rank, flat int32."""
    return memoryview(array.array("i", [v for row in rows for v in row]))


def emulate_gather(schedulers: Sequence[Any], counts: Sequence[int] | None = None) -> None:
    """What ``balance_gather``'s all-gather leaves on every rank, then the gate's decision (``balance_update``):
    every scheduler's ``balance_row()`` in rank order, or, given ``counts``, those counts with nothing else to
    report (no waiting request, no finished step), written in place."""
    rows = [s.balance_row() for s in schedulers] if counts is None else [[c] + [0] * 3 for c in counts]
    for scheduler in schedulers:
        assert len(rows) == len(scheduler.balance_queue), (rows, len(scheduler.balance_queue))
        if not hasattr(scheduler, "balance_update"):  # vllm-ascend's copy: one count per rank
            for slot, row in zip(scheduler.balance_queue, rows):
                slot.fill_(row[0])
            continue
        scheduler._balance_rows.copy_(torch.tensor(rows, dtype=torch.int32))
        scheduler.balance_update()


def step(scheduler: Any) -> tuple[Any, Any]:
    """One engine step: schedule, fake the model, feed the output back."""
    output = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(output, fake_model_output(scheduler, output))
    return output, engine_outputs
