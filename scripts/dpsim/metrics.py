"""Per-request timestamps and per-step counters of one run, and the figures derived from them.

Figures follow ``vllm bench serve`` (and AISBench, which measures the same way): TTFT from the
client's send to the first token, TPOT as (latency - TTFT) / (output tokens - 1) per request,
ITL as the gap between consecutive streamed chunks (one chunk per step, so an MTP step that
yields several tokens is one gap), output throughput as all output tokens over the benchmark
duration (first send to last response). TTFT is also split: the *first wave* (requests sent
before any response finished, i.e. into an empty server) and the later ones. The step counters
explain the figures: how many steps admitted new requests, and how many steps made decoding
requests wait for some rank's prefill. With remote-KV requests in the workload, TTFT is also split
between them (from their arrival at this, the decode side) and the requests prefilled locally.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpsim.cluster import RankWork

# Keys every run summary has (the JSON contract of --json).
SUMMARY_KEYS = (
    "output_tok_s",
    "tpot_mean_ms",
    "tpot_p99_ms",
    "ttft_mean_ms",
    "ttft_p99_ms",
    "ttft_first_wave_ms",
    "ttft_later_ms",
    "itl_p50_ms",
    "itl_mean_ms",
    "e2e_s",
    "finished",
)


@dataclass
class RunResult:
    summary: dict[str, Any]
    step_times: list[float] = field(default_factory=list)
    running: list[tuple[int, ...]] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    # Per request, index order: finish step (engine-loop iteration) and tokens per step.
    finish_step: list[int] = field(default_factory=list)


class RunRecorder:
    def __init__(self, num_requests: int, remote_kv: Collection[int] = ()) -> None:
        nan = float("nan")
        self.remote_kv = np.zeros(num_requests, dtype=bool)
        self.remote_kv[list(remote_kv)] = True
        self.sent_at = [nan] * num_requests
        self.first_at = [nan] * num_requests
        self.last_at = [nan] * num_requests
        self.done_at = [nan] * num_requests
        self.done_step = [-1] * num_requests
        self.tokens = [0] * num_requests
        self.itl: list[float] = []
        self.first_finish: float | None = None
        self.steps = 0
        self.admission_steps = 0
        self.prefill_steps = 0
        self.stalled_decode_steps = 0
        self.running_sum = 0
        self.step_times: list[float] = []
        self.running: list[tuple[int, ...]] = []

    def sent(self, index: int, now: float) -> None:
        self.sent_at[index] = now

    def produced(self, index: int, now: float, count: int) -> None:
        if self.tokens[index] == 0:
            self.first_at[index] = now
        else:
            self.itl.append(now - self.last_at[index])
        self.tokens[index] += count
        self.last_at[index] = now

    def done(self, index: int, now: float) -> None:
        self.done_at[index] = now
        self.done_step[index] = self.steps
        if self.first_finish is None:
            self.first_finish = now

    def step(self, now: float, work: list[RankWork], running: list[int]) -> None:
        self.steps += 1
        prefill = any(w.prefill_tokens for w in work)
        self.prefill_steps += prefill
        self.admission_steps += any(w.admitted for w in work)
        # Decoding requests that sat through someone's prefill in this lockstep step.
        self.stalled_decode_steps += prefill and any(w.decode_requests for w in work)
        self.running_sum += sum(running)
        self.step_times.append(now)
        self.running.append(tuple(running))

    def result(self, dp_size: int, counters: dict[str, int], wall_s: float) -> RunResult:
        sent = np.array(self.sent_at)
        first = np.array(self.first_at)
        done = np.array(self.done_at)
        tokens = np.array(self.tokens)
        ok = ~np.isnan(done)
        ttft_all = (first - sent) * 1000.0
        ttft = ttft_all[ok]
        first_wave = ok & (sent < (self.first_finish if self.first_finish is not None else np.inf))
        many = ok & (tokens > 1)
        tpot = (done[many] - first[many]) / (tokens[many] - 1) * 1000.0
        itl = np.array(self.itl) * 1000.0
        duration = float(np.nanmax(done) - np.nanmin(sent)) if ok.any() else 0.0

        def stat(values: np.ndarray, kind: str) -> float:
            if values.size == 0:
                return float("nan")
            if kind == "mean":
                return float(values.mean())
            return float(np.percentile(values, 50 if kind == "p50" else 99))

        summary = {
            "output_tok_s": float(tokens[ok].sum() / duration) if duration > 0 else 0.0,
            "request_s": float(ok.sum() / duration) if duration > 0 else 0.0,
            "tpot_mean_ms": stat(tpot, "mean"),
            "tpot_p99_ms": stat(tpot, "p99"),
            "ttft_mean_ms": stat(ttft, "mean"),
            "ttft_p99_ms": stat(ttft, "p99"),
            "ttft_first_wave_ms": stat(ttft_all[first_wave], "mean"),
            "ttft_later_ms": stat(ttft_all[ok & ~first_wave], "mean"),
            "first_wave_requests": int(first_wave.sum()),
            **(
                {
                    "remote_kv_requests": int(self.remote_kv.sum()),
                    "ttft_remote_kv_ms": stat(ttft_all[ok & self.remote_kv], "mean"),
                    "ttft_local_ms": stat(ttft_all[ok & ~self.remote_kv], "mean"),
                    "tpot_remote_kv_ms": stat(tpot[self.remote_kv[many]], "mean"),
                    "tpot_local_ms": stat(tpot[~self.remote_kv[many]], "mean"),
                }
                if self.remote_kv.any()
                else {}
            ),
            "itl_p50_ms": stat(itl, "p50"),
            "itl_mean_ms": stat(itl, "mean"),
            "e2e_s": duration,
            "finished": int(ok.sum()),
            "num_requests": len(self.sent_at),
            "steps": self.steps,
            "admission_steps": self.admission_steps,
            "prefill_steps": self.prefill_steps,
            "stalled_decode_steps": self.stalled_decode_steps,
            **counters,
            "mean_running_per_rank": self.running_sum / max(self.steps * dp_size, 1),
            "mean_step_ms": duration / max(self.steps, 1) * 1000.0,
            "tokens_per_chunk": float(tokens[ok].sum() / max(len(self.itl) + ok.sum(), 1)),
            "sim_wall_s": wall_s,
        }
        return RunResult(summary, self.step_times, self.running, tpot.tolist(), ttft.tolist(), list(self.done_step))
