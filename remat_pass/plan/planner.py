"""The planner: least recompute under a peak budget, the chain model solved exactly
and every answer checked by liveness, at layer level and at op level.

``ChainPlanner`` is the one skeleton. Its chain model (``solvers.ChainCosts``) has the
whole-layer groups and, at op level, per-layer options (``ChainCosts.stored_options``;
option 0 stores the whole layer); a chain ``Solution`` becomes a decision the step is
rewritten by (``decision``: a Schedule at layer level, a Partition at op level), whose
liveness peak (``predict``) checks it. The answer is solved again with a tighter model
budget while the analysed peak exceeds the budget (``solvers.resolve``), so a returned
plan's predicted peak always fits; a budget below the least feasible peak is an
``InfeasibleBudget`` carrying that peak in bytes.

``Planner`` is the layer level: the skeleton with no options, its chain model
calibrated from the graph's liveness (``chain_calibration.chain_costs``), its decisions
``schedule.optimized`` Schedules. ``op_planner.OpPlanner`` is the op level: the same
skeleton with each layer's exact trade-offs as options.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

from solvers import ChainCosts, CheckedPlan, Solution, least_feasible_checked, least_recompute_checked, model_peak

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

D = TypeVar("D")  # what a chain Solution becomes: a Schedule (layer level) or a Partition (op level)
P = TypeVar("P")  # the plan value a planner returns


def budget_bytes_of(budget: int | str) -> int:
    """``budget`` in bytes (an int, or a size such as ``"2GiB"``).

    Raises:
        InvalidSchedule: the budget is not a size (``nan``, a negative number).
    """
    try:
        return parse_bytes(budget)
    except ValueError as e:
        raise InvalidSchedule(f"budget {budget!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class ChainAnswer(Generic[D]):
    """The skeleton's answer for one budget, before a planner makes it its plan value.

    Attributes:
        budget_bytes: the peak budget asked for.
        checked: the chain-model answer and its liveness peak (``solvers.CheckedPlan``).
        decision: what it becomes (``ChainPlanner.decision``).
        report: the liveness report of that decision.
        least: the least feasible answer (``ChainPlanner.least_feasible_checked``).
        solve_time_s: seconds in the solver and its checks for this budget.
    """

    budget_bytes: int
    checked: CheckedPlan
    decision: D
    report: MemoryReport
    least: CheckedPlan
    solve_time_s: float

    @property
    def predicted_peak_bytes(self) -> int:
        """The liveness peak of the decision (bytes)."""
        return self.report.peak_bytes


class ChainPlanner(Generic[D, P]):
    """The one planner skeleton (see the module docstring): a chain model solved
    exactly, every answer checked by a predictor.

    Args:
        costs: the chain model (with op-level options or without).
        decision: what a chain Solution becomes (a Schedule, a Partition).
        predict: the liveness report of a decision (bytes and FLOPs).

    A subclass makes the answer its plan value (``_plan_value``) and names the cost
    ``plan_many`` compares (``_cost``); the skeleton's own plan value is the
    ``ChainAnswer``, its cost the chain model's recompute.
    """

    def __init__(self, costs: ChainCosts, decision: Callable[[Solution], D],
                 predict: Callable[[D], MemoryReport]):
        self.costs = costs
        self.decision = decision
        self._predict = predict
        self._solution_reports: dict[tuple, MemoryReport] = {}
        self._least: CheckedPlan | None = None
        self.named_groups: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def solution_report(self, sol: Solution) -> MemoryReport:
        """Liveness report of ``sol``'s decision (cached by its groups and options)."""
        key = (sol.groups, sol.options)
        if key not in self._solution_reports:
            self._solution_reports[key] = self._predict(self.decision(sol))
        return self._solution_reports[key]

    def _peak_of(self, sol: Solution) -> int:
        return self.solution_report(sol).peak_bytes

    def least_feasible_checked(self) -> CheckedPlan:
        """The answer of least liveness peak found (``solvers.least_feasible_checked``)."""
        if self._least is None:
            self._least = least_feasible_checked(self.costs, self._peak_of, named=self.named_groups)
        return self._least

    def name_schedules(self, layers_per_stack: Sequence[int], max_layers: int = 32) -> None:
        """Check every answer against the distinct Megatron-LM settings of these stacks
        (``schedule.distinct_megatron_schedules``): the least feasible peak is never above
        one of theirs, and no plan costs more than one that fits its budget. Skipped for
        more than ``max_layers`` layers (each is a liveness analysis)."""
        if sum(layers_per_stack) <= max_layers:
            self.named_groups = tuple(s.groups for s in schedules.distinct_megatron_schedules(tuple(layers_per_stack)))

    def _cheaper_named(self, checked: CheckedPlan, budget_bytes: int) -> CheckedPlan:
        """``checked``, or the cheapest named schedule (``name_schedules``) of lower chain
        recompute whose liveness peak fits ``budget_bytes``."""
        named = sorted((model_peak(self.costs, g) for g in self.named_groups), key=lambda s: s.recompute_flops)
        for sol in named:
            if sol.recompute_flops >= checked.recompute_flops:
                break
            peak = self._peak_of(sol)
            if peak <= budget_bytes:
                return CheckedPlan(sol.groups, sol.peak_bytes, peak, sol.recompute_flops, checked.resolves)
        return checked

    def answer(self, budget: int | str, max_resolves: int = 20) -> ChainAnswer[D]:
        """The least-recompute answer whose liveness peak is <= ``budget``
        (``solvers.least_recompute_checked``).

        Args:
            budget: peak activation bytes (an int, or a size such as ``"2GiB"``).
            max_resolves: how often the model budget may be tightened.

        Raises:
            InfeasibleBudget: the budget is below the least feasible peak (carried in
                bytes by the error).
            InvalidSchedule: the budget is not a size (``nan``, a negative number).
        """
        budget_bytes = budget_bytes_of(budget)
        least = self.least_feasible_checked()
        t0 = time.perf_counter()
        checked = least_recompute_checked(self.costs, budget_bytes, self._peak_of, least, max_resolves)
        checked = self._cheaper_named(checked, budget_bytes)
        solve_s = time.perf_counter() - t0
        return ChainAnswer(budget_bytes, checked, self.decision(checked.solution),
                           self.solution_report(checked.solution), least, solve_s)

    def plan(self, budget: int | str, max_resolves: int = 20) -> P:
        """The plan value of ``answer(budget, max_resolves)`` (same errors)."""
        return self._plan_value(self.answer(budget, max_resolves))

    def _plan_value(self, answer: ChainAnswer[D]) -> P:
        return answer  # type: ignore[return-value]

    def _cost(self, plan: P) -> int:
        return plan.checked.recompute_flops  # type: ignore[attr-defined]

    def plan_many(self, budgets: Sequence[int | str]) -> list[P]:
        """``plan`` for each budget, served from the largest down: when the plan chosen
        for a larger budget still fits a smaller one and costs no more (``_cost``), it
        is kept, so the predicted peak never rises as the budget falls.

        Raises:
            ValueError: a budget is not a size.
            InfeasibleBudget: as ``plan``.
        """
        sizes = [parse_bytes(b) for b in budgets]
        out: dict[int, P] = {}
        prev: P | None = None
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            p = self.plan(sizes[i])
            if prev is not None and prev.predicted_peak_bytes <= sizes[i] and (  # type: ignore[attr-defined]
                self._cost(prev) <= self._cost(p)
                and (self._cost(prev) < self._cost(p)
                     or prev.predicted_peak_bytes < p.predicted_peak_bytes)  # type: ignore[attr-defined]
            ):
                p = dataclasses.replace(prev, budget_bytes=sizes[i], solve_time_s=p.solve_time_s)  # type: ignore
            out[i] = p
            prev = p
        return [out[i] for i in range(len(sizes))]


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


class Planner(ChainPlanner[Schedule, Plan]):
    """The layer level: optimized schedules of one traced step, checked with liveness
    (the skeleton with no op-level options; its decisions are ``schedule.optimized``).

    Budgets are served from largest to smallest consistently (``plan_many``): a
    schedule that fits a budget is kept for smaller budgets it still fits, so the
    predicted peak never rises as the budget falls (compared by the liveness
    recompute FLOPs of the rewritten step).

    Args:
        joint, stack: the traced step (concrete shapes) and its layer stack.
        predict: ``predict(schedule) -> MemoryReport`` of the rewritten step (e.g.
            ``sweep.Session.report``).
        model: the model the chain costs are calibrated from (default:
            ``SymbolicModel.from_joint(joint, stack)``; ``layer_reuse.ReusedLayersModel``
            for a stack analysed from a template). Its ``num_layers`` is the L planned for.

    Attributes:
        costs: the chain model; calibrate_s: seconds calibrating it.
        unconstrained_peak_bytes: liveness peak of ``none``.
    """

    def __init__(self, joint: JointGraph, stack: LayerStack, predict: Callable[[Schedule], MemoryReport],
                 model: SymbolicModel | None = None):
        self.joint, self.stack = joint, stack
        self.model = model if model is not None else SymbolicModel.from_joint(joint, stack)
        self.num_layers = self.model.num_layers
        t0 = time.perf_counter()
        costs = chain_costs(self.model)
        self.calibrate_s = time.perf_counter() - t0
        self._schedule_predict = predict
        self._reports: dict[Schedule, MemoryReport] = {}
        super().__init__(costs, self._schedule, self.report)
        self.name_schedules(self.model.layers_per_stack)
        self.unconstrained_peak_bytes = self.report(schedules.none(self.model.layers_per_stack)).peak_bytes

    def report(self, schedule: Schedule) -> MemoryReport:
        """Liveness report of ``schedule`` (cached)."""
        if schedule not in self._reports:
            self._reports[schedule] = self._schedule_predict(schedule)
        return self._reports[schedule]

    def _schedule(self, sol: Solution) -> Schedule:
        return schedules.optimized(sol.groups, self.model.layers_per_stack)

    def least_feasible(self) -> tuple[Schedule, int]:
        """The schedule of least liveness peak the solver finds, and that peak (bytes)."""
        least = self.least_feasible_checked()
        return self._schedule(least.solution), least.predicted_peak_bytes

    def _plan_value(self, answer: ChainAnswer[Schedule]) -> Plan:
        rep = answer.report
        return Plan(
            budget_bytes=answer.budget_bytes,
            schedule=answer.decision,
            model_peak_bytes=int(answer.checked.model_peak_bytes),
            predicted_peak_bytes=rep.peak_bytes,
            recompute_flops=rep.recompute_flops,
            forward_flops=rep.forward_flops,
            least_feasible_peak_bytes=answer.least.predicted_peak_bytes,
            unconstrained_peak_bytes=self.unconstrained_peak_bytes,
            solve_time_s=answer.solve_time_s,
            resolves=answer.checked.resolves,
            peak_scratch=rep.peak_scratch,
            peak_could_move_bytes=rep.peak_could_move_bytes,
            threads=rep.threads,
        )

    def _cost(self, plan: Plan) -> int:
        return plan.recompute_flops


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
