"""Per-iteration trace of what every DP rank's engine did, for the real-engine bench (``scripts/bench_engine.py``).

Test-only vLLM general plugin (``balance_step_trace``), active only when ``BALANCE_STEP_TRACE_DIR`` is set. Every
engine-core process appends one JSON line per ``schedule()`` call to ``<dir>/rank<R>.jsonl``, written through at
once, so the trace survives vLLM killing its engine cores at shutdown:

    {"it": 812, "t": 5.012, "dt": 0.041, "closed": 1, "admitted": 0, "prefill_tokens": 0, "decode_reqs": 31,
     "running": 31, "waiting": 2, "cap": 32}

``it`` is the DP engine loop's iteration, counted by the calls of ``DPEngineCoreProc._has_global_unfinished_reqs``:
once per non-idle iteration on every rank in lockstep, so the same ``it`` is the same step on every rank. ``dt`` is
the time from the start of ``schedule()`` to the iteration's end (the model step and its collectives, without the
wait for input before it). ``closed``: a balanced scheduler ran the step gated (``PAUSED_NEW`` set by the gate).
Both wrapped methods are vLLM's own, so stock and balanced engines are traced alike.

With ``BALANCE_PREFILL_PENALTY_MS`` set, a worker whose batch holds a prefill sleeps that long before its forward: an
emulated graph mode. On an NPU with decode-only graphs a step in which any DP rank prefills runs every rank without
its graph (the simulator's ``prefill_step_overhead_ms``); here the other ranks wait as long in the forward's first
collective (DP x EP steps in lockstep), so every rank pays it, as there. The penalty is the emulation's; the serving,
the scheduling and the timing around it are the real engine's.

With ``BALANCE_ARM_FILE`` also set (the bench's ``--same-server``), one balanced server runs every arm in turn: the
file holds ``{"arm": name, "gate": "off" | "adaptive" | "cap", "interval": N}``, re-read at each ``schedule()`` and
each gather once it changes (the bench writes it while the engines are idle). ``gate`` ``off`` leaves the gate open
(the gather still runs), ``cap`` decides with upstream's rule while the adaptive rule's state waits untouched, and
``interval`` is vLLM's ``--prefill-schedule-interval``. Every record then carries ``arm``, so the bench can check
each run ran under its arm alone. Two servers of one configuration ran identical batches up to 25 % apart (stop 32):
arms on one server are compared without that.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

TRACE_DIR_ENV, ARM_FILE_ENV, PENALTY_ENV = "BALANCE_STEP_TRACE_DIR", "BALANCE_ARM_FILE", "BALANCE_PREFILL_PENALTY_MS"
_state: dict[str, Any] = {"it": 0, "pending": None, "file": None, "engine": None, "arm": None, "arm_mtime": None}


def install() -> None:
    if not os.environ.get(TRACE_DIR_ENV) or _state.get("installed"):
        return
    _state["installed"] = True
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import DPEngineCoreProc

    Scheduler.schedule = _traced_schedule(Scheduler.schedule)  # type: ignore[method-assign]
    DPEngineCoreProc._has_global_unfinished_reqs = _counted_sync(DPEngineCoreProc._has_global_unfinished_reqs)
    if (penalty_ms := float(os.environ.get(PENALTY_ENV) or 0)) > 0:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner's base: its execute_model

        penalised = _penalised_forward(GPUModelRunner.execute_model, penalty_ms / 1000)
        GPUModelRunner.execute_model = penalised  # type: ignore[method-assign]
    try:
        from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin
    except ImportError:  # the package is not installed: nothing balanced to time
        return
    BalanceSchedulingMixin.balance_gather = _timed_gather(BalanceSchedulingMixin.balance_gather)  # type: ignore
    if os.environ.get(ARM_FILE_ENV):
        BalanceSchedulingMixin.balance_update = _armed_update(BalanceSchedulingMixin.balance_update)  # type: ignore


def same_server_arm(arm: str) -> dict[str, Any]:
    """What the bench's ``arm`` (``off``, ``off-<tag>``, ``balance``, ``cap``, ``intervalN``, joined by ``+``) sets
    on a balanced server that runs every arm: the file's content."""
    parts = arm.split("+")
    gate = "adaptive" if "balance" in parts else "cap" if "cap" in parts else "off"
    interval = next((int(part.removeprefix("interval")) for part in parts if part.startswith("interval")), 1)
    return {"arm": arm, "gate": gate, "interval": interval}


def _read_arm() -> dict[str, Any] | None:
    """The arm in force: the file's content, re-read when its modification time changes."""
    path = os.environ.get(ARM_FILE_ENV)
    if not path:
        return None
    mtime = os.stat(path).st_mtime_ns
    if mtime != _state["arm_mtime"]:
        _state["arm"], _state["arm_mtime"] = json.loads(Path(path).read_text()), mtime
    if _state["engine"] is not None:
        _state["engine"].prefill_schedule_interval = _state["arm"]["interval"]
    return _state["arm"]


def _armed_update(update: Any) -> Any:
    @functools.wraps(update)
    def armed(self: Any) -> None:
        # Re-read here, at the gather, not only at schedule(): a rank without requests runs dummy batches and
        # schedules nothing, so read at schedule() alone one rank switched its rule a few gathers before the other
        # and their adaptive states drifted apart (stop 42: fits 1 % apart in one run).
        gate = (_read_arm() or {"gate": "adaptive"})["gate"]
        if gate == "off":
            self._balance_closed = False
            return
        if gate == "adaptive":
            update(self)
            return
        hold, self._balance_hold = self._balance_hold, None  # the cap rule: no hold object
        try:
            update(self)
        finally:
            self._balance_hold = hold

    return armed


def _traced_schedule(schedule: Any) -> Any:
    @functools.wraps(schedule)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.interface import PauseState

        arm = _read_arm()
        started = time.monotonic()
        gated = self._pause_state == PauseState.PAUSED_NEW and hasattr(self, "balance_gate_closed")
        output = schedule(self, *args, **kwargs)
        prefill_tokens = decode_reqs = 0
        for req_id, tokens in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            # schedule() has already advanced num_computed_tokens by this step's tokens.
            if request.num_computed_tokens - tokens < request.num_prompt_tokens:
                prefill_tokens += tokens
            else:
                decode_reqs += 1
        _flush()
        _state["pending"] = {
            "it": _state["it"],
            "t": started,
            "closed": int(gated),
            "admitted": len(output.scheduled_new_reqs),
            "prefill_tokens": prefill_tokens,
            "decode_reqs": decode_reqs,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "cap": self.max_num_running_reqs,
            "rank": self.vllm_config.parallel_config.data_parallel_rank,
        }
        if arm is not None:
            _state["pending"]["arm"] = arm["arm"]
        if "gather_s" in _state:
            _state["pending"]["gather_s"] = _state.pop("gather_s")
        return output

    return traced


def _penalised_forward(execute_model: Any, penalty_s: float) -> Any:
    @functools.wraps(execute_model)
    def penalised(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # No drafts here: a request scheduling more than one token is prefilling.
        if scheduler_output.total_num_scheduled_tokens > len(scheduler_output.num_scheduled_tokens):
            time.sleep(penalty_s)
        return execute_model(self, scheduler_output, *args, **kwargs)

    return penalised


def _counted_sync(method: Any) -> Any:
    @functools.wraps(method)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state["engine"] = self
        result = method(self, *args, **kwargs)
        ended = time.monotonic()
        if _state["pending"] is not None:
            _state["pending"]["dt"] = ended - _state["pending"]["t"]
        _flush()
        _state["it"] += 1
        return result

    return counted


def _timed_gather(gather: Any) -> Any:
    @functools.wraps(gather)
    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        started = time.monotonic()
        gather(self, *args, **kwargs)
        _state["gather_s"] = time.monotonic() - started

    return timed


def _flush() -> None:
    record = _state["pending"]
    if record is None:
        return
    _state["pending"] = None
    if _state["file"] is None:
        path = Path(os.environ[TRACE_DIR_ENV]) / f"rank{record['rank']}.jsonl"
        _state["file"] = open(path, "a", buffering=1)  # noqa: SIM115 - one file for the process's life
    _state["file"].write(json.dumps(record) + "\n")
