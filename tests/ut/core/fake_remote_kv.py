"""A scheduler-side stand-in for a remote KV connector (no remote peer exists on CPU).

Configured through ``kv_connector_extra_config``: ``matched_tokens`` is how many prompt tokens it
claims a remote peer holds, ``is_async`` whether loading them is asynchronous (the request then
waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports ``finished_recving``). Worker-side
methods are never called by the scheduler tests and refuse loudly if they are.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

NAME = "BalanceTestFakeRemoteKV"


class FakeRemoteKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.matched_tokens = int(extra.get("matched_tokens", 0))
        self.is_async = bool(extra.get("is_async", False))
        self.allocated: list[str] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.num_computed_tokens or num_computed_tokens >= self.matched_tokens:
            return 0, False
        # Leave at least one prompt token to compute locally, as real connectors do.
        hits = min(self.matched_tokens, request.num_prompt_tokens - 1) - num_computed_tokens
        return max(hits, 0), self.is_async and hits > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            self.allocated.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise AssertionError("worker-side method called in a scheduler test")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("worker-side method called in a scheduler test")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        raise AssertionError("worker-side method called in a scheduler test")

    def wait_for_save(self) -> None:
        raise AssertionError("worker-side method called in a scheduler test")


def register() -> None:
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, __name__, FakeRemoteKVConnector.__name__)
