"""Parameters of one simulated deployment and workload, the named presets, and their checks.

A preset is a complete ``SimSettings``; command-line options override single fields. ``problems``
lists everything wrong with a settings object in user terms, so the CLI can refuse bad input with
one clear message instead of failing deep inside vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dpsim.router import ROUTERS

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO_ROOT / "profiles"
GATES = ("cap", "cap-1")


@dataclass(frozen=True)
class SimSettings:
    dp_size: int = 4
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    num_requests: int = 512
    concurrency: int | None = 128
    request_rate: float | None = None
    prompt_tokens: int = 3500
    output_tokens: int = 1500
    prompt_spread: float = 0.0
    output_spread: float = 0.5
    jitter_ms: float = 0.0
    router: str = "lb"
    lb_stats_interval_ms: float = 100.0
    profile: Path = PROFILES_DIR / "rfc-dsv31.json"
    gate: str = "cap"
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return (round(self.prompt_tokens * (1 + self.prompt_spread))
                + round(self.output_tokens * (1 + self.output_spread)) + 1)


@dataclass(frozen=True)
class PaperResult:
    """One row of a published result table (for the comparison columns)."""

    output_tok_s: float
    tpot_mean_ms: float
    ttft_mean_ms: float
    e2e_s: float


@dataclass(frozen=True)
class Preset:
    description: str
    settings: SimSettings
    paper: dict[str, PaperResult] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    # vllm-ascend PR #5212: DeepSeek-V3.1, 3,500 in / 1,500 out, 512 requests, "batch size 128".
    # Read here as: benchmark concurrency 128 = DP 4 x max_num_seqs 32; output lengths +-50%
    # stand in for every source of desynchronisation between ranks (see docs/simulator.md).
    "rfc-dsv31": Preset(
        description="vllm-ascend PR #5212 result table: DeepSeek-V3.1, 3500/1500 tokens, "
                    "512 requests, concurrency 128 over DP 4 x max_num_seqs 32, outputs +-50%",
        settings=SimSettings(),
        paper={"off": PaperResult(1297.3, 86.85, 6600.0, 591.9),
               "on": PaperResult(1530.7, 70.63, 7012.0, 501.7)},
    ),
}


def with_overrides(base: SimSettings, **overrides: object) -> SimSettings:
    """``base`` with every override that is not None."""
    names = {f.name for f in fields(SimSettings)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}")
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def problems(settings: SimSettings) -> list[str]:
    found = []
    positive = {"dp_size": "DP size", "max_num_seqs": "max_num_seqs",
                "max_num_batched_tokens": "max_num_batched_tokens",
                "num_requests": "number of requests", "prompt_tokens": "prompt length",
                "output_tokens": "output length"}
    for name, label in positive.items():
        if getattr(settings, name) < 1:
            found.append(f"{label} must be >= 1, got {getattr(settings, name)}")
    if settings.concurrency is not None and settings.concurrency < 1:
        found.append(f"concurrency must be >= 1, got {settings.concurrency}")
    if settings.request_rate is not None and not settings.request_rate > 0:
        found.append(f"request rate must be > 0 requests/s, got {settings.request_rate}")
    if settings.concurrency is None and settings.request_rate is None:
        found.append("give a concurrency (closed loop), a request rate (Poisson), or both")
    for name in ("prompt_spread", "output_spread"):
        value = getattr(settings, name)
        if not 0.0 <= value < 1.0:
            found.append(f"{name.replace('_', ' ')} must be in [0, 1), got {value}")
    for name in ("jitter_ms", "lb_stats_interval_ms"):
        if getattr(settings, name) < 0:
            found.append(f"{name} must be >= 0, got {getattr(settings, name)}")
    if settings.router not in ROUTERS:
        found.append(f"unknown router {settings.router!r}; choose one of {', '.join(ROUTERS)}")
    if settings.gate not in GATES:
        found.append(f"unknown gate rule {settings.gate!r}; choose one of {', '.join(GATES)}")
    return found
