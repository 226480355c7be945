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
"""Checks, on the installed vLLM's source (AST), every seam balance scheduling relies on.

Balance scheduling copies no vLLM code: it reaches vLLM's behaviour through two seams, and each
is only sound while vLLM's code keeps a few properties. This module states and checks them, at
start-up on the classes that will actually run (an unsound class or vLLM release is refused
instead of silently not balancing) and in the guard tests, which also show each check failing on
altered source.

**Scheduler seam.** The gate sets ``self._pause_state = PauseState.PAUSED_NEW`` for one step and, where the
admission cap can be held (below), sets that cap to 0 for the step. That means "admit nothing new" only while
``schedule()``:

1. has one admission cap, ``if <count> >= self.<cap>: break`` (``==`` up to vLLM 0.23), its count one of
   ``CAP_COUNTS``; the cap can be held at 0 when every reader of the attribute in the module is such a ``>=`` test
   (vLLM 0.33's ``max_num_active_reqs``; not 0.18-0.27's ``max_num_running_reqs``, which an assertion reads);
2. puts every admission site (taking a request off a waiting queue, appending to ``self.running``) in an ``if``
   whose test requires ``self._pause_state == PauseState.UNPAUSED`` (every line), or after a test of a held cap in
   its loop (vLLM >= 0.32 drains KV-holding requests under ``PAUSED_NEW``); a nested helper counts where it is
   called;
3. compares ``self._pause_state`` only with ``UNPAUSED`` or ``PAUSED_ALL`` (``==``, or ``!=`` from 0.32).

**Engine seam.** The gather extends ``DPEngineCoreProc._has_global_unfinished_reqs``, and the
engine-core launch is routed so the engine process builds the balanced class. That holds while:

1. ``DPEngineCoreProc.run_busy_loop`` calls ``self._has_global_unfinished_reqs`` exactly once per
   iteration, as a plain statement of its ``while`` body; every earlier way out of the iteration
   (``continue``/``break``/``return``) sits under a test of ``self.engines_running`` (the
   all-ranks-idle skip), and nothing else in the module calls it;
2. ``EngineCoreProc.run_engine_core`` is a staticmethod that builds ``DPEngineCoreProc`` by its
   module-global name under a test on ``is_moe``;
3. the launcher passes ``EngineCoreProc.run_engine_core`` as the engine-core process target.

**Ray DP seam.** With ``data_parallel_backend="ray"`` vLLM's launcher starts the ranks as Ray actors, and the route
binds the balanced actor where the launcher imports the class. That holds while (and 1. above):

4. ``CoreEngineActorManager.__init__`` imports ``DPMoEEngineCoreActor`` from ``vllm.v1.engine.core`` inside its
   body (at launch time, so it reads the module attribute the route rebinds);
5. ``DPMoEEngineCoreActor`` has ``DPEngineCoreProc`` among its bases, and neither it nor ``EngineCoreActorMixin``
   defines the busy loop or the three methods the balance mixin extends;
6. ``EngineCoreActorMixin.run`` (the actor's entry) calls ``self.run_busy_loop()``.
"""

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

# ---- AST helpers ----------------------------------------------------------------------------


def _is(node: ast.AST | None, *texts: str) -> bool:
    """``node`` is one of the expressions ``texts``, written as vLLM's source would (e.g.
    ``self._pause_state``, ``PauseState.UNPAUSED``)."""
    return isinstance(node, (ast.Attribute, ast.Name, ast.Call, ast.Compare)) and ast.unparse(node) in texts


def _mentions(node: ast.AST, name: str) -> bool:
    return any(getattr(n, "attr", getattr(n, "id", None)) == name for n in ast.walk(node))


def _calls(tree: ast.AST, *texts: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is(n.func, *texts)]


def _binds(node: ast.AST, name: str) -> bool:
    """``node`` binds ``name`` locally: an assignment target or an import alias."""
    if isinstance(node, ast.alias):
        return (node.asname or node.name) == name
    return isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load)


def method_node(tree: ast.Module, owner: str, name: str) -> ast.FunctionDef | None:
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner]
    return next((m for c in classes for m in c.body if isinstance(m, ast.FunctionDef) and m.name == name), None)


# ---- scheduler seam -------------------------------------------------------------------------

# Calls that take a request off a waiting queue (with the helper that picks the queue, 0.18-0.30).
_TAKES_WAITING = ("pop_request", "peek_request", "_select_waiting_queue_for_scheduling")
_UNPAUSED = ("self._pause_state == PauseState.UNPAUSED", "self._pause_state is PauseState.UNPAUSED")
# != PAUSED_ALL: vLLM >= 0.32's admission block, which PAUSED_NEW enters.
_ALLOWED_PAUSE_TESTS = (*_UNPAUSED, *(f"self._pause_state {op} PauseState.PAUSED_ALL" for op in ("==", "!=")))
# The admission cap: ``if <count> >= self.<cap>: break`` (``==`` up to 0.23) in the admission loop.
_CAPS = ("max_num_running_reqs", "max_num_active_reqs")
# Each count a known vLLM compares with its cap (a local name read as its assignment), and how the gather computes
# it: the gate closes when some rank's count reaches the cap, on the same terms as vLLM's own admission.
CAP_COUNTS: dict[str, Callable[[Any], int]] = {
    "len(self.running)": lambda s: len(s.running),  # 0.18, 0.23
    # >= 0.27: paused streams hold a slot
    "len(self.running) + self.num_waiting_for_streaming_input": lambda s: len(s.running)
    + s.num_waiting_for_streaming_input,
}


class AdmissionCap(NamedTuple):
    """The cap of the admission loop: what it counts (a key of ``CAP_COUNTS``), the attribute it compares with, and
    whether only cap tests read that attribute, so a gated step may hold it at 0 (vLLM >= 0.32 admits KV-holding
    waiting requests under ``PAUSED_NEW``, before its cap test)."""

    count: str
    attribute: str
    held_at_zero: bool


class ScheduleShape(NamedTuple):
    """What the AST of one ``schedule`` implementation shows."""

    admissions: int
    delegates_to_super: bool
    problems: list[str]
    cap: AdmissionCap | None = None


def _requires_unpaused(test: ast.AST) -> bool:
    """``test`` can only hold while the state is UNPAUSED (alone or in an ``and`` chain, as vLLM writes it)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_requires_unpaused(value) for value in test.values)
    return _is(test, *_UNPAUSED)


def _cap_test(node: ast.AST | None) -> tuple[ast.expr, str, bool] | None:
    """``(count, cap attribute, whether it is a >= test)`` when ``node`` is ``if <count> >= self.<cap>: break`` (or
    ``==``, up to 0.23: a test a cap held at 0 would not stop)."""
    test = node.test if isinstance(node, ast.If) and [type(s) for s in node.body] == [ast.Break] else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.GtE, ast.Eq))):
        return None
    cap = next((cap for cap in _CAPS if _is(test.comparators[0], f"self.{cap}")), None)
    return (test.left, cap, isinstance(test.ops[0], ast.GtE)) if cap else None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _admission_cap(tree: ast.AST, parents: dict[ast.AST, ast.AST], module: ast.Module) -> AdmissionCap | str:
    """The one admission cap of ``tree`` (a ``schedule``; ``parents`` its parent links), or why there is none that
    the gate understands."""
    found = set()
    for node in ast.walk(tree):
        if (test := _cap_test(node)) is None:
            continue
        count, attribute, _ = test
        if isinstance(count, ast.Name):  # e.g. num_running = len(self.running) + ...
            body = getattr(parents[node], "body", [])
            values = [s.value for s in body if isinstance(s, ast.Assign) and _is(s.targets[0], count.id)]
            count = values[-1] if values else count
        found.add((ast.unparse(count), attribute))
    if len(found) != 1 or next(iter(found))[0] not in CAP_COUNTS:
        return f"admission cap tests {sorted(found)} are not one known cap of {sorted(CAP_COUNTS)}"
    ((count_text, attribute),) = found
    module_parents = _parents(module)
    reads = [n for n in ast.walk(module) if _is(n, f"self.{attribute}") and isinstance(n.ctx, ast.Load)]
    tests = [_cap_test(module_parents.get(module_parents[n])) for n in reads]
    return AdmissionCap(count_text, attribute, all(test and test[2] for test in tests))


def schedule_shape(schedule_source: str, module_source: str, where: str = "schedule") -> ScheduleShape:
    """The shape of one ``schedule`` (its source, and its module's, where the cap attribute's readers are)."""
    tree, module = ast.parse(textwrap.dedent(schedule_source)), ast.parse(module_source)
    parents, root = _parents(tree), tree.body[0]
    cap = _admission_cap(tree, parents, module)
    held_cap = cap.attribute if isinstance(cap, AdmissionCap) and cap.held_at_zero else None

    def guarded(node: ast.AST) -> bool:
        """Under the UNPAUSED guard, after a test of a cap held at 0, or in a helper only called so."""
        while (parent := parents.get(node)) is not None:
            if isinstance(parent, ast.If) and node in parent.body and _requires_unpaused(parent.test):
                return True
            if isinstance(parent, ast.While) and node in parent.body:
                if any((test := _cap_test(s)) and test[1] == held_cap for s in parent.body[: parent.body.index(node)]):
                    return True
            if isinstance(parent, ast.FunctionDef) and parent is not root:
                calls = _calls(root, parent.name)
                return bool(calls) and all(guarded(call) for call in calls)
            node = parent
        return False

    admissions = _calls(tree, "self.running.append") + [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in _TAKES_WAITING
    ]
    outside = "admission outside the UNPAUSED guard and the held cap"
    problems = [f"{where}: {outside} at line {n.lineno}: {ast.unparse(n)}" for n in admissions if not guarded(n)]
    # Any other use of the state (stored, passed on, compared with PAUSED_NEW...) could give PAUSED_NEW a meaning
    # beyond "admit nothing new".
    problems += [
        f"{where}: pause state used in an unexpected way at line {n.lineno}: {ast.unparse(parents[n])}"
        for n in ast.walk(tree)
        if _is(n, "self._pause_state") and not _is(parents[n], *_ALLOWED_PAUSE_TESTS)
    ]
    if admissions and isinstance(cap, str):
        problems.append(f"{where}: {cap}")
    return ScheduleShape(len(admissions), bool(_calls(tree, "super().schedule")), problems, cap if admissions else None)


@functools.cache
def inspect_schedule(owner: type) -> ScheduleShape:
    """The shape of ``owner.schedule`` as defined in ``owner`` itself."""
    where = f"{owner.__module__}.{owner.__qualname__}.schedule"
    try:
        sources = inspect.getsource(owner.__dict__["schedule"]), inspect.getsource(sys.modules[owner.__module__])
    except (OSError, TypeError) as error:
        return ScheduleShape(0, False, [f"{where}: source unavailable ({error}); cannot verify the seam"])
    return schedule_shape(*sources, where)


def schedule_seam(scheduler_cls: type, skip: tuple[type, ...] = ()) -> ScheduleShape:
    """The shape of the ``schedule`` that admits requests for ``scheduler_cls``; no problems: the gate is sound.

    Walks the MRO over every ``schedule`` implementation that will run (``skip``: classes to pass over, i.e. the
    balance mixin): one that admits requests must do so only where the gate stops it; one that admits nothing must
    hand over to ``super().schedule()``.
    """
    for klass in scheduler_cls.__mro__:
        if klass in skip or "schedule" not in klass.__dict__:
            continue
        shape = inspect_schedule(klass)
        if shape.admissions or shape.problems:
            return shape
        if not shape.delegates_to_super:
            moved = "admits no waiting request and does not call super().schedule(): the admission code moved"
            return shape._replace(problems=[f"{klass.__qualname__}.schedule {moved} and the seam cannot be verified"])
    return ScheduleShape(0, False, [f"{scheduler_cls.__qualname__} has no schedule() implementation"])


# ---- engine seam ----------------------------------------------------------------------------

_GATHER = "self._has_global_unfinished_reqs"
_DP_CLASS = "DPEngineCoreProc"
_LOOP = f"{_DP_CLASS}.run_busy_loop"
_LAUNCH, _ACTOR, _CORE = "EngineCoreProc.run_engine_core", "DPMoEEngineCoreActor", "vllm.v1.engine.core"


def engine_seam_problems(core_source: str | None = None, launcher_source: str | None = None) -> list[str]:
    """What in vLLM's engine-core code breaks the engine seam (empty when sound).

    Sources default to the installed ``vllm/v1/engine/core.py`` and ``vllm/v1/engine/utils.py``; the guard tests
    pass altered sources to show each check failing.
    """
    core = ast.parse(core_source or inspect.getsource(importlib.import_module("vllm.v1.engine.core")))
    launcher = ast.parse(launcher_source or inspect.getsource(importlib.import_module("vllm.v1.engine.utils")))
    targets = [kw.value for call in ast.walk(launcher) if isinstance(call, ast.Call) for kw in call.keywords]
    problems = _busy_loop_problems(core) + _launch_problems(core)
    if not any(_is(target, _LAUNCH) for target in targets):
        problems.append(f"vllm.v1.engine.utils no longer launches with target={_LAUNCH}: the front-end route is gone")
    return problems


def _exits_outside_idle_guard(node: ast.AST, guarded: bool = False) -> list[int]:
    """Lines of continue/break/return in ``node`` that leave the loop iteration outside an engines_running test."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        return []
    if isinstance(node, (ast.Continue, ast.Break, ast.Return)) and not guarded:
        return [node.lineno]
    # continue/break inside an inner loop do not leave the outer iteration.
    children = node.orelse if isinstance(node, (ast.For, ast.While, ast.AsyncFor)) else ast.iter_child_nodes(node)
    guarded = guarded or isinstance(node, ast.If) and _mentions(node.test, "engines_running")
    return [line for child in children for line in _exits_outside_idle_guard(child, guarded)]


def _busy_loop_problems(core: ast.Module) -> list[str]:
    loop_fn = method_node(core, _DP_CLASS, "run_busy_loop")
    if loop_fn is None or method_node(core, _DP_CLASS, _GATHER.removeprefix("self.")) is None:
        return [f"{_LOOP} or {_GATHER} is gone: the hook has nothing to extend"]
    sites, problems = _calls(loop_fn, _GATHER), []
    if outside := [n.lineno for n in _calls(core, _GATHER) if n not in sites]:
        problems.append(f"{_GATHER} is also called outside {_LOOP} (lines {outside})")
    loops = [n for n in loop_fn.body if isinstance(n, ast.While)]
    if len(loops) != 1 or len(sites) != 1:
        return [*problems, f"{_LOOP} no longer has one while loop calling {_GATHER} exactly once"]
    body = loops[0].body
    plain = [i for i, stmt in enumerate(body) if getattr(stmt, "value", None) is sites[0]]
    if not plain:
        return [*problems, f"{_LOOP}: {_GATHER} is not a plain statement of the loop (may not run every iteration)"]
    if exits := [line for stmt in body[: plain[0]] for line in _exits_outside_idle_guard(stmt)]:
        problems.append(f"{_LOOP}: an iteration can skip {_GATHER} at lines {exits} without the all-ranks-idle test")
    return problems


def _launch_problems(core: ast.Module) -> list[str]:
    launch = method_node(core, "EngineCoreProc", "run_engine_core")
    if launch is None:
        return [f"{_LAUNCH} is gone: the engine-core entry point the hook wraps moved"]
    static = any(_is(decorator, "staticmethod") for decorator in launch.decorator_list)
    problems = [] if static else [f"{_LAUNCH} is no longer a staticmethod"]
    if bindings := [n.lineno for n in ast.walk(launch) if _binds(n, _DP_CLASS)]:
        problems.append(f"{_LAUNCH} binds {_DP_CLASS} locally (lines {bindings}): the hook rebinds the module global")
    moe_branches = [n for n in ast.walk(launch) if isinstance(n, ast.If) and _mentions(n.test, "is_moe")]
    if not any(_calls(stmt, _DP_CLASS) for branch in moe_branches for stmt in branch.body):
        problems.append(f"{_LAUNCH} no longer builds {_DP_CLASS}(...) by its global name under a test on is_moe")
    return problems


def ray_seam_problems(core_source: str | None = None, launcher_source: str | None = None) -> list[str]:
    """What in vLLM's Ray DP launcher and actor breaks the Ray DP seam (4-6 above; empty when sound); the route
    checks 1-3 with ``engine_seam_problems`` too. Sources as there."""
    core = ast.parse(core_source or inspect.getsource(importlib.import_module(_CORE)))
    launcher = ast.parse(launcher_source or inspect.getsource(importlib.import_module("vllm.v1.engine.utils")))
    launch = method_node(launcher, "CoreEngineActorManager", "__init__") or core  # core.py never imports itself
    names = [a.name for n in ast.walk(launch) if isinstance(n, ast.ImportFrom) and n.module == _CORE for a in n.names]
    bases = [ast.unparse(base) for n in core.body if getattr(n, "name", "") == _ACTOR for base in n.bases]
    runs = [_calls(run, "self.run_busy_loop") for c in (_ACTOR, *bases) if (run := method_node(core, c, "run"))]
    loops = [c for c in (_ACTOR, *bases) if method_node(core, c, "run_busy_loop")]  # [_DP_CLASS]: a base, alone
    problems = [] if _ACTOR in names else [f"CoreEngineActorManager.__init__ no longer imports {_ACTOR} itself"]
    if not (runs and runs[0] and loops == [_DP_CLASS]):
        problems.append(f"{_ACTOR} no longer runs {_LOOP} (its bases, its run() or their busy loop changed)")
    return problems


def refuse_if(problems: list[str], headline: str, remedy: str) -> None:
    """Refuse balance scheduling, loudly, when a seam check found ``problems``."""
    if problems:
        raise RuntimeError(f"{headline}:\n  - " + "\n  - ".join(problems) + f"\n{remedy}")
