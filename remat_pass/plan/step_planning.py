"""Budgets for the whole step: the schedules of all graphs of a step chosen together so
that the composed step's peak fits a budget, with the least recompute.

Each graph with a layer stack is planned by ``planner.Planner`` (the chain model
calibrated from that graph, every answer checked) whose check is the *composed step's*
peak with the other graphs' schedules held fixed (``step_peak``). Graphs are visited
in turn (coordinate descent): first every graph moves to the schedule of least step
peak, which gives the least feasible step peak; then, from there, every graph in turn
takes the least-recompute schedule that keeps the step within the budget, until no
graph changes. A step of one graph with layers (the common case: a model and its loss
split by a break) is solved in one visit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from ..errors import InfeasibleBudget
from ..liveness.timeline import MemoryReport
from .planner import Planner
from ..graph.regions import LayerStack
from ..recompute import schedule as schedules
from ..recompute.schedule import Schedule
from ..graph.trace import JointGraph

MAX_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class PlannedGraph:
    """A graph of the step whose schedule is chosen: its id, traced joint graph, layer
    stack and current schedule."""

    graph_id: str
    joint: JointGraph
    stack: LayerStack
    schedule: Schedule


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The chosen schedules and what they reach.

    Attributes:
        schedules: graph id -> schedule, for every planned graph.
        peak_bytes: the composed step peak with them.
        least_feasible: graph id -> schedule of the least step peak found.
        least_feasible_peak_bytes: that peak.
        feasible: ``peak_bytes`` is within the budget.
    """

    schedules: dict[str, Schedule]
    peak_bytes: int
    least_feasible: dict[str, Schedule]
    least_feasible_peak_bytes: int
    feasible: bool


def least_feasible_candidates(g: PlannedGraph, planner: Planner) -> list[Schedule]:
    """The schedules tried for a graph's least step peak: the planner's least feasible
    (its chain model is calibrated on the graph alone, where the graph's outputs and
    gradients are held to the end; in the step they are not, so its answer can store
    a layer the step would rather recompute) and Megatron's uniform K=1 (every layer
    its own group), whose step peak is often the least."""
    return [planner.least_feasible()[0], schedules.uniform(1, g.stack.num_layers)]


def plan_step(graphs: Sequence[PlannedGraph], step_peak: Callable[[dict[str, Schedule]], int],
              budget_bytes: int, predict_graph: Callable[[PlannedGraph, Schedule], MemoryReport]) -> StepPlan:
    """The least-recompute schedules of ``graphs`` whose composed step peak fits.

    Args:
        graphs: the graphs to plan (each with at least one layer).
        step_peak: the composed step peak (bytes) with the given schedules (graphs not
            named keep their current schedule).
        budget_bytes: the step's peak budget.
        predict_graph: a graph's own MemoryReport under a schedule (its FLOPs are
            used; its peak is replaced by the step's).

    Returns:
        The StepPlan; ``feasible`` False when even the least feasible step peak exceeds
        the budget (``schedules`` are then the least feasible ones).
    """
    chosen = {g.graph_id: g.schedule for g in graphs}

    def planner(g: PlannedGraph) -> Planner:
        def predict(s: Schedule) -> MemoryReport:
            return dataclasses.replace(predict_graph(g, s), peak_bytes=step_peak({**chosen, g.graph_id: s}))

        return Planner(g.joint, g.stack, predict)

    for _ in range(MAX_ROUNDS):  # least feasible: each graph to its least step peak
        moved = False
        for g in graphs:
            current = step_peak(chosen)
            for candidate in least_feasible_candidates(g, planner(g)):
                peak = step_peak({**chosen, g.graph_id: candidate})
                if candidate != chosen[g.graph_id] and peak < current:
                    chosen[g.graph_id], current, moved = candidate, peak, True
        if not moved:
            break
    least, least_peak = dict(chosen), step_peak(chosen)
    if least_peak > budget_bytes:
        return StepPlan(least, least_peak, least, least_peak, False)
    for _ in range(MAX_ROUNDS):  # least recompute within the budget, one graph at a time
        moved = False
        for g in graphs:
            try:
                plan = planner(g).plan(budget_bytes)
            except InfeasibleBudget:  # the chain model's least is above this point: stay
                continue
            if plan.schedule != chosen[g.graph_id] and plan.predicted_peak_bytes <= budget_bytes:
                chosen[g.graph_id], moved = plan.schedule, True
        if not moved:
            break
    peak = step_peak(chosen)
    return StepPlan(chosen, peak, least, least_peak, peak <= budget_bytes)
