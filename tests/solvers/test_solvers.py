"""Solvers: the chain dynamic program against brute force (no torch), and the planner
on real graphs: model peak == liveness peak, budgets bound the measured peak, the
optimized schedule beats uniform/block, and the peak never rises as the budget falls
(case C2)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import chain_oracle
from chain_cases import all_groupings, random_costs
from remat_pass.errors import InfeasibleBudget, RematError
from solvers import (
    ChainCosts,
    least_feasible_checked,
    least_feasible_peak,
    least_peak,
    least_recompute,
    least_recompute_checked,
    least_recompute_offset,
    model_peak,
    pareto_front,
)
from solvers.chain import StackGap
from solvers.oplevel import (External, LayerGraph, SolveLimits, Unit, Value, brute_force_front, evaluate, layer_front,
                             quiet_stdout, solve_layer_front)


def every_schedule(c: ChainCosts) -> list:
    """model_peak of every schedule: each grouping, and each option of each stored layer."""
    out = []
    for groups in all_groupings(c.num_layers):
        inside = {i for g in groups for i in g}
        choices = [range(len(c.options(i))) if i not in inside else [0] for i in range(c.num_layers)]
        for combo in itertools.product(*choices):
            out.append(model_peak(c, groups, combo))
    return out


@pytest.mark.parametrize("L,seed,options", [(1, 0, 0), (3, 1, 0), (4, 2, 0), (5, 3, 0), (6, 4, 0),
                                            (3, 5, 2), (4, 6, 1), (5, 7, 2)])
def test_dynamic_program_is_exact(L, seed, options):
    c = random_costs(L, seed, options)
    every = every_schedule(c)
    least = min(s.peak_bytes for s in every)
    most = max(s.peak_bytes for s in every)
    for budget in sorted({least, (least + most) // 2, most, least + 7}):
        fit = [s for s in every if s.peak_bytes <= budget]
        best = min(s.recompute_flops for s in fit)
        sol = least_recompute(c, budget)
        assert sol.recompute_flops == best
        assert sol.peak_bytes <= budget
        assert model_peak(c, sol.groups, sol.options) == sol
    with pytest.raises(InfeasibleBudget) as e:
        least_recompute(c, least - 1)
    assert e.value.least_feasible_peak_bytes == least
    # the dual
    for f in sorted({0, max(s.recompute_flops for s in every) // 2}):
        want = min(s.peak_bytes for s in every if s.recompute_flops <= f)
        assert least_peak(c, f).peak_bytes == want
    # the Pareto front: no schedule is strictly better on both
    for p in pareto_front(c):
        assert not any(s.peak_bytes < p.peak_bytes and s.recompute_flops < p.recompute_flops for s in every)



@pytest.mark.parametrize("L,starts,seed,options", [(4, (2,), 31, 0), (5, (2, 4), 32, 1), (6, (3,), 33, 2),
                                                   (6, (1, 3), 34, 0)])
def test_dynamic_program_is_exact_over_stacks_with_gaps(L, starts, seed, options):
    """Several stacks with the outer steps between them (``StackGap``, large enough to
    bind): the least recompute at each budget and the least feasible peak equal brute
    force over every schedule whose groups stay inside a stack."""
    r = random.Random(seed)
    gaps = tuple(StackGap(r.randint(0, 300), r.randint(0, 300), r.randint(100, 600), r.randint(0, 400))
                 for _ in starts)
    c = dataclasses.replace(random_costs(L, seed, options), stack_starts=starts, stack_gaps=gaps)
    every = []
    for groups in all_groupings(L):
        if any(b in g[1:] for g in groups for b in starts):
            continue
        inside = {i for g in groups for i in g}
        choices = [range(len(c.options(i))) if i not in inside else [0] for i in range(L)]
        every += [model_peak(c, groups, combo) for combo in itertools.product(*choices)]
    least = min(s.peak_bytes for s in every)
    assert least_feasible_peak(c).peak_bytes == least
    with_gaps_binding = dataclasses.replace(c, stack_gaps=())
    assert any(model_peak(with_gaps_binding, s.groups, s.options).peak_bytes < s.peak_bytes for s in every)
    for budget in sorted({least, least + 11, (least + max(s.peak_bytes for s in every)) // 2}):
        sol = least_recompute(c, budget)
        assert sol.recompute_flops == min(s.recompute_flops for s in every if s.peak_bytes <= budget)
        assert model_peak(c, sol.groups, sol.options) == sol


@pytest.mark.parametrize("L,seed,options,offset", [(4, 21, 0, 37), (5, 22, 1, -23), (5, 23, 2, 0), (6, 24, 0, 150)])
def test_offset_search_matches_brute_force(L, seed, options, offset):
    """A predictor that is the model's peak minus an offset the search is not told (a
    graph's chain model against the composed step's peak): at every budget across the
    range, from a start that guesses the offset wrong both ways, the search finds the
    least recompute of all schedules whose *predicted* peak fits (brute force), and its
    answer fits; below every predicted peak it finds nothing."""
    c = random_costs(L, seed, options)
    every = every_schedule(c)
    predicted = [s.peak_bytes - offset for s in every]
    calls = []

    def predict(sol):
        calls.append(sol)
        return model_peak(c, sol.groups, sol.options).peak_bytes - offset

    lo, hi = min(predicted), max(predicted)
    for budget in sorted({lo, lo + 5, (lo + hi) // 2, hi - 1, hi}):
        best = min(s.recompute_flops for s, p in zip(every, predicted) if p <= budget)
        for start in (budget, budget + 2 * abs(offset) + 40, budget - 60):
            found = least_recompute_offset(c, budget, predict, start)
            assert found is not None and found.recompute_flops == best, (budget, start)
            assert found.predicted_peak_bytes <= budget
            assert found.predicted_peak_bytes == model_peak(c, found.groups, found.options).peak_bytes - offset
    assert least_recompute_offset(c, lo - 1, predict) is None


def test_least_feasible_checked_considers_recomputing_nothing():
    """When the exact predictor says every recompute schedule peaks above recomputing
    nothing (found by the property tests on a 4-layer stack of tiny layers), the least
    feasible plan is to recompute nothing, so a budget at that peak is feasible."""
    c = random_costs(4, 5)
    plain = model_peak(c, ()).peak_bytes

    def predict(sol):  # recompute costs 100 bytes per group
        return plain + 100 * len(sol.groups)

    least = least_feasible_checked(c, predict)
    assert least.groups == () and least.predicted_peak_bytes == plain
    assert least_recompute_checked(c, plain, predict, least).groups == ()


@pytest.mark.parametrize("L,seed", [(10, 11), (16, 12), (24, 13)])
def test_pruned_dynamic_program_matches_the_unpruned_one(L, seed):
    """Longer random chains against the dynamic program without bounds (the old one):
    the same least recompute at budgets across the range, the same least peak."""
    c = random_costs(L, seed)
    least = least_feasible_peak(c)
    assert least.peak_bytes == chain_oracle.least_peak_bytes(c)
    assert least_recompute(c, least.peak_bytes).recompute_flops == least.recompute_flops
    top = model_peak(c, ()).peak_bytes
    for budget in sorted({least.peak_bytes + (top - least.peak_bytes) * k // 6 for k in range(7)}):
        sol, old = least_recompute(c, budget), chain_oracle.least_recompute(c, budget)
        assert sol.recompute_flops == old.recompute_flops, budget
        assert model_peak(c, sol.groups) == sol and sol.peak_bytes <= budget


def test_huge_figures_stay_exact():
    """Figures past int64 (scaled by 2**62) give the same schedules, scaled."""
    small, huge = random_costs(7, 21, options=1), random_costs(7, 21, options=1, scale=2**62)
    for budget in (1200, 1500, 2000):
        a, b = least_recompute(small, budget), least_recompute(huge, budget * 2**62)
        assert (b.groups, b.options, b.peak_bytes, b.recompute_flops) == (
            a.groups, a.options, a.peak_bytes * 2**62, a.recompute_flops * 2**62)


def random_layer(seed: int, n_units: int) -> LayerGraph:
    """A random layer: units of one or two values, some values views of earlier ones,
    random reads by backward, forced saves, outside inputs, random ops and costs."""
    r = random.Random(seed)
    values: list[Value] = []
    units: list[Unit] = []
    storages: list[int] = []
    externals = (External(r.randint(10, 50), kept=False), External(r.randint(10, 50), kept=True))
    for _ in range(n_units):
        mine = []
        for _ in range(2 if r.random() < 0.2 else 1):
            if values and r.random() < 0.25:  # a view: shares an earlier value's storage
                storage = values[r.randrange(len(values))].storage
            else:
                storages.append(r.randint(1, 100))
                storage = len(storages) - 1
            values.append(Value(storage, read_by_backward=r.random() < 0.5, must_save=r.random() < 0.1))
            mine.append(len(values) - 1)
        earlier = [v for v in range(len(values)) if v not in mine]
        inputs = tuple(sorted(r.sample(earlier, min(len(earlier), r.randint(0, 2)))))
        units.append(Unit(tuple(mine), inputs, tuple(e for e in range(2) if r.random() < 0.2), cost=r.randint(0, 50),
                          random=r.random() < 0.15, recomputable=r.random() < 0.9))
    return LayerGraph(tuple(units), tuple(values), tuple(storages), externals, rng_state_bytes=7)


@pytest.mark.parametrize("seed", range(10))
def test_layer_front_matches_brute_force(seed):
    """The integer programs give exactly the Pareto front of (saved bytes, recompute
    cost) that trying every set of recomputed units gives; each point's figures are
    those of its own recomputed units."""
    g = random_layer(seed, 8 + seed % 4)
    front = layer_front(g)
    assert [(d.saved_bytes, d.recompute_cost) for d in front] == [
        (d.saved_bytes, d.recompute_cost) for d in brute_force_front(g)]
    for d in front:
        assert evaluate(g, d.recomputed) == d
    assert front[0].recompute_cost == 0  # recomputing nothing is always possible


def test_solver_output_never_reaches_stdout(capfd):
    """HiGHS prints from C past Python's sys.stdout; everything written to file
    descriptor 1 while a layer's programs run is caught (and logged at DEBUG)."""
    import ctypes
    import os

    with quiet_stdout():
        ctypes.CDLL(None).printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        os.write(1, b"raw\n")
    front = solve_layer_front(random_layer(3, 11))
    out = capfd.readouterr().out
    assert out == "" and front.exact, out


def test_front_cut_by_its_time_bound_keeps_the_least_bytes_and_says_so():
    """With no time for the front, the enumeration stops after its first point and the
    least-bytes decision is solved once: the front still spans recomputing nothing to
    the layer's least saved bytes, every point valid, and it says it is not complete."""
    for seed in range(4):
        g = random_layer(seed, 10)
        exact = brute_force_front(g)
        cut = solve_layer_front(g, SolveLimits(front_time_s=0))
        assert not cut.complete and not cut.exact
        assert cut.points[0].recompute_cost == 0
        assert cut.points[-1].saved_bytes == exact[-1].saved_bytes
        assert all(evaluate(g, d.recomputed) == d for d in cut.points)
        assert all(b.saved_bytes < a.saved_bytes and b.recompute_cost > a.recompute_cost
                   for a, b in zip(cut.points, cut.points[1:]))
        full = solve_layer_front(g)
        assert full.exact and [(d.saved_bytes, d.recompute_cost) for d in full.points] == [
            (d.saved_bytes, d.recompute_cost) for d in exact]


@pytest.mark.parametrize("bad", [{"program_time_s": -1}, {"mip_rel_gap": float("nan")}, {"max_points": 1}])
def test_solve_limits_refuse_bad_values(bad):
    with pytest.raises(RematError, match="SolveLimits"):
        SolveLimits(**bad)


def test_negative_recompute_budget():
    with pytest.raises(ValueError):
        least_peak(random_costs(2, 0), -1)


# --------------------------------------------------------------------------- real graphs

torch = pytest.importorskip("torch")
from remat_pass.recompute import schedule as S  # noqa: E402
from remat_pass.plan.planner import Planner  # noqa: E402
from remat_pass.evaluate.session import Session, megatron_schedules  # noqa: E402
from small_models import load_hetero  # noqa: E402


@pytest.fixture(scope="module")
def hetero_planner() -> tuple[Session, Planner]:
    model, inputs, loss_fn = load_hetero().hetero_gpt(batch=3, seq=16, layers=5)
    session = Session.create(model, inputs, loss_fn)
    return session, Planner(session.joint, session.stack, session.report)


@pytest.fixture(scope="module")
def gpt2_planner() -> tuple[Session, Planner]:
    pytest.importorskip("transformers")
    from remat_pass.models import gpt2

    model, inputs, loss_fn = gpt2(batch=2, seq=32, layers=3, hidden=64, heads=4, vocab=128, dropout=0.1)
    session = Session.create(model, inputs, loss_fn)
    return session, Planner(session.joint, session.stack, session.report)


@pytest.mark.parametrize("which", ["hetero_planner", "gpt2_planner"])
def test_model_peak_equals_liveness_for_every_schedule(which, request):
    _, planner = request.getfixturevalue(which)
    L = planner.model.num_layers
    every = all_groupings(L)
    for groups in random.Random(0).sample(every, min(len(every), 25)):
        sch = S.optimized(groups, L)
        rep = planner.report(sch)
        m = model_peak(planner.costs, groups)
        assert (m.peak_bytes, m.recompute_flops) == (rep.peak_bytes, rep.recompute_flops), sch.provenance


def _budget_table(planner: Planner, n: int = 6):
    least = planner.least_feasible()[1]
    top = planner.unconstrained_peak_bytes
    budgets = sorted({least + (top - least) * i // (n - 1) for i in range(n)}, reverse=True)
    return budgets, planner.plan_many(budgets)


@pytest.mark.parametrize("which", ["hetero_planner", "gpt2_planner"])
def test_budgets_bound_measured_peak_and_beat_megatron(which, request):
    session, planner = request.getfixturevalue(which)
    L = planner.model.num_layers
    megatron = [(s, planner.report(s)) for s in megatron_schedules(L)]
    budgets, plans = _budget_table(planner)
    measured = []
    strictly_better = 0
    for budget, plan in zip(budgets, plans):
        result = session.evaluate(plan.schedule)
        assert result.grads_equal
        assert plan.predicted_peak_bytes <= budget
        assert result.measured_peak_bytes <= budget * 1.03
        fits = [r.recompute_flops for s, r in megatron if r.peak_bytes <= budget]
        if fits:
            assert plan.recompute_flops <= min(fits)
            strictly_better += plan.recompute_flops < min(fits)
        measured.append(result.measured_peak_bytes)
    # case C2: as the budget falls, the measured peak never rises
    assert all(b <= a for a, b in zip(measured, measured[1:])), measured
    if which == "hetero_planner":
        assert strictly_better >= 1


def test_budget_below_least_feasible_raises(hetero_planner):
    _, planner = hetero_planner
    least = planner.least_feasible()[1]
    with pytest.raises(InfeasibleBudget) as e:
        planner.plan(least - 1)
    assert e.value.least_feasible_peak_bytes == least
    assert planner.plan(least).predicted_peak_bytes <= least
