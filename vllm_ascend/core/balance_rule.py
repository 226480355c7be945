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
have cost less than what aligning saves: a ski-rental bound, so a hold that never aligns costs at most that.

What aligning saves is the fixed extra of a step with a prefill, less one decode step, and less the fit's error (two
standard errors). Less a decode step: on the real engine (eager; the fit finds 4-160 ms beside 22-48 ms decode steps)
the rule that held for the whole extra measured below stock where it held (re-priced, -0.9 to -5.5 %), though each
hold's own idle slots cost less than that extra: what a hold also costs (the held requests out of step with their
wave, the closed loop's arrivals re-forming around them) is not priced, so a saving under one step is not taken. Less
the error: with few steps with a prefill, or prompts of one or two lengths, the fit cannot tell the fixed extra from
the per-token cost (on the real engine it once put 82.6 ms there, later 0-12 ms). In graph mode (the simulator's paper
preset: 710 ms beside a 93 ms step) it still holds (+32.5 % predicted, `cap` +31.8 %); on the eager engine's traces
it never does.

A held step costs the free slots it keeps from waiting requests (their share of the step), but never less than an
eighth of a decode step while any request waits: a held request can finish after all its peers and then run alone,
every rank stepping for its tokens (measured on the real engine: a request held 85 steps, priced at 1/63 of a step
each, ran 85 steps behind its wave and cost that closed loop 2-3 s of a 45 s run). So a hold lasts at most 8 x the
saving in decode steps; the simulator's paper preset needs holds about that long (stop 31: an eighth +32 %, a
quarter +22 %, a whole step +5 %, predicted). A hold saves only if the prefills it waits for do come together: a
hold that ends (its rank leaves the cap, or it spends its budget) with two or more ranks admitting at once saved the
saving, any other saved nothing, and every hold cost its held steps. The rule keeps that ledger (faded like the fit,
at most two holds' saving ahead) and, deciding at each refit (every 32 steps), holds only while holds have saved more
than one idle slot-step beyond what they cost. While it does not hold, it prices each hold it would have made
(``_price_unheld``), from the same rows: that hold would have lasted until every rank then at its cap had left it, or
its budget ran out, kept the requests of the ranks admitting then (their idle slots are its cost), and aligned if
another rank had a request to admit by its end. So a first hold is made only once unheld steps show that holds would
align, and after holds that lost, holds resume on that evidence only, not as the debt fades. Where holds do not align
(a closed loop whose client sends the next request a second after a response, to the rank with the free slot:
measured on the real engine with an emulated graph penalty, the rule that trusted holds by default lost 7.8-10.1 %,
and the ledger that trusted the first hold and retried as its debt faded -5.3 % in one run, its tries the worst
pairs), none is made. Nor is one (made or priced) for a full rank without a request of its own waiting: it leaves its
cap with nothing to admit, so the held rank admits alone, unless a request happens to reach the full rank just then
(closed loop, 32 per rank, spread lengths, same penalty: holds priced as aligning by such chance arrivals were made,
and those runs lost 14.1 % tok/s, pairs 6-20 %, with TPOT up 62 %, paired medians of 3).

Every cost is measured, from values every rank gathers each step (``ROW``), so every rank computes the same numbers:
the fixed extra is the ``any prefill`` coefficient of a least-squares fit of the DP group's step times on (1, any
prefill, the largest and the summed prefill tokens of the ranks, running requests), its error from the fit's
residual over the steps with a prefill; a decode step's time is the mean of steps without a prefill. Old steps fade
out (a half-life of about 700 steps). A step copies the rows aside and reads only what decides; every 32 steps the
refit reduces them (numpy, never inside a step: cold, a numpy or torch call costs tens of us there). At DP 64 the
rule's update costs 11 us median inside a step and 20 us mean with its refit, 17 and 27 us while it prices a hold
every step (bench_overhead, stop 45; the torch refit it replaced, side by side at stop 40: 14 against 9 us median).
"""

import os
from collections.abc import Mapping

import numpy as np
from vllm.config import VllmConfig
from vllm.logger import logger

RULE_ENV, RULE_KEY, RULES = "VLLM_ASCEND_BALANCE_GATE_RULE", "balance_gate_rule", ("adaptive", "cap")
# What each rank contributes per step: its balance_count, its waiting requests, and the step it just finished: prefill
# tokens and duration in microseconds (0: none finished since the last gather).
ROW = ("count", "waiting", "prefill_tokens", "step_us")
# Each field's slice of the gathered rows, read flat (rank by rank): every rank's value of that field.
COLUMNS = tuple(slice(field, None, len(ROW)) for field in range(len(ROW)))
_FADE, _REFIT_EVERY, _MIN_STEPS, _STRAGGLER, _SURE = 1 - 1 / 1024, 32, 64, 1 / 8, 2.0
_NO_HOLD: tuple[frozenset[int], frozenset[int], int, float, bool] = (frozenset(), frozenset(), 0, 0.0, False)


def option_mappings(vllm_config: VllmConfig) -> tuple[Mapping[str, object], Mapping[str, object]]:
    """Where every balance scheduling option is read: ``additional_config['scheduler_config']`` and
    ``additional_config``, most specific first, each ``{}`` where vLLM holds another object (plugins may)."""
    additional = vllm_config.additional_config if isinstance(vllm_config.additional_config, Mapping) else {}
    return (nested if isinstance(nested := additional.get("scheduler_config"), Mapping) else {}), additional


def gate_rule(vllm_config: VllmConfig) -> str:
    """``additional_config['scheduler_config']['balance_gate_rule']``, else ``VLLM_ASCEND_BALANCE_GATE_RULE``, else
    ``adaptive``; anything but a known rule is an error."""
    rule = option_mappings(vllm_config)[0].get(RULE_KEY, os.environ.get(RULE_ENV, "adaptive"))
    if not isinstance(rule, str) or rule not in RULES:  # the value as the user wrote it: 1 is not '1'
        raise ValueError(f"Balance gate rule {rule!r} ({RULE_KEY} or {RULE_ENV}) is not valid: one of {RULES}.")
    return rule


class AdaptiveHold:
    """The ``adaptive`` rule's state; ``update`` runs once per gather on every rank, with identical rows."""

    def __init__(self, ranks: int) -> None:
        # Faded sums of z z^T, z = (1, any prefill, largest and summed prefill tokens, running, step seconds): the fit's
        # normal equations and its residual; the rows of the steps since the last refit wait in `fresh` (int32, step
        # after step), written in place: a step allocates nothing and calls no numpy (cold, tens of us in a step).
        self.moments, self.fresh = np.zeros((6, 6)), memoryview(np.zeros(_REFIT_EVERY * ranks * len(ROW), np.int32))
        # The fit's figures; one idle slot-step at full load (every rank at its cap), the least worth holding for; the
        # hold's cost so far, the ledger of holds (what they saved less what they cost) and the hold priced unheld.
        self.steps, self.decode_s, self.penalty_s, self.error_s = 0, 0.0, 0.0, 0.0
        self.saving_s, self.slot_s, self.held_s, self.credit_s, self.unheld = 0.0, 0.0, 0.0, 0.0, _NO_HOLD
        self.holding: bool | None = None  # None until the first fit, so that the first decision is logged too

    def update(self, rows: memoryview, cap: int) -> bool:
        """Learn from the step the gathered ``ROW``s report, then decide whether the gate is closed for the next
        step. ``rows``: every rank's row, rank after rank (the gathered int32 buffer, flat). A step copies the rows for
        the next refit and reads only what decides (at DP 64 a maximum or sum over the ranks costs about 1 us)."""
        counts, waiting = rows[COLUMNS[0]].tolist(), rows[COLUMNS[1]].tolist()  # lists: iterated faster
        if any(rows[COLUMNS[3]]):  # a rank finished a step since the last gather
            self.fresh[(at := self.steps % _REFIT_EVERY * len(rows)) : at + len(rows)] = rows
            # The ledger fades as the fit's old steps do: after holds that lost, holds are tried again.
            self.steps, self.credit_s = self.steps + 1, self.credit_s * _FADE
            if self.steps % _REFIT_EVERY == 0:
                self._refit(len(counts) * cap)
        # A hold (made or priced) can align only with a rank at its cap that has a request waiting, to admit as it
        # leaves the cap. In a closed loop the router sends the next request to the rank with free slots, so a full
        # rank seldom has one (measured, with an emulated graph penalty: holds for a full rank with none ended with the
        # held rank admitting alone). Read where a hold is made or a priced one starts: none is priced in flight.
        saves = self.saving_s > self.slot_s  # a hold would save more than one idle slot-step
        aligns = saves and not self.unheld[0] and any(waiting) and any(w for c, w in zip(counts, waiting) if c >= cap)
        # What each rank's free slots would take of its waiting requests, read only where a hold is made or ends, or one
        # is priced that has not yet aligned (at DP 64 a list over the ranks costs 3-9 us, in a step up to 20).
        reads = saves and (self.held_s or not self.unheld[4] and (aligns or self.unheld[0]))
        admissible = [w if w < cap - c else max(cap - c, 0) for c, w in zip(counts, waiting)] if reads else []
        if self.holding and aligns:
            if self.held_s + (cost_s := self._held_step_s(sum(admissible), counts)) <= self.saving_s:
                self.held_s += cost_s
                return True
        # A hold ends as its rank leaves the cap, or expires past its budget (admit now): it saved if two or more
        # ranks admit at once. The ledger keeps at most two holds' saving ahead, so holds that stop aligning stop soon.
        saved_s = self.saving_s * (sum(admissible) > max(admissible, default=0)) if self.held_s else 0.0
        self.credit_s, self.held_s = min(self.credit_s + saved_s - self.held_s, 2 * self.saving_s), 0.0
        if not self.holding and saves:
            self._price_unheld(counts, admissible, cap, aligns)
        return False

    def _held_step_s(self, admits: int, counts: list[int]) -> float:
        """One more held step (made or priced unheld) costs the requests it keeps from free slots, their share of a
        decode step, but at least ``_STRAGGLER`` of one while any is kept (a straggler)."""
        return self.decode_s * max(admits / max(sum(counts), 1), _STRAGGLER * bool(admits))

    def _price_unheld(self, counts: list[int], admissible: list[int], cap: int, aligns: bool) -> None:
        """Not holding, where a hold would save: price the hold that would have started here into the same ledger.
        It would have lasted until every rank then at its cap (``full``) had left it, kept the requests of the ranks
        admitting then (``starters``; unheld, they admit and fill their slots), and aligned them if another rank had a
        request to admit before it ended (as a made hold ends: its full ranks left their cap, or its budget ran out)."""
        full, starters, admits, cost_s, aligned = self.unheld
        if not full:  # none in flight: one starts where a hold would
            if aligns and (admits := sum(admissible)):
                full = frozenset(r for r, c in enumerate(counts) if c >= cap)
                starters = frozenset(r for r, n in enumerate(admissible) if n)
                self.unheld = (full, starters, admits, 0.0, len(starters) > 1)
            return
        aligned = aligned or any(admissible) and any(n for r, n in enumerate(admissible) if r not in starters)
        cost_s = min(cost_s + self._held_step_s(admits, counts), self.saving_s)
        self.unheld = (full := frozenset(r for r in full if counts[r] >= cap), starters, admits, cost_s, aligned)
        if not full or cost_s >= self.saving_s:  # it ends: its full ranks left their cap, or its budget ran out
            self.credit_s = min(self.credit_s + self.saving_s * aligned - cost_s, 2 * self.saving_s)
            self.unheld = _NO_HOLD

    def _refit(self, full: int) -> None:
        # The steps since the last refit fold in at once, each faded as if folded in its turn (the newest weighs 1).
        # Each field as (rank, step), contiguous: numpy reduces a strided axis several times slower (.obj: the array).
        counts, _, tokens, times = np.ascontiguousarray(self.fresh.obj.reshape(_REFIT_EVERY, -1, len(ROW)).T, float)
        z = np.c_[np.ones(_REFIT_EVERY), tokens.any(0), tokens.max(0), tokens.sum(0), counts.sum(0), times.max(0) / 1e6]
        self.moments = self.moments * _FADE ** len(z) + (z.T * _FADE ** np.arange(len(z) - 1, -1, -1.0)) @ z
        # Refit once both kinds of step were seen (m[1][1] weighs the steps with a prefill, m[0][0] all).
        if self.steps < _MIN_STEPS or not 0 < (m := self.moments.tolist())[1][1] < m[0][0]:
            return
        # Solved on the features scaled to a unit diagonal (token counts beside indicators, 1e8 apart): unscaled, a
        # near-collinear fit's residual below was rounding noise, went negative, and the fit looked sure. A small ridge
        # keeps the fit defined while features are collinear (prompts of one length, one rank prefilling, or none).
        unit, s = np.outer(d := self.moments.diagonal()[:5].clip(1e-9) ** -0.5, d), self.moments
        coef = (inverse := np.linalg.inv(s[:5, :5] * unit + 1e-8 * np.eye(5)) * unit) @ s[:5, 5]
        # The fixed extra's standard error, large where the features cannot tell it from the per-token cost (prompts of
        # one or two lengths). The residual is the prefill steps' (theirs vary by hundreds of ms, a decode step's by a
        # few), so its variance is over their count, not all steps'.
        variance = max(float(s[5, 5] - coef @ s[:5, 5]), 0.0) / max(m[1][1] - 5, 1.0)
        self.penalty_s, self.error_s = float(coef[1]), _SURE * (variance * float(inverse[1, 1])) ** 0.5
        self.decode_s = max((m[0][5] - m[1][5]) / (m[0][0] - m[1][1]), 1e-6)  # the mean step without a prefill
        self.saving_s, self.slot_s = max(self.penalty_s - self.error_s - self.decode_s, 0.0), self.decode_s / full
        # Hold for a saving above one idle slot-step, once holds have saved that much beyond what they cost.
        if (holding := min(self.saving_s, self.credit_s) > self.slot_s) != self.holding:
            logger.info("Balance scheduling (adaptive gate): %s; a step with a prefill on any DP rank costs every rank "
                        "%.1f ms (+- %.1f) more than one without (%.1f ms), so a hold saves at most %.1f ms; holds made"
                        " or priced lately saved %.1f ms more than they cost.", "holds admissions while a rank is at"
                        " its cap, up to that cost" if holding else "admits without waiting", self.penalty_s * 1e3,
                        self.error_s * 1e3, self.decode_s * 1e3, self.saving_s * 1e3, self.credit_s * 1e3)  # fmt: skip
            self.holding, self.unheld = holding, _NO_HOLD  # a hold priced before holding would be stale after
