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

**Scheduler seam.** The gate sets ``self._pause_state = PauseState.PAUSED_NEW`` for one step, which
means "admit nothing new" only while ``schedule()``:

1. nests every admission site (taking a request off a waiting queue, appending to
   ``self.running``) in an ``if`` whose test requires ``self._pause_state == PauseState.UNPAUSED``;
2. compares ``self._pause_state`` only with ``PAUSED_ALL`` or ``UNPAUSED``.

**Engine seam.** The gather extends ``DPEngineCoreProc._has_global_unfinished_reqs``, and the
engine-core launch is routed so the engine process builds the balanced class. That holds while:

1. ``DPEngineCoreProc.run_busy_loop`` calls ``self._has_global_unfinished_reqs`` exactly once per
   iteration, as a plain statement of its ``while`` body, every earlier way out of the iteration
   (``continue``/``break``/``return``) sits under a test of ``self.engines_running`` (the
   all-ranks-idle skip), and nothing else in the module calls it;
2. ``EngineCoreProc.run_engine_core`` is a staticmethod that builds ``DPEngineCoreProc`` by its
   module-global name under a test on ``is_moe``;
3. the launcher passes ``EngineCoreProc.run_engine_core`` as the engine-core process target.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass, field

# ---- AST helpers ----------------------------------------------------------------------------


def _is(node: ast.AST, *texts: str) -> bool:
    """``node`` is one of the expressions ``texts``, written as vLLM's source would (e.g.
    ``self._pause_state``, ``PauseState.UNPAUSED``)."""
    return isinstance(node, (ast.Attribute, ast.Name, ast.Call, ast.Compare)) and ast.unparse(node) in texts


def _mentions(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == name or isinstance(n, ast.Name) and n.id == name
        for n in ast.walk(node)
    )


def method_node(tree: ast.Module, owner: str, name: str) -> ast.FunctionDef | None:
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner]
    methods = [item for cls in classes for item in cls.body if isinstance(item, ast.FunctionDef) and item.name == name]
    return methods[0] if methods else None


# ---- scheduler seam -------------------------------------------------------------------------

# Methods that take a request off a waiting queue, and the helper that picks the queue (>= 0.18).
_ADMISSION_METHODS = frozenset({"pop_request", "peek_request", "_select_waiting_queue_for_scheduling"})
_ALLOWED_PAUSE_COMPARISONS = ("PauseState.PAUSED_ALL", "PauseState.UNPAUSED")


@dataclass
class ScheduleSeamReport:
    """What the AST of one ``schedule`` implementation shows."""

    owner: str
    admission_sites: int = 0
    unguarded_sites: list[str] = field(default_factory=list)
    unexpected_pause_reads: list[str] = field(default_factory=list)
    delegates_to_super: bool = False

    @property
    def problems(self) -> list[str]:
        found = [f"{self.owner}: admission outside the UNPAUSED guard at {site}" for site in self.unguarded_sites]
        found += [
            f"{self.owner}: pause state used in an unexpected way at {site}" for site in self.unexpected_pause_reads
        ]
        return found


def _requires_unpaused(test: ast.AST) -> bool:
    """True when ``test`` can only hold while ``self._pause_state == PauseState.UNPAUSED``
    (alone or as one operand of an ``and`` chain, as vLLM writes it)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_requires_unpaused(value) for value in test.values)
    return _is(test, "self._pause_state == PauseState.UNPAUSED", "self._pause_state is PauseState.UNPAUSED")


def _is_admission(node: ast.Call) -> bool:
    method = getattr(node.func, "attr", None)
    return method in _ADMISSION_METHODS or _is(node.func, "self.running.append")


class _ScheduleVisitor(ast.NodeVisitor):
    def __init__(self, report: ScheduleSeamReport) -> None:
        self.report = report
        self.guard_depth = 0

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        guarded = _requires_unpaused(node.test)
        self.guard_depth += guarded
        for child in node.body:
            self.visit(child)
        self.guard_depth -= guarded
        for child in node.orelse:
            self.visit(child)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_admission(node):
            self.report.admission_sites += 1
            if self.guard_depth == 0:
                self.report.unguarded_sites.append(f"line {node.lineno}: {ast.unparse(node)}")
        self.report.delegates_to_super |= _is(node.func, "super().schedule")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        if not any(_is(op, "self._pause_state") for op in operands):
            self.generic_visit(node)
            return
        one_equality = len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.Is))
        if not (one_equality and any(_is(op, *_ALLOWED_PAUSE_COMPARISONS) for op in operands)):
            self.report.unexpected_pause_reads.append(f"line {node.lineno}: {ast.unparse(node)}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # A bare read (passed on, stored, compared with PAUSED_NEW...) would let PAUSED_NEW mean
        # more than "admit nothing new"; the allowed comparisons never reach here.
        if _is(node, "self._pause_state") and isinstance(node.ctx, ast.Load):
            self.report.unexpected_pause_reads.append(f"line {node.lineno}: self._pause_state")
        self.generic_visit(node)


@functools.cache
def inspect_schedule(owner: type) -> ScheduleSeamReport:
    """AST report of ``owner.schedule`` as defined in ``owner`` itself."""
    report = ScheduleSeamReport(owner=f"{owner.__module__}.{owner.__qualname__}.schedule")
    try:
        source = textwrap.dedent(inspect.getsource(owner.__dict__["schedule"]))
    except (OSError, TypeError) as error:
        report.unguarded_sites.append(f"source unavailable ({error}); cannot verify the seam")
        return report
    _ScheduleVisitor(report).visit(ast.parse(source))
    return report


def schedule_seam_problems(scheduler_cls: type, skip: tuple[type, ...] = ()) -> list[str]:
    """Problems that keep the pause-state gate from working on ``scheduler_cls`` (empty: sound).

    Walks the MRO over every ``schedule`` implementation that will run (``skip``: classes to
    pass over, i.e. the balance mixin): one that admits requests must do so only under the
    UNPAUSED guard; one that admits nothing must hand over to ``super().schedule()``.
    """
    for klass in scheduler_cls.__mro__:
        if klass in skip or "schedule" not in klass.__dict__:
            continue
        report = inspect_schedule(klass)
        if report.admission_sites:
            return report.problems
        if not report.delegates_to_super:
            return [
                *report.problems,
                f"{report.owner} admits no waiting request and does not call "
                "super().schedule(): the admission code moved and the seam cannot be verified",
            ]
        if report.problems:
            return report.problems
    return [f"{scheduler_cls.__qualname__} has no schedule() implementation"]


# ---- engine seam ----------------------------------------------------------------------------

_GATHER_SITE = "_has_global_unfinished_reqs"
_DP_CLASS = "DPEngineCoreProc"
_LAUNCH = "run_engine_core"


def engine_seam_problems(core_source: str | None = None, launcher_source: str | None = None) -> list[str]:
    """What in vLLM's engine-core code breaks the engine seam (empty when sound).

    Sources default to the installed ``vllm/v1/engine/core.py`` and ``vllm/v1/engine/utils.py``;
    the guard tests pass altered sources to show each check failing.
    """
    if core_source is None:
        core_source = inspect.getsource(importlib.import_module("vllm.v1.engine.core"))
    if launcher_source is None:
        launcher_source = inspect.getsource(importlib.import_module("vllm.v1.engine.utils"))
    core = ast.parse(core_source)
    return _busy_loop_problems(core) + _launch_problems(core) + _launcher_problems(ast.parse(launcher_source))


@functools.cache
def installed_engine_seam_problems() -> tuple[str, ...]:
    return tuple(engine_seam_problems())


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
        inner = guarded or (isinstance(node, ast.If) and _mentions(node.test, "engines_running"))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(statement, False)
    return found


def _busy_loop_problems(core: ast.Module) -> list[str]:
    where = f"{_DP_CLASS}.run_busy_loop"
    loop_fn = method_node(core, _DP_CLASS, "run_busy_loop")
    if method_node(core, _DP_CLASS, _GATHER_SITE) is None:
        return [f"{_DP_CLASS}.{_GATHER_SITE} is gone: the hook has nothing to extend"]
    if loop_fn is None:
        return [f"{where} is gone: cannot verify when {_GATHER_SITE} runs"]
    all_sites = [n for n in ast.walk(core) if isinstance(n, ast.Call) and _is(n.func, f"self.{_GATHER_SITE}")]
    loop_sites = [n for n in ast.walk(loop_fn) if isinstance(n, ast.Call) and _is(n.func, f"self.{_GATHER_SITE}")]
    problems = []
    if len(all_sites) != len(loop_sites):
        problems.append(
            f"{_GATHER_SITE} is also called outside {where} "
            f"(lines {[n.lineno for n in all_sites if n not in loop_sites]})"
        )
    loops = [n for n in loop_fn.body if isinstance(n, ast.While)]
    if len(loops) != 1 or len(loop_sites) != 1:
        return problems + [
            f"{where} no longer has one while loop calling {_GATHER_SITE} "
            f"exactly once (loops: {len(loops)}, call sites: {len(loop_sites)})"
        ]
    body, site = loops[0].body, loop_sites[0]
    index = next((i for i, stmt in enumerate(body) if any(n is site for n in ast.walk(stmt))), None)
    if index is None:
        return problems + [f"{where}: {_GATHER_SITE} is not in the body of its while loop"]
    if not isinstance(body[index], (ast.Assign, ast.Expr, ast.AnnAssign)):
        problems.append(
            f"{where}: {_GATHER_SITE} (line {site.lineno}) is not a plain statement "
            "of the loop body, so it may not run once per iteration"
        )
    for earlier in body[:index]:
        lines = _exits_outside_idle_guard(earlier)
        if lines:
            problems.append(
                f"{where}: an iteration can skip {_GATHER_SITE} at line(s) {lines} "
                "without the all-ranks-idle test on self.engines_running"
            )
    return problems


def _launch_problems(core: ast.Module) -> list[str]:
    where = f"EngineCoreProc.{_LAUNCH}"
    launch = method_node(core, "EngineCoreProc", _LAUNCH)
    if launch is None:
        return [f"{where} is gone: the engine-core entry point the hook wraps moved"]
    problems = []
    if not any(_is(d, "staticmethod") for d in launch.decorator_list):
        problems.append(f"{where} is no longer a staticmethod")
    if not any(isinstance(n, ast.ClassDef) and n.name == _DP_CLASS for n in core.body):
        problems.append(f"{_DP_CLASS} is no longer a module-level class of vllm.v1.engine.core")
    rebound = [
        n.lineno
        for n in ast.walk(launch)
        if (isinstance(n, ast.Name) and n.id == _DP_CLASS and not isinstance(n.ctx, ast.Load))
        or (isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == _DP_CLASS for a in n.names))
    ]
    if rebound:
        problems.append(
            f"{where} binds {_DP_CLASS} locally (lines {rebound}): the module "
            "global the hook rebinds is not what it builds"
        )
    builds = [
        n
        for n in ast.walk(launch)
        if isinstance(n, ast.If)
        and _mentions(n.test, "is_moe")
        and any(
            isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == _DP_CLASS
            for s in n.body
            for c in ast.walk(s)
        )
    ]
    if not builds:
        problems.append(f"{where} no longer builds {_DP_CLASS}(...) by its global name under a test on is_moe")
    return problems


def _launcher_problems(launcher: ast.Module) -> list[str]:
    targets = [
        kw.value for n in ast.walk(launcher) if isinstance(n, ast.Call) for kw in n.keywords if kw.arg == "target"
    ]
    if not any(_is(t, f"EngineCoreProc.{_LAUNCH}") for t in targets):
        return [
            f"vllm.v1.engine.utils no longer launches engine cores with "
            f"target=EngineCoreProc.{_LAUNCH}: the front-end route is gone"
        ]
    return []
