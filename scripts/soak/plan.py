"""The soak's request plan: identical on every rank (built from the seed), so each rank knows
what every other rank receives and all ranks agree on when a wave must follow.

A scenario is a list of waves. A wave starts with a burst (delivered together with the
coordinator's START_DP_WAVE, after an idle gap that differs per rank) and may have mid-wave
arrivals keyed to the wave's step index; arrivals whose step the wave did not reach move to the
next wave (an extra wave is added when needed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SCENARIOS = ("uneven", "idle-rank", "waves", "blocked", "random")


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    rank: int
    prompt_tokens: int
    max_tokens: int
    blocked: str = ""  # "", "fsm" (JSON mode, grammar not ready yet) or "remote-kv"
    blocked_steps: int = 0  # engine steps on its rank until the grammar / KV is ready


@dataclass
class Wave:
    burst: list[RequestSpec] = field(default_factory=list)
    mid: dict[int, list[RequestSpec]] = field(default_factory=dict)  # wave step -> arrivals
    idle_gap_s: list[float] = field(default_factory=list)  # per rank, before the burst


def _spec(
    rng: random.Random, name: str, index: int, rank: int, *, long: bool = False, blocked: str = ""
) -> RequestSpec:
    prompt = rng.randrange(48, 200) if long else rng.randrange(4, 64)
    max_tokens = rng.randrange(24, 64) if long else rng.randrange(1, 24)
    return RequestSpec(f"{name}-{index}", rank, prompt, max_tokens, blocked, rng.randrange(1, 40) if blocked else 0)


def _gaps(rng: random.Random, dp: int, longest: float = 0.05) -> list[float]:
    return [rng.uniform(0.0, longest) for _ in range(dp)]


def build_plan(scenario: str, dp: int, requests: int, seed: int) -> list[Wave]:
    """Waves of ``scenario`` with ``requests`` requests over ``dp`` ranks."""
    rng = random.Random(f"{seed}-{scenario}")
    name = scenario
    if scenario == "uneven":
        # Rank 0 gets most of the load, with long requests: it drains last.
        waves = [Wave(idle_gap_s=_gaps(rng, dp))]
        for i in range(requests):
            rank = 0 if i % 3 else rng.randrange(dp)
            spec = _spec(rng, name, i, rank, long=rank == 0)
            if i < requests // 2:
                waves[0].burst.append(spec)
            else:
                waves[0].mid.setdefault(rng.randrange(1, 60), []).append(spec)
        return waves
    if scenario == "idle-rank":
        # The last rank never receives a request; it runs dummy steps and gathers zeros.
        waves = [Wave(idle_gap_s=_gaps(rng, dp)) for _ in range(2)]
        for i in range(requests):
            spec = _spec(rng, name, i, rng.randrange(max(dp - 1, 1)))
            wave = waves[i % 2]
            if i % 4 == 0:
                wave.burst.append(spec)
            else:
                wave.mid.setdefault(rng.randrange(0, 40), []).append(spec)
        return waves
    if scenario == "waves":
        # Bursts separated by idle gaps; some bursts land on a single rank only.
        count = max(2, min(8, requests // 5))
        waves = [Wave(idle_gap_s=_gaps(rng, dp, longest=0.2)) for _ in range(count)]
        for i in range(requests):
            wave_index = i % count
            rank = wave_index % dp if wave_index % 2 else rng.randrange(dp)
            waves[wave_index].burst.append(_spec(rng, name, i, rank))
        return waves
    if scenario == "blocked":
        # JSON-mode requests waiting for their grammar, requests waiting for remote KV.
        waves = [Wave(idle_gap_s=_gaps(rng, dp)) for _ in range(2)]
        for i in range(requests):
            kind = ("fsm", "remote-kv", "")[i % 3]
            spec = _spec(rng, name, i, rng.randrange(dp), long=i % 5 == 0, blocked=kind)
            wave = waves[i % 2]
            if i % 2:
                wave.burst.append(spec)
            else:
                wave.mid.setdefault(rng.randrange(0, 30), []).append(spec)
        return waves
    if scenario == "random":
        count = max(1, requests // 25)
        waves = [Wave(idle_gap_s=_gaps(rng, dp)) for _ in range(count)]
        for i in range(requests):
            spec = RequestSpec(f"{name}-{i}", rng.randrange(dp), rng.randrange(1, 300), rng.randrange(1, 80))
            wave = waves[rng.randrange(count)]
            if rng.random() < 0.3:
                wave.burst.append(spec)
            else:
                wave.mid.setdefault(rng.randrange(0, 100), []).append(spec)
        return waves
    raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)}, all)")


def split_requests(scenarios: list[str], requests: int) -> dict[str, int]:
    """``requests`` spread over ``scenarios`` (at least one each)."""
    base, extra = divmod(requests, len(scenarios))
    return {s: max(1, base + (i < extra)) for i, s in enumerate(scenarios)}
