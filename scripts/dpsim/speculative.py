"""Accepted draft tokens under MTP speculative decoding, per request and per step.

DeepSeek-V3.1 is served with MTP: each decode step verifies k draft tokens and keeps the
longest accepted prefix plus one sampled token, so a request gains 1..k+1 tokens per step. How
many depends on the text, so two requests of the same length finish at different steps; that is
what desynchronises DP ranks in a fixed-length benchmark. The model here: each request gets an
acceptance rate ``a`` (uniform in ``mean ± spread``, clipped to [0, 1]); in every step each draft
is accepted with probability ``a`` until the first rejection. The scheduler itself is vLLM's own
(``num_speculative_tokens`` k, rejected drafts rolled back in ``update_from_output``).

Every request draws from its own random stream, so the same request accepts the same tokens
in every policy compared (common random numbers: differences come from scheduling only).
"""

from __future__ import annotations

import random


class AcceptanceModel:
    def __init__(self, count: int, mean: float, spread: float, seed: int) -> None:
        rates = random.Random(seed)
        low, high = max(0.0, mean - spread), min(1.0, mean + spread)
        self.rates = [rates.uniform(low, high) for _ in range(count)]
        self._streams = [random.Random(seed * 1_000_003 + index + 1) for index in range(count)]

    def accepted(self, index: int, drafts: int) -> int:
        """Draft tokens accepted for request ``index`` in a step that verified ``drafts``."""
        rate, stream = self.rates[index], self._streams[index]
        accepted = 0
        while accepted < drafts and stream.random() < rate:
            accepted += 1
        return accepted

    @staticmethod
    def mean_tokens_per_step(rate: float, drafts: int) -> float:
        """Expected tokens a request gains per decode step: 1 + a + a^2 + ... + a^k."""
        return sum(rate**i for i in range(drafts + 1))
