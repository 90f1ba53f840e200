"""The op level from a template (plan.op_reuse): the liveness of an L-layer step in
which stored layers recompute trade-off points just in time (roles ``S<k>``),
assembled from rewrites of a 4-layer template, equals the full rewrite's, storage by
storage; and the plan made from the template is the plan made from the whole trace."""

from __future__ import annotations

import pytest

from remat_pass.recompute import schedule as schedules
from remat_pass.graph.regions import assign_layers
from remat_pass.graph.trace import trace_joint
from remat_pass.liveness.intervals import memory_intervals
from remat_pass.liveness.layer_reuse import ReusedLayers
from remat_pass.liveness.layer_roles import roles_of
from remat_pass.liveness.timeline import analyze, live_timeline
from remat_pass.memory.memory_model import MemoryModel
from remat_pass.plan.op_planner import POLICY, OpPlanner, layer_kinds
from remat_pass.plan.op_reuse import OpDecision, ReusedOpPlanner
from remat_pass.recompute.partition import OpLevelChoice, op_level_partition
from remat_pass.recompute.rewrite import rewrite

from small_models import small_gpt2, small_tiny_gpt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def traced(build, layers: int):  # noqa: ANN001, ANN201
    model, inputs, loss_fn = build(layers)
    joint = trace_joint(model, inputs, loss_fn)
    return joint, assign_layers(joint)


def storages(iv) -> list[tuple]:  # noqa: ANN001
    return sorted((s.first, s.last, s.nbytes, s.kind) for s in iv.storages if not s.static)


def full_partition(full, planner: ReusedOpPlanner, decision: OpDecision):  # noqa: ANN001, ANN201
    """The Partition of ``decision`` on the whole trace: each layer's k-th point mapped
    to that layer's nodes by position (the full trace's own layer kind)."""
    fj, fs = full
    (kind,) = layer_kinds(fj, fs, planner.template_planner.cost_of, planner.reuse.allocator)
    assert kind.graph == planner.kinds[0].graph  # the same layer, unit for unit
    names: set[str] = set()
    for i, k in enumerate(decision.options):
        if k:
            names |= kind.recomputable_in(i, planner.fronts[0][k - 1])
    return op_level_partition(fj, fs, OpLevelChoice(POLICY, frozenset(names)), decision.schedule)


def check(build, allocator: str, template_layers: int, layers: int, decisions) -> ReusedOpPlanner:  # noqa: ANN001
    template, full = traced(build, template_layers), traced(build, layers)
    tj, ts = template
    planner = ReusedOpPlanner(ReusedLayers(tj, ts, layers, allocator))
    n = len(planner.fronts[0])
    assert n >= 2, "a trade-off with points to place"
    for groups, options in decisions(n):
        dec = OpDecision(groups, options, layers)
        step = rewrite(*full, full_partition(full, planner, dec))
        full_iv = memory_intervals(step, MemoryModel.table_only(allocator))[0]
        iv, _ = planner.reuse.intervals(dec.layer_schedule, dec.options)
        assert storages(iv) == storages(full_iv), roles_of(dec.layer_schedule, dec.options)
        assert live_timeline(iv) == live_timeline(full_iv)
        got, want = planner.report(dec), analyze(step, allocator)
        for field in ("peak_bytes", "peak_step", "peak_phase", "peak_layer", "saved_activation_bytes",
                      "static_bytes", "forward_flops", "recompute_flops", "live_at_peak_by_layer"):
            assert getattr(got, field) == getattr(want, field), (options, field)
        assert len(planner.recomputed_nodes(dec)) == sum(
            1 for b in step.backward.graph.nodes if step.kind_of.get(b.name) == "recompute")
    return planner


def mixed(layers: int):  # noqa: ANN201
    def decisions(n: int):  # noqa: ANN202
        last = n
        yield (), (1,) * layers
        yield (), (last,) * layers
        yield (), tuple((i % n) + 1 for i in range(layers))
        yield (), tuple(0 if i % 2 else last for i in range(layers))
        yield ((1, 2), (4,)), tuple(0 if i in (1, 2, 4) else (i % n) + 1 for i in range(layers))
    return decisions


def test_tiny_gpt_op_options_equal_the_full_rewrite():
    check(lambda L: small_tiny_gpt(layers=L), "cpu", 4, 7, mixed(7))


def test_gpt2_dropout_op_options_equal_the_full_rewrite():
    """Dropout: a just-in-time recompute replays the RNG state its layer saves."""
    check(lambda L: small_gpt2(layers=L, dropout=0.1), "cuda", 4, 6, mixed(6))


def test_the_plan_from_the_template_is_the_plan_from_the_whole_trace():
    """At every budget, the template's plan has the whole trace's predicted peak, and
    it fits; the least feasible peaks agree."""
    build = lambda L: small_tiny_gpt(layers=L)  # noqa: E731
    (tj, ts), (fj, fs) = traced(build, 4), traced(build, 8)
    reused = ReusedOpPlanner(ReusedLayers(tj, ts, 8, "cpu"))
    whole = OpPlanner(fj, fs, lambda p: analyze(rewrite(fj, fs, p), "cpu"))
    least = reused.least_feasible().predicted_peak_bytes
    assert least == whole.least_feasible().predicted_peak_bytes
    top = reused.unconstrained_peak_bytes
    assert top == whole.unconstrained_peak_bytes
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        budget = int(least + frac * (top - least))
        a, b = reused.plan(budget), whole.plan(budget)
        assert a.predicted_peak_bytes <= budget
        step = rewrite(fj, fs, full_partition((fj, fs), reused, a.partition))
        assert analyze(step, "cpu").peak_bytes == a.predicted_peak_bytes
        assert a.recompute_cost == b.recompute_cost, budget
