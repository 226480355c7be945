"""The balance gather in vLLM's data-parallel engine loop, without copying the loop.

For MoE models with DP > 1, vLLM runs one ``DPEngineCoreProc`` per rank. Its ``run_busy_loop``
calls ``_has_global_unfinished_reqs()`` exactly once per non-idle iteration on every rank, in
lockstep (ranks without work run a dummy batch), and all ranks skip it together when all are idle.
That call is therefore the one place where a collective can run every active step without
deadlocking: the gather cannot go inside ``schedule()`` (a drained rank stops scheduling) nor
before the loop's own synchronisation (ranks at a wave boundary diverge). vllm-ascend replaced
``run_busy_loop`` with a copy to add the gather; here the subclass only extends that one method,
so the gather follows whatever the installed vLLM's loop does.

The gather runs after the step's ``update_from_output``, so ``balance_queue`` holds each rank's
``len(running)`` at the end of the previous step when the next ``schedule()`` reads it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.engine.core import DPEngineCoreProc

from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin

# Under vLLM's "vllm" logger: vLLM configures only that hierarchy (it does not propagate), so a
# logger named after this module alone would drop INFO records in vLLM processes.
logger = init_logger(f"vllm.{__name__}")

# How often a running engine reports its gate statistics (and once more at shutdown).
STATS_INTERVAL_S = 30.0


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """vLLM's ``DPEngineCoreProc`` plus one ``balance_gather`` per active loop iteration.

    Constructor arguments are exactly ``DPEngineCoreProc``'s.
    """

    # Defaults for engines built without __init__ (the soak harness): no periodic stats line.
    balance_gathers = 0
    _balance_stats_due = float("inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Logged before construction so every engine-core process states which class it runs,
        # even when a later start-up step fails.
        logger.info("Balance scheduling: this DP engine core is %s (one balance_gather per "
                    "active engine step).", type(self).__qualname__)
        self.balance_gathers = 0
        self._balance_stats_due = time.monotonic() + STATS_INTERVAL_S
        super().__init__(*args, **kwargs)
        if not isinstance(self.scheduler, BalanceSchedulingMixin):
            # Without a balance scheduler the gate never closes: refuse instead of running
            # silently unbalanced.
            raise RuntimeError(
                f"{type(self).__qualname__} needs a balance scheduler, but vLLM built "
                f"{type(self.scheduler).__module__}.{type(self.scheduler).__qualname__}; is the "
                "ascend_balance_scheduling plugin excluded by VLLM_PLUGINS?")

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        global_unfinished = super()._has_global_unfinished_reqs(local_unfinished)
        # Every rank reaches this line once per active iteration, so the collective matches up.
        self.scheduler.balance_gather(self.dp_group)
        self.balance_gathers += 1
        if time.monotonic() >= self._balance_stats_due:
            self._balance_stats_due += STATS_INTERVAL_S
            self._log_balance_stats()
        return global_unfinished

    def shutdown(self) -> None:
        if isinstance(getattr(self, "scheduler", None), BalanceSchedulingMixin):
            self._log_balance_stats()
        super().shutdown()

    def _log_balance_stats(self) -> None:
        # TEMPORARY (issue 16 branch): the lead's version replaces this at merge.
        logger.info("Balance scheduling stats: dp_rank=%d engine_steps=%d gathers=%d "
                    "gated_steps=%d", self.dp_rank, self.balance_gathers, self.balance_gathers,
                    self.scheduler.balance_gated_steps)


# ---- the seams this hook relies on, checked on the installed vLLM's source (AST) ------------

_GATHER_SITE = "_has_global_unfinished_reqs"
_DP_CLASS = "DPEngineCoreProc"
_LAUNCH = "run_engine_core"


def engine_seam_problems(core_source: str | None = None,
                         launcher_source: str | None = None) -> list[str]:
    """What in vLLM's engine-core code breaks the hook's assumptions (empty when sound).

    1. ``DPEngineCoreProc.run_busy_loop`` calls ``self._has_global_unfinished_reqs`` exactly
       once per loop iteration, as a top-level statement of its ``while`` body, and every way to
       skip it (``continue``/``break``/``return``) earlier in the iteration is inside an ``if``
       on ``self.engines_running`` (the all-ranks-idle skip, decided from global state);
       nothing else in the module calls it.
    2. ``EngineCoreProc.run_engine_core`` is a staticmethod that builds ``DPEngineCoreProc`` by
       its module-global name (not a local binding), under a test on ``is_moe``.
    3. The launcher passes ``EngineCoreProc.run_engine_core``, looked up at launch time, as the
       engine-core process target.

    Sources default to the installed ``vllm/v1/engine/core.py`` and ``vllm/v1/engine/utils.py``;
    tests pass altered sources to prove each check can fail.
    """
    if core_source is None:
        core_source = _installed_source("vllm.v1.engine.core")
    if launcher_source is None:
        launcher_source = _installed_source("vllm.v1.engine.utils")
    core = ast.parse(core_source)
    problems = _busy_loop_problems(core) + _launch_problems(core)
    problems += _launcher_problems(ast.parse(launcher_source))
    return problems


@functools.cache
def installed_engine_seam_problems() -> tuple[str, ...]:
    return tuple(engine_seam_problems())


def _installed_source(module_name: str) -> str:
    return inspect.getsource(importlib.import_module(module_name))


def _method(tree: ast.Module, owner: str, name: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == owner:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def _is_self_call(node: ast.AST, method: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == method and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self")


def _mentions(node: ast.AST, attribute: str) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == attribute)
               or (isinstance(n, ast.Name) and n.id == attribute) for n in ast.walk(node))


def _exits_outside_idle_guard(statement: ast.stmt) -> list[int]:
    """Lines of continue/break/return in ``statement`` not nested in an engines_running test."""
    found: list[int] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return
        if isinstance(node, (ast.Continue, ast.Break, ast.Return)) and not guarded:
            found.append(node.lineno)
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            # continue/break inside an inner loop do not leave the outer iteration.
            for child in node.orelse:
                visit(child, guarded)
            return
        if isinstance(node, ast.If):
            inner = guarded or _mentions(node.test, "engines_running")
            for child in node.body:
                visit(child, inner)
            for child in node.orelse:
                visit(child, inner)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(statement, False)
    return found


def _busy_loop_problems(core: ast.Module) -> list[str]:
    where = f"{_DP_CLASS}.run_busy_loop"
    loop_fn = _method(core, _DP_CLASS, "run_busy_loop")
    if _method(core, _DP_CLASS, _GATHER_SITE) is None:
        return [f"{_DP_CLASS}.{_GATHER_SITE} is gone: the hook has nothing to extend"]
    if loop_fn is None:
        return [f"{where} is gone: cannot verify when {_GATHER_SITE} runs"]
    all_sites = [n for n in ast.walk(core) if _is_self_call(n, _GATHER_SITE)]
    loop_sites = [n for n in ast.walk(loop_fn) if _is_self_call(n, _GATHER_SITE)]
    problems = []
    if len(all_sites) != len(loop_sites):
        problems.append(f"{_GATHER_SITE} is also called outside {where} "
                        f"(lines {[n.lineno for n in all_sites if n not in loop_sites]})")
    loops = [n for n in loop_fn.body if isinstance(n, ast.While)]
    if len(loops) != 1 or len(loop_sites) != 1:
        return problems + [f"{where} no longer has one while loop calling {_GATHER_SITE} "
                           f"exactly once (loops: {len(loops)}, call sites: {len(loop_sites)})"]
    body, site = loops[0].body, loop_sites[0]
    index = next((i for i, stmt in enumerate(body) if any(n is site for n in ast.walk(stmt))),
                 None)
    if index is None:
        return problems + [f"{where}: {_GATHER_SITE} is not in the body of its while loop"]
    if not isinstance(body[index], (ast.Assign, ast.Expr, ast.AnnAssign)):
        problems.append(f"{where}: {_GATHER_SITE} (line {site.lineno}) is not a plain statement "
                        "of the loop body, so it may not run once per iteration")
    for earlier in body[:index]:
        lines = _exits_outside_idle_guard(earlier)
        if lines:
            problems.append(f"{where}: an iteration can skip {_GATHER_SITE} at line(s) {lines} "
                            "without the all-ranks-idle test on self.engines_running")
    return problems


def _launch_problems(core: ast.Module) -> list[str]:
    where = f"EngineCoreProc.{_LAUNCH}"
    launch = _method(core, "EngineCoreProc", _LAUNCH)
    if launch is None:
        return [f"{where} is gone: the engine-core entry point the hook wraps moved"]
    problems = []
    if not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in launch.decorator_list):
        problems.append(f"{where} is no longer a staticmethod")
    if not any(isinstance(n, ast.ClassDef) and n.name == _DP_CLASS for n in core.body):
        problems.append(f"{_DP_CLASS} is no longer a module-level class of vllm.v1.engine.core")
    rebound = [n.lineno for n in ast.walk(launch)
               if (isinstance(n, ast.Name) and n.id == _DP_CLASS
                   and not isinstance(n.ctx, ast.Load))
               or (isinstance(n, (ast.Import, ast.ImportFrom))
                   and any((a.asname or a.name) == _DP_CLASS for a in n.names))]
    if rebound:
        problems.append(f"{where} binds {_DP_CLASS} locally (lines {rebound}): the module "
                        "global the hook rebinds is not what it builds")
    builds = [n for n in ast.walk(launch) if isinstance(n, ast.If) and _mentions(n.test, "is_moe")
              and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                      and c.func.id == _DP_CLASS for s in n.body for c in ast.walk(s))]
    if not builds:
        problems.append(f"{where} no longer builds {_DP_CLASS}(...) by its global name under "
                        "a test on is_moe")
    return problems


def _launcher_problems(launcher: ast.Module) -> list[str]:
    targets = [kw.value for n in ast.walk(launcher) if isinstance(n, ast.Call)
               for kw in n.keywords if kw.arg == "target"]
    if not any(isinstance(t, ast.Attribute) and t.attr == _LAUNCH
               and isinstance(t.value, ast.Name) and t.value.id == "EngineCoreProc"
               for t in targets):
        return [f"vllm.v1.engine.utils no longer launches engine cores with "
                f"target=EngineCoreProc.{_LAUNCH}: the front-end route is gone"]
    return []
