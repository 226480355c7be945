"""Verifies, on the installed vLLM, the one seam balance scheduling relies on.

Balance scheduling must stop a rank from admitting *new* waiting requests for one step while its
running requests are scheduled as usual. Instead of copying vLLM's ``Scheduler.schedule()`` (which
drifts with every release), the gate sets the scheduler's pause state to ``PAUSED_NEW`` for that
step. That is only correct while the installed ``schedule()`` keeps these properties:

1. every admission site (taking a request off a waiting queue, appending to ``self.running``) is
   nested in an ``if`` whose test requires ``self._pause_state == PauseState.UNPAUSED``;
2. ``schedule()`` compares ``self._pause_state`` only with ``PAUSED_ALL`` or ``UNPAUSED``, so
   ``PAUSED_NEW`` has no further effect inside the step.

This module checks both by reading the source (AST) of whichever class provides ``schedule()``, so
a vLLM release, or a scheduler subclass such as vllm-ascend's ``SchedulerDynamicBatch``, that
breaks them is refused at start-up instead of silently not balancing. The unit tests call the same
check on the installed vLLM (the guard test).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass, field

# Methods that take a request off a waiting queue.
_DEQUEUE_METHODS = frozenset({"pop_request", "peek_request"})
# A helper that picks which waiting queue to admit from (vLLM >= 0.18).
_QUEUE_SELECTORS = frozenset({"_select_waiting_queue_for_scheduling"})
_ALLOWED_PAUSE_COMPARISONS = frozenset({"PAUSED_ALL", "UNPAUSED"})


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
        found = [f"{self.owner}: admission outside the UNPAUSED guard at {site}"
                 for site in self.unguarded_sites]
        found += [f"{self.owner}: pause state used in an unexpected way at {site}"
                  for site in self.unexpected_pause_reads]
        return found


def _is_self_attr(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _is_pause_member(node: ast.AST, member: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == member
            and isinstance(node.value, ast.Name) and node.value.id == "PauseState")


def _requires_unpaused(test: ast.AST) -> bool:
    """True when ``test`` can only be true while ``self._pause_state == PauseState.UNPAUSED``.

    Accepts the comparison alone or as one operand of an ``and`` chain (vLLM writes
    ``not preempted_reqs and self._pause_state == PauseState.UNPAUSED``).
    """
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_requires_unpaused(value) for value in test.values)
    return (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Eq, ast.Is))
            and _is_self_attr(test.left, "_pause_state")
            and _is_pause_member(test.comparators[0], "UNPAUSED"))


def _is_admission(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    method = node.func.attr
    if method in _DEQUEUE_METHODS or method in _QUEUE_SELECTORS:
        return True
    return method == "append" and _is_self_attr(node.func.value, "running")


def _is_super_schedule_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "schedule" and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name) and node.func.value.func.id == "super")


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
        if _is_super_schedule_call(node):
            self.report.delegates_to_super = True
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        if any(_is_self_attr(op, "_pause_state") for op in operands):
            allowed = (len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.Is))
                       and any(_is_pause_member(op, m) for op in operands
                               for m in _ALLOWED_PAUSE_COMPARISONS))
            if not allowed:
                self.report.unexpected_pause_reads.append(
                    f"line {node.lineno}: {ast.unparse(node)}")
            return
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # A bare read of the pause state (passed on, stored, compared with PAUSED_NEW...) would
        # let PAUSED_NEW mean more than "admit nothing new"; the comparisons above are handled.
        if _is_self_attr(node, "_pause_state") and isinstance(node.ctx, ast.Load):
            self.report.unexpected_pause_reads.append(f"line {node.lineno}: self._pause_state")
        self.generic_visit(node)


@functools.cache
def inspect_schedule(owner: type) -> ScheduleSeamReport:
    """AST report of ``owner.schedule`` as defined in ``owner`` itself."""
    name = f"{owner.__module__}.{owner.__qualname__}.schedule"
    report = ScheduleSeamReport(owner=name)
    function = owner.__dict__["schedule"]
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError) as error:
        report.unguarded_sites.append(f"source unavailable ({error}); cannot verify the seam")
        return report
    _ScheduleVisitor(report).visit(ast.parse(source))
    return report


def schedule_seam_problems(scheduler_cls: type, skip: tuple[type, ...] = ()) -> list[str]:
    """Problems that keep the pause-state gate from working on ``scheduler_cls``.

    Walks the MRO from ``scheduler_cls`` over every ``schedule`` implementation that will run
    (``skip`` names classes to pass over, i.e. the balance mixin itself): an implementation that
    admits requests must do so only under the UNPAUSED guard; one that admits nothing must hand
    over to ``super().schedule()``, whose implementation is checked in turn. An empty list means
    the gate is sound for this class.
    """
    for klass in scheduler_cls.__mro__:
        if klass in skip or "schedule" not in klass.__dict__:
            continue
        report = inspect_schedule(klass)
        if report.admission_sites:
            return report.problems
        if not report.delegates_to_super:
            return [*report.problems,
                    f"{report.owner} admits no waiting request and does not call "
                    "super().schedule(): the admission code moved and the seam cannot be verified"]
        if report.problems:
            return report.problems
    return [f"{scheduler_cls.__qualname__} has no schedule() implementation"]
