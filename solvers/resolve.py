"""Plans checked against an exact predictor: the chain model proposes, ``predict``
disposes.

The chain model (``solvers.chain``) is calibrated from a few schedules and can be off
for others; the exact peak comes from liveness analysis of the rewritten step, which
only the caller can compute. Given ``predict(solution) -> peak bytes`` (a chain-model
``Solution``: its groups and, with op-level options, each layer's option), these functions
return schedules whose *predicted* peak (not the model's) fits the budget: when the
model's answer overshoots, the model budget is lowered by the excess and the solve is
repeated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from .chain import ChainCosts, Solution, model_peak
from .chain_search import least_feasible_peak, least_peak, least_recompute
from .errors import InfeasibleBudget, infeasible

Groups = tuple[tuple[int, ...], ...]
Predict = Callable[[Solution], int]


@dataclasses.dataclass(frozen=True)
class CheckedPlan:
    """A schedule chosen by the chain model and checked by ``predict``.

    Attributes:
        groups: the recomputed groups (others stored).
        model_peak_bytes: the chain model's peak of ``groups``.
        predicted_peak_bytes: ``predict(groups)``.
        recompute_flops: the chain model's recompute FLOPs of ``groups``.
        resolves: how many times the model budget was lowered because ``predict``
            exceeded the budget.
        options: each layer's op-level option (``Solution.options``; empty: none).
    """

    groups: Groups
    model_peak_bytes: int
    predicted_peak_bytes: int
    recompute_flops: int
    resolves: int
    options: tuple[int, ...] = ()

    @property
    def solution(self) -> Solution:
        """The chain-model Solution it checked."""
        return Solution(self.groups, self.model_peak_bytes, self.recompute_flops, self.options)


def least_feasible_checked(costs: ChainCosts, predict: Predict, front_candidates: int = 3,
                           max_front_layers: int = 16, named: Sequence[Groups] = ()) -> CheckedPlan:
    """The schedule of least *predicted* peak among the chain model's lowest-peak answers
    and the schedules the caller names.

    The model's least-peak schedule and, for stacks of at most ``max_front_layers``
    layers, the ``front_candidates`` lowest-peak schedules of its Pareto front (found from
    the bottom, each the least peak under a recompute just below the previous one's:
    ``least_peak``, a bounded number of solves, never the whole front) are predicted,
    and so is recomputing nothing (the chain model can be wrong on which side of it a
    schedule falls: on tiny layers, recompute can cost more bytes than it saves) and
    every schedule in ``named`` (groups: the Megatron settings), so the least is never
    above a schedule the product can name; the lowest prediction wins (ties: the first,
    i.e. the model's choice).
    """
    candidates = [least_feasible_peak(costs)]
    if costs.num_layers <= max_front_layers:
        candidates += lowest_front(costs, candidates[0], front_candidates)
    candidates.append(model_peak(costs, ()))
    candidates += [model_peak(costs, groups) for groups in named]
    best: CheckedPlan | None = None
    for sol in candidates:
        peak = predict(sol)
        if best is None or peak < best.predicted_peak_bytes:
            best = CheckedPlan(sol.groups, sol.peak_bytes, peak, sol.recompute_flops, 0, sol.options)
    assert best is not None
    return best


def lowest_front(costs: ChainCosts, least: Solution, n: int) -> list[Solution]:
    """The ``n`` Pareto-front points just above ``least`` (``least_feasible_peak``), peak
    rising and recompute falling: each the least peak under a recompute one below the
    previous one's (``least_peak``), so a bounded number of solves."""
    out: list[Solution] = []
    last = least
    while len(out) < n and last.recompute_flops > 0:
        last = least_peak(costs, last.recompute_flops - 1)
        out.append(last)
    return out


def least_recompute_checked(costs: ChainCosts, budget_bytes: int, predict: Predict,
                            least: CheckedPlan, max_resolves: int = 20) -> CheckedPlan:
    """The least-recompute schedule whose predicted peak is <= ``budget_bytes``.

    Args:
        costs: the chain model.
        budget_bytes: the peak budget (bytes).
        predict: exact peak of a schedule (bytes).
        least: ``least_feasible_checked(costs, predict)`` (the fallback, and the bound
            below which the budget is infeasible).
        max_resolves: how often the model budget may be lowered before falling back to
            ``least``.

    Raises:
        InfeasibleBudget: ``budget_bytes`` is below ``least.predicted_peak_bytes``.
    """
    if budget_bytes < least.predicted_peak_bytes:
        raise infeasible(budget_bytes, least.predicted_peak_bytes)
    model_budget = budget_bytes
    resolves = 0
    for resolves in range(max_resolves + 1):
        try:
            sol = least_recompute(costs, model_budget)
        except InfeasibleBudget:
            break
        peak = predict(sol)
        if peak <= budget_bytes:
            return CheckedPlan(sol.groups, sol.peak_bytes, peak, sol.recompute_flops, resolves, sol.options)
        model_budget -= max(peak - budget_bytes, 1)
    # the model's answers kept overshooting: the least feasible schedule fits
    sol = model_peak(costs, least.groups, least.options)
    return CheckedPlan(least.groups, sol.peak_bytes, least.predicted_peak_bytes, sol.recompute_flops,
                       resolves, least.options)


class _Checked:
    """The answers of ``least_recompute_offset``'s search, each predicted once: the
    cheapest (least recompute) that fits ``budget_bytes``."""

    def __init__(self, budget_bytes: int, predict: Predict):
        self.budget_bytes, self.predict = budget_bytes, predict
        self.peaks: dict[tuple, int] = {}
        self.best: CheckedPlan | None = None

    def peak_of(self, sol: Solution) -> int:
        """``predict(sol)``, computed once per schedule."""
        key = (sol.groups, sol.options)
        if key not in self.peaks:
            self.peaks[key] = self.predict(sol)
        return self.peaks[key]

    def fits(self, sol: Solution, solves: int) -> bool:
        """Whether ``sol``'s predicted peak fits; the cheapest that fits becomes ``best``
        (``solves``: the chain solves taken to find it)."""
        peak = self.peak_of(sol)
        if peak > self.budget_bytes:
            return False
        if self.best is None or sol.recompute_flops < self.best.recompute_flops:
            self.best = CheckedPlan(sol.groups, sol.peak_bytes, peak, sol.recompute_flops, solves, sol.options)
        return True


def least_recompute_offset(costs: ChainCosts, budget_bytes: int, predict: Predict,
                           start_model_budget: int | None = None, max_solves: int = 64) -> CheckedPlan | None:
    """The least-recompute schedule whose predicted peak is <= ``budget_bytes``, when the
    predictor and the chain model differ by an offset that is unknown (and need not be
    positive): a graph that is one of several of a step, whose chain model is
    calibrated on the graph alone while ``predict`` is the composed step's peak.

    ``least_recompute_checked`` only ever lowers the model budget, so when the model
    over-states the predicted peak it recomputes more than needed. Here the model
    budget ``m`` is searched both ways. The model's answer at ``m`` costs no more as
    ``m`` rises, so:

    1. Recomputing nothing is tried first (the cheapest schedule).
    2. From ``start_model_budget`` (the caller's estimate of ``budget_bytes`` plus the
       offset; default ``budget_bytes``; raised to the model's least peak when below
       it), the model budget is lowered by the excess while the answer's predicted peak
       overshoots: the first ``m`` found whose answer fits.
    3. Bisection between that ``m`` and the lowest model budget seen to overshoot,
       predicting only answers cheaper than the best that fits.

    Every answer returned is checked by ``predict``; it is the optimum of the model's
    Pareto front when the predicted peak does not rise along the front as the model
    peak falls (then exactly ``least_recompute(costs, budget_bytes + offset)`` for a
    constant offset).

    Args:
        costs: the chain model.
        budget_bytes: the peak budget (bytes) on ``predict``'s scale.
        predict: the exact peak of a chain-model Solution (bytes).
        start_model_budget: the model budget to start from (bytes).
        max_solves: how many chain solves the search may take.

    Returns:
        The CheckedPlan (``resolves``: the chain solves taken), or None when no answer
        found fits (the caller keeps what it has).
    """
    top = model_peak(costs, ())
    checked = _Checked(budget_bytes, predict)
    if checked.fits(top, 0):
        return checked.best
    over = top.peak_bytes  # a model budget whose answer overshoots
    m = min(budget_bytes if start_model_budget is None else start_model_budget, over - 1)
    fit_at: int | None = None
    solves, least_tried = 0, False
    while solves < max_solves:
        solves += 1
        try:
            sol = least_recompute(costs, m)
        except InfeasibleBudget as e:  # below the model's least peak: start there, once
            if m >= e.least_feasible_peak_bytes or least_tried:
                return None
            m, least_tried = e.least_feasible_peak_bytes, True
            continue
        if checked.fits(sol, solves):
            fit_at = m
            break
        over = min(over, m)
        m -= max(checked.peak_of(sol) - budget_bytes, 1)
    if fit_at is None:
        return None
    while over - fit_at > 1 and solves < max_solves:
        solves += 1
        mid = (fit_at + over) // 2
        sol = least_recompute(costs, mid)
        assert checked.best is not None
        if sol.recompute_flops >= checked.best.recompute_flops or checked.fits(sol, solves):
            fit_at = mid  # nothing cheaper fits at or below mid
        else:
            over = mid
    return checked.best

