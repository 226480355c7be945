"""One DP rank of the soak: a real balance scheduler driven through the real engine-core hook.

The loop below follows ``DPEngineCoreProc.run_busy_loop`` one statement at a time (the guard
test in tests/ut/engine checks that loop's shape on the installed vLLM) and calls the engine
core's real methods on a ``BalanceDPEngineCoreProc`` built without executor, ZMQ or threads:
``_handle_client_request`` (ADD, START_DP_WAVE), ``_process_engine_step`` (vLLM's
``EngineCore.step``: schedule, execute, update), ``execute_dummy_batch`` and the hook's
``_has_global_unfinished_reqs``, which calls vLLM's (an all-reduce every 32 steps) and then
``balance_gather`` over the real gloo group. That group and its store are created by the engine
class's own ``_init_data_parallel`` (vLLM's, plus the balanced class's start-up agreement); with
``--stock-ranks`` the given ranks run vLLM's stock ``DPEngineCoreProc`` there instead, so the
agreement must refuse the group.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from soak.plan import RequestSpec, Wave, build_plan, split_requests


def rank_main(
    rank: int,
    dp: int,
    port: int,
    configs: dict[str, Any],
    scenarios: list[str],
    requests: int,
    seed: int,
    result_path: str,
    stock: bool = False,
    stall: bool = False,
) -> None:
    """Process entry: run every scenario, write a JSON result (or the error) to result_path.

    ``stock``: this rank runs vLLM's own ``DPEngineCoreProc`` (a node without balance scheduling).
    ``stall`` (the watchdog's test): this rank waits forever before joining the DP group, so the
    whole group blocks by construction.
    """
    try:
        if stall:
            threading.Event().wait()
        result = _run(rank, dp, port, configs, scenarios, requests, seed, stock)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the soak
        result = {"rank": rank, "error": traceback.format_exc()}
    result["ended"] = time.monotonic()  # CLOCK_MONOTONIC: comparable across the ranks
    Path(result_path).write_text(json.dumps(result))
    # Skip interpreter teardown (gloo / vLLM atexit work is irrelevant to the result).
    os._exit(0)


def _run(
    rank: int, dp: int, port: int, configs: dict[str, Any], scenarios: list[str], requests: int, seed: int, stock: bool
) -> dict[str, Any]:
    from vllm.config import ParallelConfig
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine.core import DPEngineCoreProc

    from vllm_ascend.core.balance_engine_core import BalanceDPEngineCoreProc
    from vllm_ascend_balance.patch_balance_schedule import register

    load_general_plugins()  # as EngineCore.__init__ does: the balance plugin wires the scheduler
    # A forked rank inherits plugins_loaded from its parent, which may have loaded them with the
    # flag off (e.g. a test process): the plugin's idempotent entry point makes sure.
    register()
    for config in configs.values():  # this rank's place in the group, as vLLM's launcher sets it
        parallel = config.parallel_config
        parallel.data_parallel_rank = parallel.data_parallel_rank_local = rank
        parallel.data_parallel_master_ip, parallel.data_parallel_master_port = "127.0.0.1", port
        parallel._data_parallel_master_port_list = []
    # The DP group and its store exactly as vLLM's engine core creates them, before its model
    # loads (on a balanced rank this includes the start-up agreement of the DP group).
    engine_cls = DPEngineCoreProc if stock else BalanceDPEngineCoreProc
    group_owner = object.__new__(engine_cls)
    engine_cls._init_data_parallel(group_owner, configs["plain"])
    if stock:
        # A stock rank's first collective in its busy loop: vLLM's all_reduce alone.
        ParallelConfig.has_unfinished_dp(group_owner.dp_group, True)
        return {"rank": rank, "stock": True}
    started = time.monotonic()
    result: dict[str, Any] = {"rank": rank, "scenarios": {}}
    for scenario, count in split_requests(scenarios, requests).items():
        config = configs["kv" if scenario == "blocked" else "plain"]
        plan = build_plan(scenario, dp, count, seed)
        result["scenarios"][scenario] = _run_scenario(rank, dp, config, plan, group_owner.dp_group)
    result["run_seconds"] = round(time.monotonic() - started, 1)
    stateless_destroy_torch_distributed_process_group(group_owner.dp_group)
    return result


def make_engine_core(config: Any, scheduler: Any, executor: Any, dp_group: Any, rank: int) -> Any:
    from vllm.v1.engine.core import EngineShutdownState

    from vllm_ascend.core.balance_engine_core import BalanceDPEngineCoreProc

    core = object.__new__(BalanceDPEngineCoreProc)
    # The state vLLM's constructors would set, minus executor start-up, handshakes and threads.
    core.vllm_config = config
    core.scheduler = scheduler
    core.model_executor = executor
    core.structured_output_manager = scheduler.structured_output_manager
    core.log_stats = True
    core.batch_queue = None
    core.step_fn = core.step
    core.async_scheduling = False
    core.use_spec_decode = False
    core.aborts_queue = queue.Queue()
    core.input_queue = queue.Queue()
    core.output_queue = queue.Queue()
    core.engine_index = core.dp_rank = rank
    core.dp_group = dp_group
    core.engines_running = False
    core.shutdown_state = EngineShutdownState.RUNNING
    core.has_coordinator = False
    core.publish_dp_lb_stats = False
    core.process_input_queue_block = True
    core.step_counter = 0
    core.current_wave = 0
    core.last_counts = (0, 0)
    core.eep_scaling_state = None
    core._idle_state_callbacks = []
    core.balance_gathers = 0
    # vLLM 0.23's two-phase pause protocol state (unused attributes on 0.18).
    core.pending_pause = False
    core.ignore_start_dp_wave = False
    # vLLM 0.33's pause-rejection flag and the weight version stamped on outputs (unused before).
    core.reject_new_requests = False
    core._weight_version = "default"
    # vLLM >= 0.24: the DP prefill throttle (interval 1 = off, vLLM's default) and the draft-token check.
    core.prefill_schedule_interval = getattr(config.scheduler_config, "prefill_schedule_interval", 1)
    core.dp_sync_interval = getattr(config.parallel_config, "dp_sync_interval", 1)  # vLLM >= 0.33
    core.check_for_draft_tokens = False  # no speculative decoding, no diffusion model here
    return core


def busy_loop_iteration(core: Any) -> bool:
    """Steps 2) and 3) of one active ``DPEngineCoreProc.run_busy_loop`` iteration, in order.

    Returns ``engines_running`` (False: the wave ended on every rank, at this same iteration).
    """
    executed = core._process_engine_step()
    local_unfinished_reqs = core.scheduler.has_unfinished_requests()
    if not executed:
        if not local_unfinished_reqs and not core.engines_running:
            raise AssertionError("all-idle skip inside a running wave")
        core.execute_dummy_batch()
    # The all-reduce step, i.e. the hook: vLLM's check, then balance_gather.
    core.engines_running = core._has_global_unfinished_reqs(local_unfinished_reqs)
    if not core.engines_running:
        # The loop's wave-end bookkeeping (what run_busy_loop does next).
        core.current_wave += 1
        core.step_counter = 0
    return core.engines_running


def _request(spec: RequestSpec, executor: Any) -> Any:
    from offline_vllm import make_request
    from vllm.sampling_params import StructuredOutputsParams

    sampling: dict[str, Any] = {}
    if spec.blocked == "fsm":
        sampling["structured_outputs"] = StructuredOutputsParams(json_object=True)
    request = make_request(spec.request_id, spec.prompt_tokens, spec.max_tokens, **sampling)
    if spec.blocked == "fsm":
        grammar: Future = Future()  # compiled "later": resolved by the executor's step clock
        request.structured_output_request.grammar = grammar
        executor.add_grammar(grammar, spec.blocked_steps)
    elif spec.blocked == "remote-kv":
        request.kv_transfer_params = {"do_remote_prefill": True}
        executor.kv_delay[spec.request_id] = spec.blocked_steps
    return request


def _run_scenario(rank: int, dp: int, config: Any, plan: list[Wave], dp_group: Any) -> dict[str, Any]:
    from offline_vllm import build_scheduler
    from vllm.v1.engine import EngineCoreRequestType

    from soak.fakes import FakeExecutor, FakeGrammarBackend
    from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin

    scheduler = build_scheduler(config.scheduler_config.get_scheduler_cls(), config)
    if not isinstance(scheduler, BalanceSchedulingMixin):
        raise RuntimeError(f"plugin did not build a balance scheduler: {type(scheduler)}")
    scheduler.structured_output_manager.backend = FakeGrammarBackend()
    executor = FakeExecutor(scheduler)
    core = make_engine_core(config, scheduler, executor, dp_group, rank)

    submitted: list[str] = []
    finished: list[str] = []
    digest = hashlib.sha256()
    gathers = 0
    own_slot_mismatches = 0
    wave_steps: list[int] = []

    def deliver(specs: list[RequestSpec]) -> None:
        for spec in specs:
            if spec.rank == rank:
                submitted.append(spec.request_id)
                core._handle_client_request(EngineCoreRequestType.ADD, (_request(spec, executor), core.current_wave))

    def collect_outputs() -> None:
        while not core.output_queue.empty():
            _, outputs = core.output_queue.get_nowait()
            finished.extend(o.request_id for o in outputs.outputs if o.finish_reason is not None)

    carry: list[RequestSpec] = []
    index = 0
    while index < len(plan) or carry:
        wave = plan[index] if index < len(plan) else Wave(idle_gap_s=[0.0] * dp)
        index += 1
        if not (carry or wave.burst or wave.mid):
            continue  # every rank skips it: nothing would be submitted anywhere
        time.sleep(wave.idle_gap_s[rank])  # idle; ranks hear the coordinator at different times
        deliver(carry + wave.burst)
        carry = []
        # The coordinator's wave start, as vLLM's DP coordinator broadcasts it to every engine.
        core._handle_client_request(EngineCoreRequestType.START_DP_WAVE, (core.current_wave, -1))
        step = 0
        while True:  # one iteration of DPEngineCoreProc.run_busy_loop
            deliver(wave.mid.get(step, []))  # 1) the input queue
            running = busy_loop_iteration(core)  # 2) the engine step, 3) the hook
            collect_outputs()
            gathers += 1
            gathered = [int(t.item()) for t in scheduler.balance_queue]
            own_slot_mismatches += gathered[rank] != scheduler.balance_count()
            digest.update(json.dumps(gathered).encode())
            if not running:
                break
            step += 1
        wave_steps.append(step + 1)
        carry = [spec for at, specs in sorted(wave.mid.items()) if at > step for spec in specs]

    return {
        "submitted": submitted,
        "finished": finished,
        "gathers": gathers,
        "wave_steps": wave_steps,
        "digest": digest.hexdigest(),
        "own_slot_mismatches": own_slot_mismatches,
        "gate_violations": executor.gate_violations[:5],
        "gated_steps": executor.gated_steps,
        "balance_gated_steps": scheduler.balance_gated_steps,
        "dummy_steps": executor.dummy_steps,
        "left_in_scheduler": scheduler.get_num_unfinished_requests(),
    }
