"""Step time of a lockstep DP step, from a JSON cost profile.

MoE data parallelism runs every rank's forward pass in lockstep (the expert all-to-all waits for
all ranks), so a step lasts as long as its slowest rank. A rank's share is linear in what it
scheduled: prefill tokens and decoding requests; a rank with nothing runs a dummy batch and costs
only the fixed part. The profile holds the three coefficients, so users can plug in numbers
measured on their own hardware (see docs/simulator.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Keys of the profile that carry numbers, with what each means (shown in error messages).
COEFFICIENTS = {
    "step_overhead_ms": "fixed cost of every lockstep step (launch, sampling, DP sync; a "
                        "dummy batch costs only this)",
    "decode_ms_per_request": "extra cost per decoding request on the slowest rank",
    "prefill_ms_per_token": "extra cost per prefill token on the slowest rank",
}
# Keys for humans only: where the numbers come from.
FREE_TEXT = {"name", "description", "calibration"}


class ProfileError(ValueError):
    """A cost profile that cannot be used (the message says which key and why)."""


@dataclass(frozen=True)
class CostProfile:
    step_overhead_ms: float
    decode_ms_per_request: float
    prefill_ms_per_token: float
    name: str = "custom"

    def rank_ms(self, prefill_tokens: int, decode_requests: int) -> float:
        """What one rank adds on top of the fixed overhead."""
        return (prefill_tokens * self.prefill_ms_per_token
                + decode_requests * self.decode_ms_per_request)

    def step_s(self, slowest_rank_ms: float) -> float:
        return (self.step_overhead_ms + slowest_rank_ms) / 1000.0


def profile_from_dict(data: Any, source: str = "profile") -> CostProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(COEFFICIENTS) - FREE_TEXT)
    if unknown:
        raise ProfileError(f"{source}: unknown key(s) {unknown}; allowed: "
                           f"{sorted(COEFFICIENTS) + sorted(FREE_TEXT)}")
    values: dict[str, float] = {}
    for key, meaning in COEFFICIENTS.items():
        if key not in data:
            raise ProfileError(f"{source}: missing key {key!r} ({meaning})")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProfileError(f"{source}: {key!r} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ProfileError(f"{source}: {key!r} must be finite and >= 0, got {value!r}")
        values[key] = float(value)
    if values["step_overhead_ms"] + values["decode_ms_per_request"] <= 0:
        raise ProfileError(f"{source}: a decode step must cost time (step_overhead_ms or "
                           "decode_ms_per_request > 0)")
    name = data.get("name", Path(source).stem)
    return CostProfile(name=str(name), **values)


def load_profile(path: Path) -> CostProfile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read cost profile {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
                           f"{exc.msg})") from exc
    return profile_from_dict(data, str(path))
