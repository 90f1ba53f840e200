"""Budgets for the whole step: the choices of all graphs of a step (whole-layer
schedules, or op-level choices with ``granularity="op"``) picked together so that the
composed step's peak fits a budget, with the least recompute.

A graph's planner (``planner.Planner``, ``op_planner.OpPlanner``: one skeleton,
``planner.ChainPlanner``) is calibrated on the graph alone, where its outputs and
gradients are held to its own end; in the step they are not, and the other graphs hold
values across its run, so the graph's own peak is off the step's by an offset that
depends on the step (``liveness.composition``). Each graph's chain model is therefore
solved against the composed step's peak with the other graphs' choices held fixed
(``step_peak``), every answer checked on the composed step. Graphs are visited in turn
(coordinate descent, ``plan_step``):

1. least feasible: every graph moves to the choice of least step peak among its
   candidates (``least_candidates``), which gives the least feasible step peak;
2. least recompute: from there, every graph in turn takes a cheaper choice that keeps
   the step within the budget (``cheaper``), until no graph changes.

The two granularities differ only in a graph's candidates and moves:

- ``WholeLayerGraph``: choices are Schedules. Phase 1 always runs (the schedules it
  starts from were each planned on its graph alone); its candidates are the chain
  model's least feasible schedule (its model can store a layer the step would rather
  recompute) and Megatron's uniform K=1, whose step peak is often the least; a move
  in phase 2 is the least-recompute answer within the budget
  (``solvers.least_recompute_checked``).
- ``OpLevelGraph``: choices are chain-model Solutions (groups and per-layer options).
  Phase 1 runs only when the choices given (each graph's own plan,
  ``graph_schedule.GraphScheduler.op_level``) do not fit; a move in phase 2 is
  ``solvers.least_recompute_offset`` from the budget the step leaves the graph
  (``budget_bytes`` plus what its chain model over-states the step's peak by at its
  current choice), taken only when its chain-model recompute cost is lower, so the
  answer never recomputes more than the choices it starts from when those fit.

A step of one graph with layers (the common case: a model and its loss split by a
break) is solved in one visit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Hashable, Sequence

from solvers import Solution, least_feasible_checked, least_recompute_checked, least_recompute_offset

from ..errors import InfeasibleBudget
from ..recompute import schedule as schedules
from ..recompute.partition import Partition
from ..recompute.rewrite import RewrittenStep, rewrite
from ..recompute.schedule import Schedule
from .op_planner import OpPlanner
from .planner import ChainPlanner, Planner

MAX_ROUNDS = 3

PeakWith = Callable[[Any], int]  # the composed step peak (bytes) with one graph's choice replaced


def _peak_of_solution(planner: ChainPlanner, peak_with: PeakWith) -> Callable[[Solution], int]:
    return lambda sol: peak_with(planner.decision(sol))


@dataclasses.dataclass(frozen=True)
class WholeLayerGraph:
    """A graph of the step whose whole-layer schedule is chosen.

    Attributes:
        graph_id: its id in the step.
        planner: its layer-level planner (calibrated on the graph alone; only its chain
            model and decisions are used).
        current: the schedule it runs now (the one its compiled step holds).
        in_place: rewrite with in-place reuse (``rewrite.rewrite``'s ``in_place``; False
            for a graph Inductor compiles).
    """

    graph_id: str
    planner: Planner
    current: Schedule
    in_place: bool = True
    start_from_least: ClassVar[bool] = True

    def key(self, choice: Schedule) -> Hashable:
        """What makes two choices the same (the Schedule itself)."""
        return choice

    def decision(self, choice: Schedule) -> Schedule:
        """What the graph is rewritten by."""
        return choice

    def rewritten(self, choice: Schedule) -> RewrittenStep | None:
        """The graph rewritten by ``choice`` (None: ``current``, its compiled step)."""
        return None if choice == self.current else rewrite(self.planner.joint, self.planner.stack, choice,
                                                           in_place=self.in_place)

    def least_candidates(self, peak_with: PeakWith) -> list[Schedule]:
        """The chain model's least feasible schedule (checked on the step) and uniform K=1."""
        least = least_feasible_checked(self.planner.costs, _peak_of_solution(self.planner, peak_with))
        return [self.planner.decision(least.solution), schedules.uniform(1, self.planner.stack.num_layers)]

    def cheaper(self, budget_bytes: int, peak_with: PeakWith, current: Schedule, step_peak_bytes: int
                ) -> Schedule | None:
        """The least-recompute schedule whose step peak fits (None: the chain model's
        least feasible step peak is above the budget: stay)."""
        peak_of = _peak_of_solution(self.planner, peak_with)
        try:
            checked = least_recompute_checked(self.planner.costs, budget_bytes, peak_of,
                                              least_feasible_checked(self.planner.costs, peak_of))
        except InfeasibleBudget:
            return None
        return self.planner.decision(checked.solution) if checked.predicted_peak_bytes <= budget_bytes else None


@dataclasses.dataclass(frozen=True)
class OpLevelGraph:
    """A graph of the step whose op-level choice is picked.

    Attributes:
        graph_id: its id in the step.
        planner: its op-level planner (calibrated on the graph alone).
        current: its current choice (a Solution of ``planner.costs``: groups, per-layer
            options, model peak and recompute cost).
        in_place: as ``WholeLayerGraph.in_place``.
    """

    graph_id: str
    planner: OpPlanner
    current: Solution
    in_place: bool = True
    start_from_least: ClassVar[bool] = False

    def key(self, choice: Solution) -> Hashable:
        """What makes two choices the same: their groups and options."""
        return choice.groups, choice.options

    def decision(self, choice: Solution) -> Partition:
        """What the graph is rewritten by (``OpPlanner.partition``)."""
        return self.planner.partition(choice)

    def rewritten(self, choice: Solution) -> RewrittenStep:
        """The graph rewritten by ``choice``."""
        return rewrite(self.planner.joint, self.planner.stack, self.decision(choice), in_place=self.in_place)

    def least_candidates(self, peak_with: PeakWith) -> list[Solution]:
        """The chain model's least feasible choice, checked on the step."""
        return [least_feasible_checked(self.planner.costs, peak_with).solution]

    def cheaper(self, budget_bytes: int, peak_with: PeakWith, current: Solution, step_peak_bytes: int
                ) -> Solution | None:
        """A choice of lower chain-model recompute cost whose step peak fits, or None."""
        start = budget_bytes + current.peak_bytes - step_peak_bytes  # what the step leaves it
        found = least_recompute_offset(self.planner.costs, budget_bytes, peak_with, start)
        return found.solution if found is not None and found.recompute_flops < current.recompute_flops else None


StepGraph = WholeLayerGraph | OpLevelGraph


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The chosen choices and what they reach.

    Attributes:
        choices: graph id -> its choice (a Schedule, or an op-level Solution).
        decisions: graph id -> what it is rewritten by (the Schedule, or its Partition).
        peak_bytes: the composed step peak with them (bytes).
        least_feasible: graph id -> the choice of the least step peak found.
        least_feasible_peak_bytes: that peak (bytes).
        feasible: ``peak_bytes`` is within the budget.
    """

    choices: dict[str, Any]
    decisions: dict[str, Schedule | Partition]
    peak_bytes: int
    least_feasible: dict[str, Any]
    least_feasible_peak_bytes: int
    feasible: bool


class _StepPeaks:
    """Composed step peaks of the graphs' choices; rewrites and peaks cached."""

    def __init__(self, graphs: Sequence[StepGraph], step_peak: Callable[[dict[str, RewrittenStep]], int]):
        self.by_id = {g.graph_id: g for g in graphs}
        self._step_peak = step_peak
        self._steps: dict[tuple, RewrittenStep | None] = {}
        self._peaks: dict[tuple, int] = {}

    def __call__(self, chosen: dict[str, Any]) -> int:
        keys = tuple((gid, self.by_id[gid].key(c)) for gid, c in chosen.items())
        if keys not in self._peaks:
            steps = {}
            for key, (gid, c) in zip(keys, chosen.items()):
                if key not in self._steps:
                    self._steps[key] = self.by_id[gid].rewritten(c)
                if self._steps[key] is not None:
                    steps[gid] = self._steps[key]
            self._peaks[keys] = self._step_peak(steps)
        return self._peaks[keys]


def plan_step(graphs: Sequence[StepGraph], step_peak: Callable[[dict[str, RewrittenStep]], int],
              budget_bytes: int, max_rounds: int = MAX_ROUNDS) -> StepPlan:
    """The choices of ``graphs`` of least recompute found whose composed step peak fits
    ``budget_bytes`` (see the module docstring).

    Args:
        graphs: the graphs to plan (each with at least one layer; all of one
            granularity), with their current choices.
        step_peak: the composed step peak (bytes) when the named graphs run the given
            rewritten steps (the other graphs keep their compiled ones), e.g.
            ``compile.steps.compose``'s.
        budget_bytes: the step's peak budget (bytes).
        max_rounds: how many times each phase may visit every graph.

    Returns:
        The StepPlan; ``feasible`` False when even the least step peak found exceeds
        the budget (``choices`` are then the least feasible ones).
    """
    peak = _StepPeaks(graphs, step_peak)
    chosen = {g.graph_id: g.current for g in graphs}

    def with_(gid: str) -> PeakWith:
        return lambda c: peak({**chosen, gid: c})

    if any(g.start_from_least for g in graphs) or peak(chosen) > budget_bytes:
        for _ in range(max_rounds):  # least feasible: each graph to its least step peak
            moved = False
            for g in graphs:
                current = peak(chosen)
                for candidate in g.least_candidates(with_(g.graph_id)):
                    p = with_(g.graph_id)(candidate)
                    if g.key(candidate) != g.key(chosen[g.graph_id]) and p < current:
                        chosen[g.graph_id], current, moved = candidate, p, True
            if not moved:
                break
    least, least_peak = dict(chosen), peak(chosen)
    if least_peak <= budget_bytes:
        for _ in range(max_rounds):  # least recompute within the budget, one graph at a time
            moved = False
            for g in graphs:
                found = g.cheaper(budget_bytes, with_(g.graph_id), chosen[g.graph_id], peak(chosen))
                if found is not None and g.key(found) != g.key(chosen[g.graph_id]):
                    chosen[g.graph_id], moved = found, True
            if not moved:
                break
    final = peak(chosen)
    return StepPlan(
        choices=dict(chosen), decisions={g.graph_id: g.decision(chosen[g.graph_id]) for g in graphs},
        peak_bytes=final, least_feasible=least, least_feasible_peak_bytes=least_peak,
        feasible=final <= budget_bytes)
