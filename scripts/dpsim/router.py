"""Which DP rank a new request goes to.

``round-robin`` ignores load. ``lb`` is vLLM's DP load-balancing rule (``DPLBAsyncMPClient.
get_core_engine_for_request`` in vLLM 0.18): the rank with the lowest ``4 * waiting + running``,
ties to the lowest index, from a snapshot of the ranks' counts that the DP coordinator refreshes
periodically (every 100 ms in vLLM); between refreshes the client adds each routed request to its
local copy of the chosen rank's waiting count. The stale snapshot is one source of imbalance: a
request sent right after a response usually does not see the slot that response freed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

ROUTERS = ("round-robin", "lb")
# vLLM's DP load balancer weighs a waiting request as four running ones.
WAITING_WEIGHT = 4

# (waiting, running) of every rank, read from the schedulers.
CountsReader = Callable[[], Sequence[tuple[int, int]]]


class RoundRobinRouter:
    def __init__(self, dp_size: int) -> None:
        self._dp_size = dp_size
        self._next = 0

    def observe(self, now: float) -> None:
        """Round-robin ignores load."""

    def route(self, now: float) -> int:
        rank = self._next
        self._next = (self._next + 1) % self._dp_size
        return rank


class LoadBalancingRouter:
    """vLLM's rule over counts the DP coordinator publishes every ``stats_interval_s``.

    ``observe`` is told the ranks' counts after every step; the snapshot published at a tick is
    the last state observed before that tick, so a slot freed by a step that ended after the
    tick is invisible until the next one (interval 0: every step is published at once).
    """

    def __init__(self, read_counts: CountsReader, stats_interval_s: float) -> None:
        self._read_counts = read_counts
        self._interval_s = stats_interval_s
        self._observed: list[list[int]] = [[w, r] for w, r in read_counts()]
        self._snapshot: list[list[int]] = [list(c) for c in self._observed]
        self._tick = 0

    def observe(self, now: float) -> None:
        """A step ended at ``now``: maybe publish the state before it, then record the new one."""
        if self._interval_s <= 0:
            self._observed = [[w, r] for w, r in self._read_counts()]
            self._snapshot = [list(c) for c in self._observed]
            return
        tick = int(now // self._interval_s)
        if tick > self._tick:
            self._tick = tick
            self._snapshot = [list(c) for c in self._observed]
        self._observed = [[w, r] for w, r in self._read_counts()]

    def route(self, now: float) -> int:
        scores = [WAITING_WEIGHT * waiting + running for waiting, running in self._snapshot]
        rank = scores.index(min(scores))
        # The client counts its own sends until the next published snapshot.
        self._snapshot[rank][0] += 1
        return rank


def make_router(
    name: str, dp_size: int, read_counts: CountsReader, stats_interval_s: float
) -> RoundRobinRouter | LoadBalancingRouter:
    if name == "round-robin":
        return RoundRobinRouter(dp_size)
    if name == "lb":
        return LoadBalancingRouter(read_counts, stats_interval_s)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
