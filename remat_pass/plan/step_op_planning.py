"""Op-level budgets for the whole step: every graph's op-level choice (which values of
its stored layers are saved or recomputed, and its whole-layer groups) picked so that
the composed step's peak fits a budget, with the least total recompute cost.

A graph's ``op_planner.OpPlanner`` is calibrated on the graph alone, where its outputs
and gradients are held to its own end; in the step they are not, and the other graphs
hold values across its run, so the graph's own peak is off the step's by an offset that
depends on the step (``step_composition``). Each graph is therefore solved against the
composed step's peak with the other graphs' choices held fixed: by
``solvers.resolve.least_recompute_offset``, from the budget the step leaves the graph
(``budget_bytes`` plus what its chain model over-states the step's peak by at its
current choice), every answer checked on the composed step. Graphs are visited in turn
(coordinate descent, as ``step_planning`` does for whole layers) until none changes.
A graph takes a new choice only when its chain-model recompute cost is lower and the
step stays within the budget, so the answer never recomputes more than the choices it
starts from (each graph's own plan, ``graph_schedule.GraphScheduler.op_level``). When
those do not fit, every graph first moves to its choice of least step peak.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from solvers import Solution, least_feasible_checked, least_recompute_offset

from .op_planner import OpPlanner
from ..recompute.partition import Partition
from ..recompute.rewrite import RewrittenStep, rewrite

MAX_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class OpPlannedGraph:
    """A graph of the step whose op-level choice is picked: its id, its op-level planner
    (calibrated on the graph alone) and its current choice (a Solution of
    ``planner.costs``: groups, per-layer options, model peak and recompute cost)."""

    graph_id: str
    planner: OpPlanner
    solution: Solution


@dataclasses.dataclass(frozen=True)
class StepOpPlan:
    """The chosen op-level choices and what they reach.

    Attributes:
        solutions: graph id -> the chain-model Solution chosen.
        partitions: graph id -> its Partition (``OpPlanner.partition``).
        peak_bytes: the composed step peak with them (bytes).
        recompute_cost: the chain models' recompute cost, summed over the graphs (the
            cost model's unit: FLOPs, or the roofline's, see ``op_planner.CostModel``).
        least_feasible: graph id -> the Solution of the least step peak found.
        least_feasible_peak_bytes: that peak (bytes).
        feasible: ``peak_bytes`` is within the budget.
    """

    solutions: dict[str, Solution]
    partitions: dict[str, Partition]
    peak_bytes: int
    recompute_cost: int
    least_feasible: dict[str, Solution]
    least_feasible_peak_bytes: int
    feasible: bool


class _Choices:
    """Partitions, rewrites and composed step peaks of the graphs' Solutions, cached."""

    def __init__(self, graphs: Sequence[OpPlannedGraph], step_peak: Callable[[dict[str, RewrittenStep]], int]):
        self.by_id = {g.graph_id: g for g in graphs}
        self._step_peak = step_peak
        self._partitions: dict[tuple, Partition] = {}
        self._steps: dict[tuple, RewrittenStep] = {}
        self._peaks: dict[tuple, int] = {}

    @staticmethod
    def _key(graph_id: str, sol: Solution) -> tuple:
        return graph_id, sol.groups, sol.options

    def partition(self, graph_id: str, sol: Solution) -> Partition:
        key = self._key(graph_id, sol)
        if key not in self._partitions:
            self._partitions[key] = self.by_id[graph_id].planner.partition(sol)
        return self._partitions[key]

    def peak(self, chosen: dict[str, Solution]) -> int:
        keys = tuple(sorted(self._key(gid, s) for gid, s in chosen.items()))
        if keys not in self._peaks:
            steps = {}
            for gid, sol in chosen.items():
                key = self._key(gid, sol)
                if key not in self._steps:
                    p = self.by_id[gid].planner
                    self._steps[key] = rewrite(p.joint, p.stack, self.partition(gid, sol))
                steps[gid] = self._steps[key]
            self._peaks[keys] = self._step_peak(steps)
        return self._peaks[keys]


def plan_step_op_level(graphs: Sequence[OpPlannedGraph], step_peak: Callable[[dict[str, RewrittenStep]], int],
                       budget_bytes: int, max_rounds: int = MAX_ROUNDS) -> StepOpPlan:
    """The op-level choices of ``graphs`` of least total recompute cost found whose
    composed step peak fits ``budget_bytes`` (see the module docstring).

    Args:
        graphs: the graphs to plan (each with at least one layer), with their current
            choices.
        step_peak: the composed step peak (bytes) when the named graphs run the given
            rewritten steps (the other graphs of the step keep theirs), e.g.
            ``backend_steps.BackendSteps._compose``'s.
        budget_bytes: the step's peak budget (bytes).
        max_rounds: how many times each phase may visit every graph.

    Returns:
        The StepOpPlan; ``feasible`` False when even the least step peak found exceeds
        the budget (``solutions`` are then the least feasible ones). Its recompute cost
        is at most that of the choices given when those fit.
    """
    choices = _Choices(graphs, step_peak)
    chosen = {g.graph_id: g.solution for g in graphs}

    def with_(gid: str) -> Callable[[Solution], int]:
        return lambda s: choices.peak({**chosen, gid: s})

    if choices.peak(chosen) > budget_bytes:
        for _ in range(max_rounds):  # least feasible: each graph to its least step peak
            moved = False
            for g in graphs:
                least = least_feasible_checked(g.planner.costs, with_(g.graph_id))
                if least.predicted_peak_bytes < choices.peak(chosen):
                    chosen[g.graph_id], moved = least.solution, True
            if not moved:
                break
    least, least_peak = dict(chosen), choices.peak(chosen)
    if least_peak <= budget_bytes:
        for _ in range(max_rounds):  # least recompute within the budget, one graph at a time
            moved = False
            for g in graphs:
                current = chosen[g.graph_id]
                start = budget_bytes + current.peak_bytes - choices.peak(chosen)  # what the step leaves it
                found = least_recompute_offset(g.planner.costs, budget_bytes, with_(g.graph_id), start)
                if found is not None and found.recompute_flops < current.recompute_flops:
                    chosen[g.graph_id], moved = found.solution, True
            if not moved:
                break
    peak = choices.peak(chosen)
    return StepOpPlan(
        solutions=dict(chosen), partitions={gid: choices.partition(gid, s) for gid, s in chosen.items()},
        peak_bytes=peak, recompute_cost=sum(s.recompute_flops for s in chosen.values()),
        least_feasible=least, least_feasible_peak_bytes=least_peak, feasible=peak <= budget_bytes)
