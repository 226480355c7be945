"""Requests that arrive with their prompt's KV held remotely (the decode side of P/D disaggregation).

A remote-KV request carries ``kv_transfer_params = {"do_remote_prefill": True}``; the tests' fake
connector (``scripts/fake_remote_kv.py``, asynchronous) claims all its prompt tokens but the last,
so the request waits in ``WAITING_FOR_REMOTE_KVS`` (holding its KV blocks, in vLLM >= 0.31's
``kv_holding_waiting``) until the worker reports the load in ``finished_recving``; then it
schedules one prompt token and samples. ``RemoteKVLoads`` is that worker: a load finishes a fixed
number of the rank's model steps after the rank first sees it (as the soak's ``FakeExecutor``).
Nothing here is used unless the workload asks for remote-KV requests: without them no connector
is configured and the schedule is exactly the one without this module.
"""

from __future__ import annotations

import random
from typing import Any

from vllm.v1.outputs import KVConnectorOutput

REMOTE_PREFILL = {"do_remote_prefill": True}


def remote_kv_requests(count: int, fraction: float, rng: random.Random) -> frozenset[int]:
    """Indices of the ``round(count * fraction)`` requests that arrive with remote KV."""
    return frozenset(rng.sample(range(count), round(count * fraction))) if fraction > 0 else frozenset()


def is_remote_kv(request: Any) -> bool:
    return bool((request.kv_transfer_params or {}).get("do_remote_prefill"))


class RemoteKVLoads:
    """The worker side of every rank's fake connector: loads finish ``delay_steps`` model steps
    after the rank's first step that sees them loading."""

    def __init__(self, dp_size: int, delay_steps: int) -> None:
        if delay_steps < 1:
            raise ValueError(f"a remote KV load takes at least one step, got {delay_steps}")
        self.delay_steps = delay_steps
        self._steps = [0] * dp_size
        self._ready_at: list[dict[str, int]] = [{} for _ in range(dp_size)]

    def output(self, rank: int, connector: Any) -> KVConnectorOutput:
        """The ``kv_connector_output`` of ``rank``'s model output for its next step."""
        self._steps[rank] += 1
        now, ready_at = self._steps[rank], self._ready_at[rank]
        for request_id in connector.loading:
            ready_at.setdefault(request_id, now + self.delay_steps)
        done = {r for r in connector.loading if ready_at[r] <= now}
        connector.loading -= done
        connector.loaded |= done
        for request_id in done:
            del ready_at[request_id]
        return KVConnectorOutput(finished_recving=done or None)
