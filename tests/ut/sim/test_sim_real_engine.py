"""The simulator against the real engine: the trace fitter recovers known costs, the real-cpu presets
run, and the two mechanisms added for it (costs every rank pays for the whole group's tokens, the
front end's arrival delay) change what they should and nothing when off."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import simulate_dp
from dpsim.cluster import prepare_model_dir
from dpsim.costmodel import profile_from_dict, with_values
from dpsim.real_check import check, measured
from dpsim.settings import REAL_CPU_ARMS, REAL_CPU_REGIMES, Arm
from dpsim.simulation import run
from dpsim.trace_fit import MODELS, fit, fit_all, steps_of

TRUE_BOTH = {
    "step_overhead_ms": 20.0,
    "prefill_ms_per_token": 0.04,
    "decode_ms_per_request": 0.5,
    "prefill_ms_per_token_all_ranks": 0.07,
    "decode_ms_per_request_all_ranks": 0.2,
    "prefill_step_overhead_ms": 10.0,
}


def synthetic_run(
    costs: dict[str, float],
    arm: str = "off",
    regime: str = "closed-4-fixed",
    steps: int = 400,
    noise_ms: float = 0.0,
    seed: int = 0,
) -> dict:
    """A bench run whose step times follow ``costs`` exactly (plus optional noise)."""
    rng = random.Random(seed)
    records, t = [], 100.0
    for it in range(steps):
        work = [(rng.choice([0, 0, 0, rng.randint(1, 2048)]), rng.randint(0, 32)) for _ in range(2)]
        own = max(p * costs.get("prefill_ms_per_token", 0) + d * costs.get("decode_ms_per_request", 0) for p, d in work)
        total_p, total_d = sum(p for p, _ in work), sum(d for _, d in work)
        step_ms = (
            costs["step_overhead_ms"]
            + own
            + total_p * costs.get("prefill_ms_per_token_all_ranks", 0)
            + total_d * costs.get("decode_ms_per_request_all_ranks", 0)
            + (costs.get("prefill_step_overhead_ms", 0) if total_p else 0)
            + rng.gauss(0, noise_ms)
        )
        for rank, (p, d) in enumerate(work):
            records.append(
                {
                    "it": it,
                    "t": t,
                    "dt": step_ms / 1000 - 0.0005,
                    "rank": rank,
                    "prefill_tokens": p,
                    "decode_reqs": d,
                    "running": d,
                    "waiting": 0,
                    "cap": 32,
                    "closed": 0,
                    "admitted": 0,
                }
            )
        t += step_ms / 1000
    return {
        "arm": arm,
        "regime": regime,
        "rep": 0,
        "wall_s": t - 100.0 + 1.0,
        "completed": 32,
        "output_throughput": 100.0,
        "mean_tpot_ms": 20.0,
        "mean_ttft_ms": 500.0,
        "mean_e2el_ms": 3000.0,
        "engine": {"records": records},
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_fitter_recovers_known_coefficients(model: str) -> None:
    truth = {name: TRUE_BOTH[name] for name in MODELS[model]}
    steps = steps_of([synthetic_run(truth)])
    assert len(steps.cost_s) == 399  # the last iteration has no successor: not used
    fitted = fit(steps, model)
    assert fitted.rmse_ms < 0.01
    for name, value in truth.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-3, abs=1e-6), name


def test_fits_tell_the_cost_structures_apart() -> None:
    # Totals over ranks priced, with noise: the sum model fits, the max model cannot.
    sums = {k: v for k, v in TRUE_BOTH.items() if k in MODELS["sum"]}
    fits = fit_all(steps_of([synthetic_run(sums, noise_ms=1.0)]))
    assert fits["sum"].rmse_ms < 1.2 < 3 * 1.2 < fits["max"].rmse_ms
    assert fits["sum"].coefficients["prefill_ms_per_token_all_ranks"] == pytest.approx(0.07, rel=0.02)


def test_idle_gaps_are_not_step_cost() -> None:
    run_ = synthetic_run({"step_overhead_ms": 20.0})
    for record in run_["engine"]["records"]:
        if record["it"] >= 200:
            record["t"] += 5.0  # the engine waited 5 s for a request before iteration 200
    steps = steps_of([run_])
    assert len(steps.cost_s) == 398 and max(steps.cost_s) < 0.021


def test_fit_trace_cli_writes_a_usable_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([synthetic_run(TRUE_BOTH), synthetic_run(TRUE_BOTH, arm="balance", seed=1)]))
    out = tmp_path / "p.json"
    assert simulate_dp.main(["--fit-trace", str(runs), "--arm", "off", "--profile-out", str(out)]) == 0
    assert "1 run(s) of arm off" in capsys.readouterr().out
    profile = profile_from_dict(json.loads(out.read_text()), str(out))
    assert profile.prefill_ms_per_token_all_ranks == pytest.approx(0.07, rel=1e-3)
    assert profile.async_scheduling is False


def test_real_cpu_presets_match_the_bench() -> None:
    # The bench's regimes (scripts/bench_engine.py REGIMES), read from its source: the bench imports the harness.
    import ast

    source = (Path(simulate_dp.__file__).parent / "bench_engine.py").read_text()
    calls = [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Regime" and len(n.args) == 2
    ]
    bench = {}
    for call in calls:
        name, seqs = (ast.literal_eval(a) for a in call.args)
        bench[name] = {"max_num_seqs": seqs, **{k.arg: ast.literal_eval(k.value) for k in call.keywords}}
    assert set(bench) == set(REAL_CPU_REGIMES)
    for name, regime in bench.items():
        s = REAL_CPU_REGIMES[name]
        assert (s.dp_size, s.max_num_seqs, s.num_requests, s.max_num_batched_tokens) == (
            2,
            regime["max_num_seqs"],
            regime["num_prompts"],
            2048,
        )
        assert s.concurrency == regime.get("concurrency") and s.request_rate == regime.get("request_rate")
        assert s.prompt_spread == s.output_spread == regime.get("range_ratio", 0.0)
        assert (s.prompt_tokens, s.output_tokens) == (1024, 128)


SMALL = dataclasses.replace(
    REAL_CPU_REGIMES["closed-4-fixed"], num_requests=12, gate="cap"
)  # the gate's mechanics: upstream's rule closes from the counts alone


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model_dir(tmp_path_factory.mktemp("real-cpu-model"), SMALL.max_model_len)


COSTS = profile_from_dict({"step_overhead_ms": 20.0, "decode_ms_per_request": 0.5, "prefill_ms_per_token": 0.08})


def test_costs_every_rank_pays_make_aligned_prefills_cost_the_same_as_apart(model: Path) -> None:
    # Same total per-token price: per rank (max) vs for the whole group (sum).
    own = run(SMALL, COSTS, Arm("off", False), model_dir=model)
    shared = with_values(COSTS, {"prefill_ms_per_token": 0.0, "prefill_ms_per_token_all_ranks": 0.08}, "test")
    group = run(SMALL, shared, Arm("off", False), model_dir=model)
    assert own.summary["steps"] == group.summary["steps"]  # the schedule does not change, only its price
    # Both ranks prefill together in the first steps: priced once under max, twice under sum.
    assert group.summary["e2e_s"] > own.summary["e2e_s"]
    off = with_values(COSTS, {"prefill_ms_per_token_all_ranks": 0.0}, "test")
    assert run(SMALL, off, Arm("off", False), model_dir=model).summary == {
        **own.summary,
        "sim_wall_s": pytest.approx(own.summary["sim_wall_s"], abs=1e9),
        "sim_cpu_s": pytest.approx(own.summary["sim_cpu_s"], abs=1e9),
    }


def test_arrival_delay_counts_in_ttft_and_idles_the_closed_loop(model: Path) -> None:
    base = run(SMALL, COSTS, Arm("off", False), model_dir=model).summary
    delayed = run(
        SMALL, with_values(COSTS, {"arrival_delay_ms": 500.0}, "test"), Arm("off", False), model_dir=model
    ).summary
    assert delayed["ttft_mean_ms"] == pytest.approx(base["ttft_mean_ms"] + 500.0, abs=60.0)
    assert delayed["output_tok_s"] < base["output_tok_s"]  # freed slots wait for the next request
    # Spread desynchronises the ranks: the gate then closes (without spread, fixed lengths stay in step).
    spread = with_values(COSTS, {"arrival_delay_ms": 500.0, "arrival_delay_spread": 0.5}, "test")
    gated = run(SMALL, spread, Arm("on", True), model_dir=model).summary
    assert gated["gated_rank_steps"] > 0


def test_check_against_prints_predicted_beside_measured(tmp_path: Path) -> None:
    runs = [synthetic_run(TRUE_BOTH, arm=arm, seed=i) for i, arm in enumerate(REAL_CPU_ARMS)]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))

    def fake_sims(keys: dict) -> dict:
        assert {arm for _, arm in keys} == set(REAL_CPU_ARMS)
        for _, _, costs in keys.values():
            assert costs["prefill_ms_per_token_all_ranks"] == pytest.approx(0.07, rel=1e-3)  # fitted on off only
        return {key: {"output_tok_s": 100.0, "tpot_mean_ms": 20.0, "ttft_mean_ms": 500.0} for key in keys}

    text, fitted, _ = check(path, fake_sims)
    assert fitted.model == "both"
    lines = [line for line in text.splitlines() if line.startswith("closed-4-fixed")]
    assert len(lines) == 3 and all("+0.0" in line for line in lines)
    assert measured(runs, fitted)[("closed-4-fixed", "off")]["n"] == 1


def test_real_cpu_preset_runs_every_regime_and_arm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Smaller regimes, same deployment: every regime and arm runs through the CLI.
    small = {name: dataclasses.replace(s, num_requests=8) for name, s in REAL_CPU_REGIMES.items()}
    monkeypatch.setattr("dpsim.settings.REAL_CPU_REGIMES", small)
    assert simulate_dp.main(["--preset", "real-cpu", "--compare-policies", "--no-progress", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    for name in small:
        assert sum(name in line for line in out.splitlines()) == 3 + 4  # changes, then every arm


def test_check_fits_the_arrival_delay_on_the_off_arm_ttft(tmp_path: Path) -> None:
    runs = [synthetic_run(TRUE_BOTH, arm=arm, seed=i) for i, arm in enumerate(REAL_CPU_ARMS)]  # TTFT 500 ms
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    seen: list[dict] = []

    def fake_sims(keys: dict) -> dict:
        seen.append(keys)
        return {
            key: {"output_tok_s": 100.0, "tpot_mean_ms": 20.0, "ttft_mean_ms": 200.0 + costs["arrival_delay_ms"]}
            for key, (_, _, costs) in keys.items()
        }

    text, _, _ = check(path, fake_sims, fit_delay=True)
    assert set(seen[0]) == {("closed-4-fixed", "off")}  # the delay is fitted on the off arm only
    assert "fitted on the off arm's TTFT: 300 ms" in text
    assert all(costs["arrival_delay_ms"] == 300.0 for _, _, costs in seen[1].values())


def test_response_delay_idles_the_closed_loop_outside_ttft(model: Path) -> None:
    base = run(SMALL, COSTS, Arm("off", False), model_dir=model).summary
    slow = run(SMALL, with_values(COSTS, {"response_delay_ms": 500.0}, "test"), Arm("off", False), model_dir=model)
    assert slow.summary["output_tok_s"] < base["output_tok_s"]  # the next request is sent 0.5 s later
    assert slow.summary["ttft_mean_ms"] == pytest.approx(base["ttft_mean_ms"], rel=0.2)  # TTFT starts at the send
