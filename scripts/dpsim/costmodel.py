"""The deployment profile: step-time coefficients and the engine mechanisms, from a JSON file.

MoE data parallelism runs every rank's forward pass in lockstep (the expert all-to-all waits for
all ranks), so a step lasts as long as its slowest rank. A rank's share is linear in what it
scheduled: prefill tokens and decoding requests (each carrying its k+1 tokens under MTP); a rank
with nothing runs a dummy batch and costs only the fixed part. Each rank's time is multiplied by
its own noise draw (log-normal, mean 1, coefficient of variation ``step_noise_cv``). A step in
which any rank prefills also costs ``prefill_step_overhead_ms``: DP ranks agree on one graph mode
per step (vLLM 0.18 takes the minimum over ranks, ``vllm/v1/worker/dp_utils.py``
``_post_process_cudagraph_mode``; vllm-ascend 0.18 all-reduces ``with_prefill``,
``NPUModelRunner._sync_metadata_across_dp``), so with decode-only full graphs
(``cudagraph_mode`` ``FULL_DECODE_ONLY``, as both presets' recipes use) one rank's prefill makes
every rank run that step without its decode graph.

With expert parallelism and an all-gather / reduce-scatter MoE dispatch (vLLM's default on CPU and
in the naive all2all backend), every rank runs its local experts over ALL ranks' tokens, so part of
a rank's time follows the tokens of the whole DP group, not its own: ``prefill_ms_per_token_all_ranks``
and ``decode_ms_per_request_all_ranks`` price the step's total over ranks, paid once by every rank
(default 0: a rank's cost depends on its own batch only). Measured on a real engine
(``dpsim/trace_fit.py``): with that share, prefilling on two ranks at once costs about as much as
doing it in two steps, which is what balance scheduling bets on.

The same file holds the parameters of the mechanisms that shape the schedule, each switchable
(its default turns it off, so a profile with the three coefficients alone means plain decoding):
MTP speculative decoding (``num_speculative_tokens``, per-request acceptance rates), async
scheduling (vLLM's ``AsyncScheduler``, one batch in flight ahead) and the DP coordinator's
publish interval (how stale the router's load view is). See docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# key: (type, default or None when required, lower bound, upper bound or None, meaning)
PARAMETERS: dict[str, tuple[type, Any, float, float | None, str]] = {
    "step_overhead_ms": (
        float,
        None,
        0.0,
        None,
        "fixed cost of every lockstep step (launch, sampling, DP sync; a dummy batch costs only this)",
    ),
    "decode_ms_per_request": (float, None, 0.0, None, "extra cost per decoding request on a rank (its k+1 tokens)"),
    "prefill_ms_per_token": (float, None, 0.0, None, "extra cost per prefill token on a rank"),
    "prefill_step_overhead_ms": (
        float,
        0.0,
        0.0,
        None,
        "extra cost of a step in which any rank prefills (every rank leaves its decode-only graph)",
    ),
    "prefill_ms_per_token_all_ranks": (
        float,
        0.0,
        0.0,
        None,
        "cost per prefill token of any rank, paid by every rank (EP MoE over all-gathered tokens)",
    ),
    "decode_ms_per_request_all_ranks": (
        float,
        0.0,
        0.0,
        None,
        "cost per decoding request of any rank, paid by every rank (EP MoE over all-gathered tokens)",
    ),
    "arrival_delay_ms": (
        float,
        0.0,
        0.0,
        None,
        "time from the client's send to the request's arrival at the engine (API server: HTTP, tokenizing, "
        "routing; counted in TTFT, and in a closed loop the time a freed slot waits for its next request)",
    ),
    "arrival_delay_spread": (float, 0.0, 0.0, 1.0, "each request's arrival delay is uniform in delay x (1 ± spread)"),
    "response_delay_ms": (
        float,
        0.0,
        0.0,
        None,
        "closed loop: time from a request's last token to the client's next send (the response's way back)",
    ),
    "step_noise_cv": (float, 0.0, 0.0, 1.0, "per-rank step-time noise (coefficient of variation, log-normal)"),
    "num_speculative_tokens": (int, 0, 0, 16, "MTP draft tokens per decode step (0: no MTP)"),
    "acceptance_rate_mean": (float, 0.0, 0.0, 1.0, "mean per-draft acceptance rate of a request (MTP)"),
    "acceptance_rate_spread": (float, 0.0, 0.0, 1.0, "requests' acceptance rates are uniform in mean ± spread"),
    "async_scheduling": (
        bool,
        False,
        0,
        None,
        "vLLM's AsyncScheduler: the next batch is scheduled before the previous one's output is known",
    ),
    "coordinator_publish_ms": (
        float,
        100.0,
        0.0,
        None,
        "DP coordinator's load-stats publish interval seen by the router (vLLM: 100 ms; 0: always fresh)",
    ),
}
# Keys for humans only: where the numbers come from.
FREE_TEXT = {"name", "description", "calibration", "sources"}


class ProfileError(ValueError):
    """A profile that cannot be used (the message says which key and why)."""


@dataclass(frozen=True)
class CostProfile:
    step_overhead_ms: float
    decode_ms_per_request: float
    prefill_ms_per_token: float
    prefill_step_overhead_ms: float = 0.0
    prefill_ms_per_token_all_ranks: float = 0.0
    decode_ms_per_request_all_ranks: float = 0.0
    arrival_delay_ms: float = 0.0
    arrival_delay_spread: float = 0.0
    response_delay_ms: float = 0.0
    step_noise_cv: float = 0.0
    num_speculative_tokens: int = 0
    acceptance_rate_mean: float = 0.0
    acceptance_rate_spread: float = 0.0
    async_scheduling: bool = False
    coordinator_publish_ms: float = 100.0
    name: str = "custom"

    def rank_ms(self, prefill_tokens: int, decode_requests: int) -> float:
        """What one rank adds on top of the fixed overhead."""
        return prefill_tokens * self.prefill_ms_per_token + decode_requests * self.decode_ms_per_request

    def shared_ms(self, prefill_tokens: int, decode_requests: int) -> float:
        """What every rank pays for the whole group's work (totals over ranks)."""
        return (
            prefill_tokens * self.prefill_ms_per_token_all_ranks
            + decode_requests * self.decode_ms_per_request_all_ranks
        )

    def step_s(
        self,
        rank_work_ms: list[float],
        noise: random.Random | None = None,
        prefill: bool = False,
        shared_ms: float = 0.0,
    ) -> float:
        """Lockstep step time: the slowest rank, each rank's time with its own noise draw;
        ``prefill``: some rank prefills in this step; ``shared_ms``: what every rank pays."""
        fixed = self.step_overhead_ms + (self.prefill_step_overhead_ms if prefill else 0.0) + shared_ms
        if not self.step_noise_cv or noise is None:
            return (fixed + max(rank_work_ms)) / 1000.0
        sigma = math.sqrt(math.log1p(self.step_noise_cv**2))
        return max((fixed + work) * noise.lognormvariate(-sigma * sigma / 2, sigma) for work in rank_work_ms) / 1000.0

    def values(self) -> dict[str, Any]:
        """The parameters (no name), as a profile file holds them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k in PARAMETERS}


def _check(key: str, value: Any, source: str) -> Any:
    kind, _, low, high, meaning = PARAMETERS[key]
    if kind is bool:
        if not isinstance(value, bool):
            raise ProfileError(f"{source}: {key!r} must be true or false ({meaning}), got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{source}: {key!r} must be a number ({meaning}), got {value!r}")
    if kind is int and value != int(value):
        raise ProfileError(f"{source}: {key!r} must be an integer, got {value!r}")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bounds = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        raise ProfileError(f"{source}: {key!r} must be finite and {bounds}, got {value!r}")
    return kind(value)


def profile_from_dict(data: Any, source: str = "profile") -> CostProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(PARAMETERS) - FREE_TEXT)
    if unknown:
        raise ProfileError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(PARAMETERS) + sorted(FREE_TEXT)}")
    values: dict[str, Any] = {}
    for key, (_, default, _, _, meaning) in PARAMETERS.items():
        if key not in data:
            if default is None:
                raise ProfileError(f"{source}: missing key {key!r} ({meaning})")
            values[key] = default
        else:
            values[key] = _check(key, data[key], source)
    if values["step_overhead_ms"] + values["decode_ms_per_request"] <= 0:
        raise ProfileError(f"{source}: a decode step must cost time (step_overhead_ms or decode_ms_per_request > 0)")
    if values["num_speculative_tokens"] and "acceptance_rate_mean" not in data:
        raise ProfileError(f"{source}: num_speculative_tokens > 0 needs acceptance_rate_mean")
    name = data.get("name", Path(source).stem)
    return CostProfile(name=str(name), **values)


def with_values(profile: CostProfile, overrides: dict[str, Any], source: str) -> CostProfile:
    """``profile`` with some parameters replaced, checked like a profile file."""
    data = {**profile.values(), "name": profile.name, **overrides}
    return profile_from_dict(data, source)


def load_profile(path: Path) -> CostProfile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read cost profile {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    return profile_from_dict(data, str(path))
