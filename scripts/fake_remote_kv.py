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
"""A scheduler-side stand-in for a remote KV connector (no remote peer exists on CPU).

One fake for the unit tests and the soak. A request is "remote" when the config's
``kv_connector_extra_config["matched_tokens"]`` is positive (every request: that many prompt tokens
are claimed to be held remotely) or when its ``kv_transfer_params`` ask ``do_remote_prefill`` (all
prompt tokens but the last). ``is_async`` makes the load asynchronous: the request then waits in
``WAITING_FOR_REMOTE_KVS`` until the worker side (the test, or the soak's fake executor) reports it
in ``finished_recving``; ``loading`` / ``loaded`` track that. Worker-side methods are never called
by the scheduler and refuse loudly if they are.
"""

from __future__ import annotations

from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

NAME = "BalanceTestFakeRemoteKV"


class FakeRemoteKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.matched_tokens = int(extra.get("matched_tokens", 0))
        self.is_async = bool(extra.get("is_async", False))
        self.allocated: list[str] = []  # requests given remote tokens, in order
        self.loading: set[str] = set()  # requests whose KV is being "received"
        self.loaded: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        flagged = (request.kv_transfer_params or {}).get("do_remote_prefill")
        if request.request_id in self.loaded or request.num_computed_tokens or not (flagged or self.matched_tokens):
            return 0, False
        # Leave at least one prompt token to compute locally, as real connectors do.
        claimed = request.num_prompt_tokens - 1 if flagged else min(self.matched_tokens, request.num_prompt_tokens - 1)
        hits = max(claimed - num_computed_tokens, 0)
        return hits, self.is_async and hits > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            self.allocated.append(request.request_id)
            if self.is_async:
                self.loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self.loading.discard(request.request_id)
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise AssertionError("worker-side method called on the scheduler-side fake")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("worker-side method called on the scheduler-side fake")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise AssertionError("worker-side method called on the scheduler-side fake")

    def wait_for_save(self) -> None:
        raise AssertionError("worker-side method called on the scheduler-side fake")


def async_kv_transfer_config() -> KVTransferConfig:
    """The config that selects this fake, asynchronous (a load takes steps), on a PD-mixed instance (the soak's and
    the simulator's)."""
    return KVTransferConfig(
        kv_connector=FakeRemoteKVConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_connector_extra_config={"is_async": True},
    )


def register() -> None:
    """Make ``kv_connector=NAME`` resolvable in this process (idempotent)."""
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, __name__, FakeRemoteKVConnector.__name__)
