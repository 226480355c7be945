"""The simulator's pure pieces: cost model, routers, lengths and the client's arrival process."""

from __future__ import annotations

import random

import pytest
from dpsim.costmodel import CostProfile, ProfileError, profile_from_dict
from dpsim.router import LoadBalancingRouter, RoundRobinRouter, make_router
from dpsim.workload import Client, sample_shapes, spread_range

PROFILE = {"step_overhead_ms": 10, "decode_ms_per_request": 0.5, "prefill_ms_per_token": 0.01}


def test_cost_model_prices_the_slowest_rank() -> None:
    profile = profile_from_dict(PROFILE)
    decode_only = profile.rank_ms(0, 8)
    prefilling = profile.rank_ms(2000, 4)
    assert decode_only == pytest.approx(4.0)
    assert prefilling == pytest.approx(22.0)
    assert profile.step_s(max(decode_only, prefilling, 0.0)) == pytest.approx(0.032)
    assert profile.step_s(profile.rank_ms(0, 0)) == pytest.approx(0.010)  # dummy batch


def test_profile_needs_some_decode_cost() -> None:
    with pytest.raises(ProfileError, match="a decode step must cost time"):
        profile_from_dict({**PROFILE, "step_overhead_ms": 0, "decode_ms_per_request": 0})
    assert isinstance(profile_from_dict({**PROFILE, "calibration": "notes"}), CostProfile)


def test_round_robin_ignores_load() -> None:
    router = RoundRobinRouter(3)
    assert [router.route(0.0) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_lb_rule_weighs_waiting_four_times() -> None:
    counts = [(0, 9), (2, 0), (0, 8)]
    router = LoadBalancingRouter(lambda: counts, stats_interval_s=0.0)
    # Scores 9, 8, 8: lowest, ties to the lowest index.
    assert router.route(0.0) == 1
    # Its local waiting count grew by one (score 12): the next goes to rank 2.
    assert router.route(0.0) == 2


def test_lb_burst_spreads_with_local_increments() -> None:
    router = LoadBalancingRouter(lambda: [(0, 4)] * 4, stats_interval_s=0.1)
    assert sorted(router.route(0.0) for _ in range(8)) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_lb_snapshot_is_stale_until_the_next_tick() -> None:
    counts = [(0, 4), (0, 4)]
    router = LoadBalancingRouter(lambda: counts, stats_interval_s=0.1)
    counts = [(0, 4), (0, 3)]  # rank 1 freed a slot in a step ending at 0.05 s
    router.observe(0.05)
    assert router.route(0.05) == 0  # the published snapshot still says 4, 4
    counts = [(0, 5), (0, 3)]
    router.observe(0.12)  # tick 1 publishes the state observed before it
    assert router.route(0.12) == 1


def test_fresh_lb_sees_every_step() -> None:
    counts = [(0, 4), (0, 4)]
    router = make_router("lb", 2, lambda: counts, 0.0)
    counts = [(0, 4), (0, 3)]
    router.observe(0.01)
    assert router.route(0.01) == 1


def test_spread_bounds() -> None:
    assert spread_range(1000, 0.0) == (1000, 1000)
    assert spread_range(1000, 0.5) == (500, 1500)
    assert spread_range(1, 0.9) == (1, 2)
    shapes = sample_shapes(200, 100, 50, 0.2, 0.5, random.Random(0))
    assert {s.prompt_tokens for s in shapes} <= set(range(80, 121))
    assert min(s.output_tokens for s in shapes) >= 25 and max(s.output_tokens for s in shapes) <= 75
    assert len({s.output_tokens for s in shapes}) > 10


def test_closed_loop_keeps_concurrency() -> None:
    client = Client(5, concurrency=2, request_rate=None, jitter_s=0.0, rng=random.Random(0))
    assert client.due(0.0) == [(0.0, 0), (0.0, 1)]
    assert client.due(10.0) == []
    client.finished(3.0)
    assert client.due(3.0) == [(3.0, 2)]
    assert client.next_send_time() is None


def test_jitter_delays_each_send() -> None:
    client = Client(3, concurrency=3, request_rate=None, jitter_s=0.5, rng=random.Random(1))
    assert client.due(0.0) == []
    sent = client.due(0.5)
    assert len(sent) == 3 and all(0.0 < t <= 0.5 for t, _ in sent)


def test_poisson_with_a_cap() -> None:
    client = Client(50, concurrency=None, request_rate=10.0, jitter_s=0.0, rng=random.Random(2))
    times = [t for t, _ in client.due(1e9)]
    assert len(times) == 50 and times == sorted(times) and times[0] == 0.0
    assert 2.0 < times[-1] < 10.0  # 49 gaps of mean 0.1 s
    capped = Client(50, concurrency=1, request_rate=1000.0, jitter_s=0.0, rng=random.Random(2))
    assert len(capped.due(1e9)) == 1  # the next waits for a response
