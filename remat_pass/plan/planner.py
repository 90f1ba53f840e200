"""The optimized schedule: least recompute under a peak budget, checked by liveness.

The chain model (``solvers.chain``) is calibrated from the graph's liveness
(``chain_calibration.chain_costs``) and solved exactly; every answer is rewritten
and analysed (``liveness.analyze``), and the solve is repeated with a tighter model
budget while the analysed peak exceeds the budget (``solvers.resolve``). So the returned
schedule's predicted peak always fits; a budget below the least feasible peak is an
``InfeasibleBudget`` carrying that peak in bytes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from solvers import CheckedPlan, Solution, least_feasible_checked, least_recompute_checked

from ..recompute import schedule as schedules
from ..errors import InvalidSchedule
from ..formatting import parse_bytes
from ..liveness.timeline import MemoryReport
from ..memory.memory_model import NodeMemory
from ..graph.regions import LayerStack
from ..recompute.schedule import Schedule
from ..liveness.symbolic import SymbolicModel
from .chain_calibration import chain_costs
from ..graph.trace import JointGraph


@dataclasses.dataclass(frozen=True)
class Plan:
    """The optimized schedule for one peak budget, predicted and checked.

    Attributes:
        budget_bytes: the peak budget asked for.
        schedule: the chosen Schedule (``schedule.optimized``).
        model_peak_bytes: the chain model's peak of that schedule.
        predicted_peak_bytes: liveness (``analyze``) peak of the rewritten step.
        recompute_flops, forward_flops: liveness FLOPs of that step.
        least_feasible_peak_bytes: least liveness peak the solver can reach.
        unconstrained_peak_bytes: liveness peak of ``none``.
        solve_time_s: seconds in the solver (all re-solves included).
        resolves: how many times the budget was tightened because the liveness peak
            of the model's answer exceeded it.
        peak_scratch: the op at the predicted peak and its scratch (bytes, source).
        peak_could_move_bytes: 0 when that op's scratch is calibrated; else how far the
            peak could move (``MemoryReport.peak_could_move_bytes``).
        threads: the intra-op thread count of the prediction.
    """

    budget_bytes: int
    schedule: Schedule
    model_peak_bytes: int
    predicted_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    least_feasible_peak_bytes: int
    unconstrained_peak_bytes: int
    solve_time_s: float
    resolves: int
    peak_scratch: NodeMemory | None = None
    peak_could_move_bytes: int = 0
    threads: int = 1

    @property
    def recompute_fraction(self) -> float:
        """Recompute FLOPs / forward FLOPs."""
        return schedules.recompute_fraction(self.recompute_flops, self.forward_flops)

    def describe(self) -> str:
        """Groups and stored layers, e.g. ``recompute [0-3] [4-5], store 6 7``."""
        return schedules.describe_groups(self.schedule.groups, self.schedule.num_layers)


class Planner:
    """Solves for optimized schedules of one traced step and checks them with liveness.

    Budgets are served from largest to smallest consistently (``plan_many``): a
    schedule that fits a budget is kept for smaller budgets it still fits, so the
    predicted peak never rises as the budget falls.

    Args:
        joint, stack: the traced step (concrete shapes) and its layer stack.
        predict: ``predict(schedule) -> MemoryReport`` of the rewritten step (e.g.
            ``sweep.Session.report``).
        model: the model the chain costs are calibrated from (default:
            ``SymbolicModel.from_joint(joint, stack)``; ``layer_reuse.ReusedLayersModel``
            for a stack analysed from a template). Its ``num_layers`` is the L planned for.
    """

    def __init__(self, joint: JointGraph, stack: LayerStack, predict: Callable[[Schedule], MemoryReport],
                 model: SymbolicModel | None = None):
        self.joint, self.stack = joint, stack
        self._predict = predict
        self.model = model if model is not None else SymbolicModel.from_joint(joint, stack)
        self.num_layers = self.model.num_layers
        t0 = time.perf_counter()
        self.costs = chain_costs(self.model)
        self.calibrate_s = time.perf_counter() - t0
        self._reports: dict[Schedule, MemoryReport] = {}
        self.unconstrained_peak_bytes = self.report(schedules.none(self.model.layers_per_stack)).peak_bytes
        self._least: CheckedPlan | None = None

    def report(self, schedule: Schedule) -> MemoryReport:
        """Liveness report of ``schedule`` (cached)."""
        if schedule not in self._reports:
            self._reports[schedule] = self._predict(schedule)
        return self._reports[schedule]

    def _peak_of(self, sol: Solution) -> int:
        return self.report(self._schedule(sol.groups)).peak_bytes

    def _schedule(self, groups: tuple) -> Schedule:
        return schedules.optimized(groups, self.model.layers_per_stack)

    def least_feasible(self) -> tuple[Schedule, int]:
        """The schedule of least liveness peak the solver finds, and that peak (bytes)."""
        if self._least is None:
            self._least = least_feasible_checked(self.costs, self._peak_of)
        return self._schedule(self._least.groups), self._least.predicted_peak_bytes

    def plan(self, budget: int | str, max_resolves: int = 20) -> Plan:
        """The least-recompute schedule whose liveness peak is <= ``budget``.

        Args:
            budget: peak activation bytes (an int, or a size such as ``"2GiB"``).

        Raises:
            InfeasibleBudget: the budget is below the least feasible peak (carried in
                bytes by the error).
            InvalidSchedule: the budget is not a size (``nan``, a negative number).
        """
        try:
            budget_bytes = parse_bytes(budget)
        except ValueError as e:
            raise InvalidSchedule(f"budget {budget!r}: {e}") from e
        self.least_feasible()
        assert self._least is not None
        t0 = time.perf_counter()
        checked = least_recompute_checked(self.costs, budget_bytes, self._peak_of, self._least, max_resolves)
        solve_s = time.perf_counter() - t0
        chosen = self._schedule(checked.groups)
        rep = self.report(chosen)
        return Plan(
            budget_bytes=budget_bytes,
            schedule=chosen,
            model_peak_bytes=int(checked.model_peak_bytes),
            predicted_peak_bytes=rep.peak_bytes,
            recompute_flops=rep.recompute_flops,
            forward_flops=rep.forward_flops,
            least_feasible_peak_bytes=self._least.predicted_peak_bytes,
            unconstrained_peak_bytes=self.unconstrained_peak_bytes,
            solve_time_s=solve_s,
            resolves=checked.resolves,
            peak_scratch=rep.peak_scratch,
            peak_could_move_bytes=rep.peak_could_move_bytes,
            threads=rep.threads,
        )

    def plan_many(self, budgets: Sequence[int | str]) -> list[Plan]:
        """``plan`` for each budget, served from the largest down: when the schedule
        chosen for a larger budget still fits a smaller one and costs no more recompute,
        it is kept, so the predicted peak never rises as the budget falls."""
        sizes = [parse_bytes(b) for b in budgets]
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        out: dict[int, Plan] = {}
        prev: Plan | None = None
        for i in order:
            p = self.plan(sizes[i])
            if prev is not None and prev.predicted_peak_bytes <= sizes[i] and (
                prev.recompute_flops <= p.recompute_flops
                and (prev.recompute_flops < p.recompute_flops or prev.predicted_peak_bytes < p.predicted_peak_bytes)
            ):
                p = dataclasses.replace(prev, budget_bytes=sizes[i], solve_time_s=p.solve_time_s)
            out[i] = p
            prev = p
        return [out[i] for i in range(len(sizes))]


def max_batch_rows(sm: SymbolicModel, budget_bytes: int, symbol: str = "batch",
                   schedule_list: Sequence[Schedule] | None = None) -> list[dict[str, Any]]:
    """Largest ``symbol`` value that fits ``budget_bytes`` per schedule (others at their
    traced values): rows with the schedule, the largest value, and the exact peak there
    and at the next value (bytes)."""
    fixed = {k: v for k, v in sm.hints.items() if k != symbol}
    rows = []
    for sch in schedule_list or schedules.megatron_schedules(sm.stack.layers_per_stack):
        best = sm.largest_fitting(sch, budget_bytes, symbol, **fixed)
        rows.append({
            "schedule": sch.provenance,
            symbol: best,
            "peak_bytes": sm.peak_at(sch, **fixed, **{symbol: best}) if best else None,
            "next_peak_bytes": sm.peak_at(sch, **fixed, **{symbol: best + 1}),
        })
    return rows
