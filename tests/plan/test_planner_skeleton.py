"""The one planner skeleton (``planner.ChainPlanner``) and the one step planner
(``step_planning.plan_step``) on plain chain costs and toy graphs (no tracing): the
answer of a budget is the checked least-recompute one, layer level is op level with no
options, budgets served together never raise the peak, and the step's coordinate
descent reaches the cheapest choices that fit."""

from __future__ import annotations

import dataclasses
import types

import pytest

from chain_cases import random_costs
from solvers import least_feasible_checked, least_recompute_checked, model_peak
from remat_pass.errors import InfeasibleBudget, InvalidSchedule
from remat_pass.plan.planner import ChainPlanner
from remat_pass.plan.step_planning import plan_step


def _planner(costs, offset: int = 0) -> ChainPlanner:
    """A skeleton whose decision is the (groups, options) pair and whose predictor is
    the chain model's peak plus ``offset`` bytes (a model that under-states by it)."""
    def predict(decision):
        return types.SimpleNamespace(peak_bytes=model_peak(costs, *decision).peak_bytes + offset)

    return ChainPlanner(costs, lambda sol: (sol.groups, sol.options), predict)


@pytest.mark.parametrize("options", [0, 2])
def test_answer_is_the_checked_least_recompute(options):
    costs = random_costs(6, seed=3, options=options)
    planner = _planner(costs, offset=7)
    least = planner.least_feasible_checked()
    peak = lambda sol: model_peak(costs, sol.groups, sol.options).peak_bytes + 7  # noqa: E731
    assert least == least_feasible_checked(costs, peak)
    top = model_peak(costs, ()).peak_bytes + 7
    for budget in (least.predicted_peak_bytes, (least.predicted_peak_bytes + top) // 2, top):
        a = planner.plan(budget)
        assert a.checked == least_recompute_checked(costs, budget, peak, least)
        assert a.predicted_peak_bytes <= budget and a.decision == (a.checked.groups, a.checked.options)
        if not options:  # layer level: the chain model has no options, no answer takes one
            assert not any(a.checked.options)
    with pytest.raises(InfeasibleBudget) as e:
        planner.plan(least.predicted_peak_bytes - 1)
    assert e.value.least_feasible_peak_bytes == least.predicted_peak_bytes
    with pytest.raises(InvalidSchedule):
        planner.plan("nan")


def test_plan_many_never_raises_the_peak_as_the_budget_falls():
    costs = random_costs(7, seed=11, options=2)
    planner = _planner(costs)
    least = planner.least_feasible_checked().predicted_peak_bytes
    top = model_peak(costs, ()).peak_bytes
    budgets = [least + (top - least) * k // 6 for k in range(7)]
    plans = planner.plan_many(budgets)
    assert [p.budget_bytes for p in plans] == budgets
    assert all(p.predicted_peak_bytes <= b for p, b in zip(plans, budgets))
    peaks = [p.predicted_peak_bytes for p in plans]
    assert peaks == sorted(peaks)
    costs_ = [p.checked.recompute_flops for p in plans]
    assert costs_ == sorted(costs_, reverse=True)
    assert plans[-1].checked.recompute_flops == 0


@dataclasses.dataclass(frozen=True)
class ToyGraph:
    """A graph of a toy step: choice k holds ``peaks[k]`` bytes at the step's peak and
    recomputes ``cost[k]``; the step's peak is the sum over its graphs."""

    graph_id: str
    current: int
    peaks: tuple[int, ...]
    cost: tuple[int, ...]
    start_from_least: bool = False
    calls: list = dataclasses.field(default_factory=list, compare=False)

    def key(self, c):
        return c

    def decision(self, c):
        return f"{self.graph_id}:{c}"

    def rewritten(self, c):
        return c

    def least_candidates(self, peak_with):
        self.calls.append("least")
        return [min(range(len(self.peaks)), key=lambda c: peak_with(c))]

    def cheaper(self, budget, peak_with, current, step_peak):
        fits = [c for c in range(len(self.peaks)) if peak_with(c) <= budget and self.cost[c] < self.cost[current]]
        return min(fits, key=lambda c: self.cost[c]) if fits else None


def _step_peak(graphs):
    by_id = {g.graph_id: g for g in graphs}
    return lambda steps: sum(by_id[gid].peaks[c] for gid, c in steps.items())


def test_step_descent_reaches_the_cheapest_choices_that_fit():
    a = ToyGraph("a", 0, peaks=(50, 40, 30), cost=(0, 5, 9))
    b = ToyGraph("b", 0, peaks=(60, 35, 20), cost=(0, 2, 8))
    graphs = [a, b]
    over = plan_step(graphs, _step_peak(graphs), 49)
    assert not over.feasible and over.choices == {"a": 2, "b": 2} and over.least_feasible_peak_bytes == 50
    plan = plan_step(graphs, _step_peak(graphs), 80)
    # from the least feasible (2, 2), a moves to the cheapest that fits, then b
    assert plan.feasible and plan.peak_bytes <= 80 and plan.least_feasible == {"a": 2, "b": 2}
    assert plan.choices == {"a": 0, "b": 2} and plan.decisions == {"a": "a:0", "b": "b:2"}


def test_choices_that_fit_are_kept_unless_the_granularity_starts_from_the_least():
    for start_from_least in (False, True):
        g = ToyGraph("g", 0, peaks=(50, 30), cost=(0, 4), start_from_least=start_from_least)
        plan = plan_step([g], _step_peak([g]), 60)
        assert plan.feasible and plan.choices == {"g": 0}
        assert ("least" in g.calls) == start_from_least


def test_named_schedules_bound_the_least_and_the_cost():
    """Where the chain model over-states one Megatron setting (its predictor says
    uniform(K=1) peaks lowest of all), the least feasible peak is that setting's, and a
    budget it fits is never planned costlier than it."""
    from remat_pass.recompute.schedule import uniform

    costs = random_costs(6, seed=5)
    u1 = uniform(1, 6).groups
    model_least = model_peak(costs, least_feasible_checked(costs, lambda s: model_peak(costs, s.groups).peak_bytes)
                             .groups).peak_bytes

    def predict(decision):
        peak = model_peak(costs, *decision).peak_bytes
        return types.SimpleNamespace(peak_bytes=model_least - 5 if decision[0] == u1 else peak)

    planner = ChainPlanner(costs, lambda sol: (sol.groups, sol.options), predict)
    planner.name_schedules((6,))
    least = planner.least_feasible_checked()
    assert least.groups == u1 and least.predicted_peak_bytes == model_least - 5
    answer = planner.plan(model_least - 5)
    assert answer.checked.groups == u1 and answer.predicted_peak_bytes <= model_least - 5
    # a budget where the model's own answer fits: never costlier than uniform(K=1)
    top = model_peak(costs, ()).peak_bytes
    for budget in (model_least, (model_least + top) // 2):
        a = planner.plan(budget)
        assert a.checked.recompute_flops <= model_peak(costs, u1).recompute_flops
        assert a.predicted_peak_bytes <= budget
