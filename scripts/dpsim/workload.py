"""What the benchmark client sends, and when.

Request lengths follow ``vllm bench serve``'s random dataset: uniform in ``[L(1-s), L(1+s)]``
(``--random-range-ratio``), so ``spread=0`` gives identical requests. The client is either a
closed loop at fixed concurrency (a finished request lets the next one go) or Poisson at a rate,
optionally capped by a concurrency limit (``--request-rate`` with ``--max-concurrency``). Every
send can be delayed by a uniform jitter: the client-side asymmetry (HTTP, detokenisation) that
breaks the lockstep symmetry of identical requests.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    output_tokens: int


def spread_range(mean: int, spread: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn with ``spread`` around ``mean`` (never below 1)."""
    low = max(1, round(mean * (1.0 - spread)))
    return low, max(low, round(mean * (1.0 + spread)))


def sample_shapes(
    count: int, prompt_tokens: int, output_tokens: int, prompt_spread: float, output_spread: float, rng: random.Random
) -> list[RequestShape]:
    prompt_low, prompt_high = spread_range(prompt_tokens, prompt_spread)
    output_low, output_high = spread_range(output_tokens, output_spread)
    return [
        RequestShape(rng.randint(prompt_low, prompt_high), rng.randint(output_low, output_high)) for _ in range(count)
    ]


class Client:
    """Issue times of requests ``0..count-1``, in order, as the serving side sees them."""

    def __init__(
        self, count: int, concurrency: int | None, request_rate: float | None, jitter_s: float, rng: random.Random
    ) -> None:
        if concurrency is None and request_rate is None:
            raise ValueError("a client needs a concurrency limit, a request rate, or both")
        self._count = count
        self._limit = concurrency if concurrency is not None else count
        self._jitter_s = jitter_s
        self._rng = rng
        planned = [0.0] * count
        if request_rate is not None:
            clock = 0.0
            for index in range(count):
                planned[index] = clock
                clock += rng.expovariate(request_rate)
        self._planned = planned
        self._next = 0
        self._in_flight = 0
        self._heap: list[tuple[float, int]] = []
        self._release(0.0)

    def _release(self, now: float) -> None:
        while self._next < self._count and self._in_flight < self._limit:
            jitter = self._rng.uniform(0.0, self._jitter_s) if self._jitter_s > 0 else 0.0
            heapq.heappush(self._heap, (max(self._planned[self._next], now) + jitter, self._next))
            self._next += 1
            self._in_flight += 1

    def due(self, now: float) -> list[tuple[float, int]]:
        """(issue time, request index) of every request sent by ``now``, oldest first."""
        sent = []
        while self._heap and self._heap[0][0] <= now:
            sent.append(heapq.heappop(self._heap))
        return sent

    def next_send_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def finished(self, now: float) -> None:
        """A response completed at ``now``: the closed loop may send the next request."""
        self._in_flight -= 1
        self._release(now)
