"""The op-level optimum: per layer, which values to save, with whole-layer groups,
under a peak budget; checked by liveness, measured, gradients bitwise equal, and the
measured peak never rises as the budget falls (case C2 at op level)."""

from __future__ import annotations

import json

import pytest

from small_models import small_gpt2
from remat_pass.cli.main import EXIT_USAGE, main
from remat_pass.errors import InfeasibleBudget
from remat_pass.models import linear_chain
from remat_pass.plan.op_planner import OpPlanner
from remat_pass.plan.planner import Planner
from remat_pass.evaluate.session import Session


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def test_linear_chain_plans_and_refuses_an_infeasible_budget():
    """A Linear chain saves only layer inputs: nothing to trade inside a layer, so the
    op-level answers are the layer-level ones; below the least peak, the error says it."""
    s = Session.create(*linear_chain(batch=8, width=16, layers=3))
    planner = OpPlanner(s.joint, s.stack, s.report)
    assert sorted(i for k in planner.kinds for i in k.layers) == [0, 1, 2]
    assert all(front[0].recompute_cost == 0 for front in planner.fronts)
    top = planner.plan(planner.unconstrained_peak_bytes)
    assert top.recompute_flops == 0 and top.recomputed_nodes == 0
    least = planner.least_feasible().predicted_peak_bytes
    layer_least = Planner(s.joint, s.stack, s.report).least_feasible()[1]
    assert least <= layer_least
    with pytest.raises(InfeasibleBudget) as e:
        planner.plan(least - 1)
    assert e.value.least_feasible_peak_bytes == least
    r = s.evaluate(planner.plan(least).partition)
    assert r.grads_equal and r.measured_peak_bytes <= least


@pytest.mark.slow
def test_budgets_bound_the_measured_peak_monotonically():
    """GPT-2 (transformers) with dropout 0.1: budgets from the unconstrained peak down
    to the least feasible one. Every plan's predicted peak fits its budget and equals
    the measured peak; gradients are bitwise equal (dropout replayed); as the budget
    falls the measured peak never rises and the recompute cost never falls."""
    s = Session.create(*small_gpt2(layers=3, dropout=0.1))
    planner = OpPlanner(s.joint, s.stack, s.report)
    least = planner.least_feasible().predicted_peak_bytes
    top = planner.unconstrained_peak_bytes
    budgets = [top - (top - least) * k // 5 for k in range(6)]
    plans = planner.plan_many(budgets)
    measured = []
    for budget, plan in zip(budgets, plans):
        r = s.evaluate(plan.partition)
        assert r.grads_equal, plan.partition.provenance
        assert plan.predicted_peak_bytes <= budget
        assert r.measured_peak_bytes == r.predicted_peak_bytes, plan.partition.provenance
        measured.append(r.measured_peak_bytes)
    assert all(b <= a for a, b in zip(measured, measured[1:])), measured
    costs = [p.recompute_cost for p in plans]
    assert all(b >= a for a, b in zip(costs, costs[1:])), costs
    assert plans[0].recompute_cost == 0 and plans[-1].recompute_cost > 0
    # the layer-level optimum's least peak is no lower than the op-level one's
    assert least <= Planner(s.joint, s.stack, s.report).least_feasible()[1]


CHAIN = ["--model", "remat_pass.models:linear_chain", "--layers", "3", "--batch", "8"]


@pytest.mark.slow
def test_plan_op_command_line(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *CHAIN, "--budget", "1GiB", "--granularity", "op", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    for key in ("saved_nodes", "recomputed_nodes", "recompute_flops", "recompute_bytes_moved", "measured_peak_bytes",
                "predicted_peak_bytes", "grads_equal", "least_feasible_peak_bytes"):
        assert key in d, key
    assert d["grads_equal"] and d["recompute_flops"] == 0
    capsys.readouterr()
    assert main(["plan", *CHAIN, "--budget", "1", "--granularity", "op"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "least feasible peak is" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_time_bound_that_cuts_the_search_is_stated_and_the_plan_still_fits():
    """No time for the layer fronts: each stops after its first point and keeps its
    least-bytes end; the plan says the search was bounded (and which kinds), its
    predicted peak still fits and is measured, gradients bitwise equal."""
    from solvers.oplevel import SolveLimits

    s = Session.create(*small_gpt2(layers=2))
    exact = OpPlanner(s.joint, s.stack, s.report)
    bounded = OpPlanner(s.joint, s.stack, s.report, limits=SolveLimits(front_time_s=0))
    assert exact.bound_note() is None and exact.front_gap_cost == 0
    assert all(not f.complete for f in bounded.layer_fronts)
    assert all(len(b) <= len(e) for b, e in zip(bounded.fronts, exact.fronts))
    least = bounded.least_feasible().predicted_peak_bytes
    plan = bounded.plan(least)
    assert plan.bound is not None and "cut" in plan.bound
    r = s.evaluate(plan.partition)
    assert r.grads_equal and r.measured_peak_bytes == plan.predicted_peak_bytes <= least
    assert exact.plan(exact.unconstrained_peak_bytes).bound is None
    # no time to calibrate: one profile, each kind's points spread from both ends
    few = OpPlanner(s.joint, s.stack, s.report, limits=SolveLimits(calibrate_time_s=0))
    assert all(a < b for a, b in few.calibrated_points) and "calibration stopped" in few.bound_note()
    assert all(len(f) == len(k.layers) for f, k in zip(few.fronts, few.kinds))
    least = few.least_feasible().predicted_peak_bytes
    plan = few.plan(least)
    r = s.evaluate(plan.partition)
    assert r.grads_equal and r.measured_peak_bytes == plan.predicted_peak_bytes <= least


@pytest.mark.slow
def test_op_plan_text_gives_the_shared_gradient_verdict():
    """The op-level plan text says what sweep says (``ScheduleResult.grads_text``): a
    step whose backward is not bitwise reproducible is 'within run-to-run', not
    'DIFFER'; a real difference is 'DIFFER by ...'."""
    import dataclasses

    from remat_pass.report.plan_report import op_plan_json, op_plan_text

    s = Session.create(*linear_chain(batch=8, width=16, layers=3))
    planner = OpPlanner(s.joint, s.stack, s.report)
    plan = planner.plan(planner.unconstrained_peak_bytes)
    r = s.evaluate(plan.partition)
    noisy = dataclasses.replace(r, grads_equal=False, grads_within_run_to_run=True,
                                max_grad_diff_vs_reference=1e-9, run_to_run_grad_diff=2e-9)
    text = op_plan_text(plan, noisy, planner, 0.0)
    assert "within run-to-run" in text and "DIFFER" not in text
    assert op_plan_json(plan, noisy)["grads_within_run_to_run"] is True
    differ = dataclasses.replace(noisy, grads_within_run_to_run=False)
    assert "DIFFER by" in op_plan_text(plan, differ, planner, 0.0)
    assert "search             exact" in op_plan_text(plan, r, planner, 0.0)


def test_a_layer_that_is_never_called_has_no_options():
    """A stack whose layer 1 is never called (zoo ``layer_never_called``): it holds no
    forward op, so it has no trade-off; the op planner plans the rest (was a KeyError)
    and its least is no higher than any Megatron setting's."""
    from zoo import ZOO
    from remat_pass.recompute.schedule import distinct_megatron_schedules

    entry = next(e for e in ZOO if e.name == "layer_never_called")
    s = Session.create(*entry.build())
    planner = OpPlanner(s.joint, s.stack, s.report)
    least = planner.least_feasible().predicted_peak_bytes
    assert least <= min(s.report(m).peak_bytes for m in distinct_megatron_schedules(s.stack.layers_per_stack))
    r = s.evaluate(planner.plan(least).partition)
    assert r.grads_equal and r.measured_peak_bytes == r.predicted_peak_bytes <= least
