#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""The gate rule: while some DP rank is at its cap, how long the others wait to admit.

Upstream's rule (``cap``) keeps every rank from admitting for as long as any rank is at its cap. That aligns the
ranks' prefills, which pays where a step with a prefill on any rank costs every rank a fixed extra (graph mode: the
step runs without its decode graph) and loses where it does not (an eager engine, measured: the idle slots cost
more than the aligned prefills save). ``adaptive`` (the default) holds the gate closed only while the steps it holds
have cost less than the one prefill step that aligning saves: a ski-rental bound, so a hold that never aligns costs
at most that step, and on an engine without the fixed extra it never holds. A held step costs the free slots it
keeps from waiting requests (their share of the step), but never less than an eighth of a decode step while any
request waits: a held request can finish after all its peers and then run alone, every rank stepping for its tokens
(measured on the real engine: a request held 85 steps, priced at 1/63 of a step each, ran 85 steps behind its wave
and cost that closed loop 2-3 s of a 45 s run). So a hold lasts at most 8 x the saving in decode steps; the
simulator's paper preset needs holds about that long (an eighth: +32 %, a quarter: +22 %, a whole step: +5 %,
predicted). A hold saves that step only if
the prefills it waits for do come together: its budget is the saving times the share of recent holds that ended
with two or more ranks admitting at once (a moving average, 1 at first). Where they do not (a router that sends the
next request to the rank with the free slot, not to the rank at its cap), holds shrink, then stop; the share drifts
back towards 1 (over ~1000 steps), so the rule tries again later.

Both costs are measured, from values every rank gathers each step (``ROW``), so every rank computes the same
numbers: the fixed extra is the ``any prefill`` coefficient of a least-squares fit of the DP group's step times on
(1, any prefill, the largest and the summed prefill tokens of the ranks, running requests); a decode step's time is
the mean of steps without a prefill. Old steps fade out (a half-life of about 700 steps).
"""

import os
from collections.abc import Mapping

import torch
from vllm.config import VllmConfig
from vllm.logger import logger

RULE_ENV, RULE_KEY, RULES = "VLLM_ASCEND_BALANCE_GATE_RULE", "balance_gate_rule", ("adaptive", "cap")
# What each rank contributes per step: its balance_count, waiting requests, and the step it just finished: prefill
# tokens and duration in microseconds (0: none finished since the last gather).
ROW = ("count", "waiting", "prefill_tokens", "step_us")
_FADE, _REFIT_EVERY, _MIN_STEPS, _STRAGGLER = 1 - 1 / 1024, 32, 64, 1 / 8


def gate_rule(vllm_config: VllmConfig) -> str:
    """``additional_config['scheduler_config']['balance_gate_rule']``, else ``VLLM_ASCEND_BALANCE_GATE_RULE``, else
    ``adaptive``; anything but a known rule is an error."""
    additional = vllm_config.additional_config if isinstance(vllm_config.additional_config, Mapping) else {}
    nested = additional.get("scheduler_config")
    rule = (nested if isinstance(nested, Mapping) else {}).get(RULE_KEY, os.environ.get(RULE_ENV, "adaptive"))
    if rule not in RULES:
        raise ValueError(f"Balance gate rule {rule!r} ({RULE_KEY} or {RULE_ENV}) is not valid: one of {RULES}.")
    return rule


class AdaptiveHold:
    """The ``adaptive`` rule's state; ``update`` runs once per gather on every rank, with identical rows."""

    def __init__(self) -> None:
        # The fit's normal equations (plain floats: this runs every step; torch only solves them, every 32 steps).
        self.xtx, self.xty = [[0.0] * 5 for _ in range(5)], [0.0] * 5
        self.steps, self.decode_s, self.penalty_s, self.held_s, self.aligned = 0, 0.0, 0.0, 0.0, 1.0
        self.holding: bool | None = None  # None until the first fit, so that the first decision is logged too

    def update(self, rows: list[list[int]], cap: int) -> bool:
        """Learn from the step the rows report, then decide whether the gate is closed for the next step."""
        counts, waiting, prefill, step_us = zip(*rows)
        if longest := max(step_us):
            self._observe(longest / 1e6, max(prefill), sum(prefill), sum(counts), len(rows) * cap)
        if max(counts) < cap or not self.holding:
            # A hold ends as its rank leaves the cap: it aligned if two or more ranks admit now.
            together = bool(self.held_s) and sum(n < cap and w > 0 for n, w in zip(counts, waiting)) > 1
            self.aligned, self.held_s = (3 * self.aligned + together) / 4 if self.held_s else self.aligned, 0.0
            return False
        # One more held step costs the requests it keeps from free slots, and at least _STRAGGLER of it (a straggler).
        idle = sum(min(cap - n, w) for n, w in zip(counts, waiting) if n < cap)
        cost_s = self.decode_s * max(idle / max(sum(counts), 1), _STRAGGLER * bool(idle))
        # Past the budget the hold expires unaligned: admit now; a new hold starts at the next full rank.
        expired = self.held_s + cost_s > self.penalty_s * self.aligned
        self.held_s, self.aligned = (0.0, self.aligned * 3 / 4) if expired else (self.held_s + cost_s, self.aligned)
        return not expired

    def _observe(self, step_s: float, largest: int, total: int, running: int, full: int) -> None:
        features = (1.0, float(largest > 0), float(largest), float(total), float(running))
        for row, x in zip(self.xtx, features):
            row[:] = [value * _FADE + x * y for value, y in zip(row, features)]
        self.xty = [value * _FADE + x * step_s for value, x in zip(self.xty, features)]
        # Old hold outcomes fade as the fit's old steps do: the share drifts back to 1, so holds are tried again.
        self.steps, self.aligned = self.steps + 1, 1 - (1 - self.aligned) * _FADE
        # Refit once both kinds of step were seen (xtx[1][1] weighs the steps with a prefill, xtx[0][0] all); a small
        # ridge keeps the fit defined while features are collinear (one rank prefilling, or none).
        if self.steps % _REFIT_EVERY or self.steps < _MIN_STEPS or not 0 < self.xtx[1][1] < self.xtx[0][0]:
            return
        xtx = torch.tensor(self.xtx, dtype=torch.float64) + 1e-6 * torch.eye(5, dtype=torch.float64)
        coef = torch.linalg.solve(xtx, torch.tensor(self.xty, dtype=torch.float64)).tolist()
        self.penalty_s, self.decode_s = max(coef[1], 0.0), max(coef[0] + coef[4] * running, 1e-6)
        # Anything to hold for: does the expected saving cover one idle slot-step at full load (every rank at its cap)?
        if (holding := self.penalty_s * self.aligned > self.decode_s / full) != self.holding:
            verdict = ("holds admissions while a rank is at its cap, for at most that cost in steps" if holding else
                       "admits without waiting (aligning prefills would save less than one slot-step)")  # fmt: skip
            logger.info("Balance scheduling (adaptive gate): %s; a step with a prefill on any DP rank costs every rank "
                        "%.1f ms more than a decode step of %d requests (%.1f ms); %.0f %% of recent holds ended with "
                        "two or more ranks admitting.", verdict, self.penalty_s * 1e3, running, self.decode_s * 1e3,
                        100 * self.aligned)  # fmt: skip
            self.holding = holding
