"""The simulator's pure pieces: profile and cost model, routers, lengths, the client's arrival
process, MTP acceptance draws, vLLM's prefill-cadence rule and the --set/--sweep parameters."""

from __future__ import annotations

import random
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
from dpsim.cadence import PrefillCadence, should_throttle
from dpsim.costmodel import CostProfile, ProfileError, profile_from_dict, with_values
from dpsim.params import ParamError, apply, parse_sweep
from dpsim.router import LoadBalancingRouter, RoundRobinRouter, make_router
from dpsim.settings import SimSettings
from dpsim.speculative import AcceptanceModel
from dpsim.workload import Client, sample_shapes, spread_range

PROFILE = {"step_overhead_ms": 10, "decode_ms_per_request": 0.5, "prefill_ms_per_token": 0.01}


def test_cost_model_prices_the_slowest_rank() -> None:
    profile = profile_from_dict(PROFILE)
    decode_only = profile.rank_ms(0, 8)
    prefilling = profile.rank_ms(2000, 4)
    assert decode_only == pytest.approx(4.0)
    assert prefilling == pytest.approx(22.0)
    assert profile.step_s([decode_only, prefilling, 0.0]) == pytest.approx(0.032)
    assert profile.step_s([profile.rank_ms(0, 0)]) == pytest.approx(0.010)  # dummy batch


def test_mechanisms_default_off() -> None:
    """A profile with the three coefficients alone means plain decoding, sync, 100 ms stats."""
    profile = profile_from_dict(PROFILE)
    assert (
        profile.num_speculative_tokens,
        profile.async_scheduling,
        profile.step_noise_cv,
        profile.coordinator_publish_ms,
    ) == (0, False, 0.0, 100.0)


def test_step_noise_is_per_rank_and_seeded() -> None:
    """Each rank draws its own factor (mean 1); the step is the slowest rank's noisy time."""
    noisy = profile_from_dict({**PROFILE, "step_noise_cv": 0.2})
    draws = [noisy.step_s([0.0], random.Random(seed)) for seed in range(2000)]
    assert statistics.fmean(draws) == pytest.approx(0.010, rel=0.03)
    assert statistics.stdev(draws) / statistics.fmean(draws) == pytest.approx(0.2, rel=0.1)
    # Four ranks: the max of four draws is slower on average than one.
    four = [noisy.step_s([0.0] * 4, random.Random(seed)) for seed in range(2000)]
    assert statistics.fmean(four) > 1.1 * statistics.fmean(draws)
    assert noisy.step_s([5.0, 0.0], random.Random(7)) == noisy.step_s([5.0, 0.0], random.Random(7))


@pytest.mark.parametrize(
    "update, message",
    [
        ({"num_speculative_tokens": 2}, "needs acceptance_rate_mean"),
        ({"num_speculative_tokens": 1.5, "acceptance_rate_mean": 0.5}, "must be an integer"),
        ({"acceptance_rate_mean": 1.2}, "must be finite and in [0, 1]"),
        ({"async_scheduling": 1}, "must be true or false"),
        ({"coordinator_publish_ms": -1}, "must be finite and >= 0"),
    ],
)
def test_mechanism_parameters_are_checked(update: dict, message: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(message)):
        profile_from_dict({**PROFILE, **update})


def test_acceptance_rates_spread_per_request() -> None:
    model = AcceptanceModel(500, mean=0.7, spread=0.2, seed=3)
    assert min(model.rates) >= 0.5 and max(model.rates) <= 0.9
    assert max(model.rates) - min(model.rates) > 0.3
    fixed = AcceptanceModel(10, mean=0.6, spread=0.0, seed=3)
    assert set(fixed.rates) == {0.6}
    draws = [model.accepted(0, 3) for _ in range(4000)]
    assert set(draws) <= {0, 1, 2, 3}
    expected = AcceptanceModel.mean_tokens_per_step(model.rates[0], 3) - 1
    assert statistics.fmean(draws) == pytest.approx(expected, rel=0.05)
    assert AcceptanceModel(1, 1.0, 0.0, 0).accepted(0, 3) == 3
    assert AcceptanceModel(1, 0.0, 0.0, 0).accepted(0, 3) == 0


def test_acceptance_draws_are_per_request_streams() -> None:
    """The same request accepts the same tokens whatever other requests drew before it."""
    a, b = AcceptanceModel(4, 0.7, 0.2, seed=1), AcceptanceModel(4, 0.7, 0.2, seed=1)
    first = [a.accepted(2, 3) for _ in range(20)]
    for _ in range(50):
        b.accepted(0, 3)
    assert [b.accepted(2, 3) for _ in range(20)] == first


def test_interval_rule_on_the_step_counter() -> None:
    """DPEngineCoreProc._should_throttle_prefills (vLLM 0.27.1): admit on multiples only."""
    assert [should_throttle(n, 2) for n in range(6)] == [False, True, False, True, False, True]
    assert [should_throttle(n, 4) for n in range(5)] == [False, True, True, True, False]
    assert not any(should_throttle(n, 1) for n in range(10))


class _Req:
    def __init__(self, chunk: bool) -> None:
        self.is_prefill_chunk = chunk


class _Sched:
    def __init__(self, running: list[_Req], waiting: int) -> None:
        self.running = running
        self.waiting = [object()] * waiting


def test_cadence_defers_only_with_a_decode_and_no_saturation() -> None:
    cadence = PrefillCadence(2)
    decoding = _Sched([_Req(False), _Req(True)], waiting=3)
    assert cadence.defers(1, decoding) and not cadence.defers(2, decoding)
    # Only prefill chunks running: nothing to protect, no deferral (0.27.1's any(...) test).
    assert not cadence.defers(1, _Sched([_Req(True)], waiting=3))
    # A release step that left requests waiting marks the rank capacity-bound: no deferral...
    cadence.after_step(decoding, deferred=False, admission_block_ran=True)
    assert cadence.capacity_bound and not cadence.defers(1, decoding)
    # ...until a step that ran the admission block drains the queue.
    cadence.after_step(_Sched([], waiting=5), deferred=True, admission_block_ran=True)
    assert cadence.capacity_bound  # deferred steps leave the flag alone
    cadence.after_step(_Sched([], waiting=0), deferred=False, admission_block_ran=False)
    assert cadence.capacity_bound  # so do steps that did not run the admission block
    cadence.after_step(_Sched([], waiting=0), deferred=False, admission_block_ran=True)
    assert not cadence.capacity_bound


def test_set_and_sweep_reach_profile_and_settings(tmp_path: Path) -> None:
    profile = profile_from_dict(PROFILE)
    settings, changed = apply(
        SimSettings(),
        profile,
        {"acceptance_rate_spread": "0.3", "max_num_seqs": "16", "async_scheduling": "true", "request_rate": "none"},
    )
    assert changed.acceptance_rate_spread == 0.3 and changed.async_scheduling is True
    assert settings.max_num_seqs == 16 and settings.request_rate is None
    assert with_values(profile, {"step_noise_cv": 0.1}, "x").step_noise_cv == 0.1
    assert parse_sweep("prefill_ms_per_token=0.1, 0.2,0.3") == ("prefill_ms_per_token", ["0.1", "0.2", "0.3"])
    with pytest.raises(ParamError, match="unknown parameter 'nope'"):
        apply(SimSettings(), profile, {"nope": "1"})
    with pytest.raises(ParamError, match="max_num_seqs: expected int"):
        apply(SimSettings(), profile, {"max_num_seqs": "x"})
    with pytest.raises(ParamError, match="max_num_seqs must be >= 1"):
        apply(SimSettings(), profile, {"max_num_seqs": "0"})
    with pytest.raises(ParamError, match="'step_noise_cv' must be finite"):
        apply(SimSettings(), profile, {"step_noise_cv": "-1"})


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


def test_a_prefill_step_costs_every_rank_its_graph() -> None:
    profile = profile_from_dict({**PROFILE, "prefill_step_overhead_ms": 30})
    assert profile.step_s([4.0, 0.0]) == pytest.approx(0.014)
    assert profile.step_s([4.0, 0.0], prefill=True) == pytest.approx(0.044)


def _linear_run() -> Any:
    """A fake baseline run whose figures are linear in the costs (what a closed loop gives)."""

    def run_off(profiles: list[CostProfile]) -> list[dict[str, float]]:
        out = []
        for p in profiles:
            tpot = 0.5 * p.step_overhead_ms + 300 * p.prefill_ms_per_token
            ttft = 10 * p.step_overhead_ms + 40000 * p.prefill_ms_per_token
            out.append({"tpot_mean_ms": tpot, "ttft_mean_ms": ttft, "output_tok_s": 1e5 / tpot, "request_s": 1.0})
        return out

    return run_off


def test_calibration_fits_the_knob_and_scale_on_the_baseline_only() -> None:
    from dpsim.calibration import calibrate

    base = profile_from_dict({**PROFILE, "step_overhead_ms": 100, "decode_ms_per_request": 1})
    # Truth: overhead 60 (scale 0.6), prefill 0.2 ms/token.
    targets = {"tpot_mean_ms": 0.5 * 60 + 300 * 0.2, "ttft_mean_ms": 10 * 60 + 40000 * 0.2, "output_tok_s": 1.0}
    lines: list[str] = []
    fitted, summary = calibrate(
        base, targets, ("tpot_mean_ms", "ttft_mean_ms"), "prefill_ms_per_token", _linear_run(), lines.append
    )
    assert fitted.step_overhead_ms == pytest.approx(60, rel=1e-3)
    assert fitted.decode_ms_per_request == pytest.approx(0.6, rel=1e-3)  # ratio kept
    assert fitted.prefill_ms_per_token == pytest.approx(0.2, rel=1e-3)
    assert summary["tpot_mean_ms"] == pytest.approx(targets["tpot_mean_ms"], rel=0.01)
    assert len(lines) == 3  # two starting points, one secant step


def test_calibration_refuses_what_no_cost_can_reach() -> None:
    from dpsim.calibration import calibrate

    base = profile_from_dict(PROFILE)
    with pytest.raises(ValueError, match="no positive costs reach the targets"):
        calibrate(
            base,
            {"tpot_mean_ms": 10.0, "ttft_mean_ms": 1.0},
            ("tpot_mean_ms", "ttft_mean_ms"),
            "prefill_ms_per_token",
            _linear_run(),
            lambda line: None,
        )
