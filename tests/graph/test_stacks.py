"""Every stack: several layer stacks (an encoder and a decoder) are all found, chained in
forward order; uniform / block apply per stack; the optimized schedule spans them with
no group across a stack boundary; ``--stack`` is repeatable; the report names them.
Also: piecewise symbolic sizes, and an op that runs eagerly but cannot be traced."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import sympy
import torch
import torch.nn as nn
from torch.utils._sympy.value_ranges import ValueRanges

from remat_pass import cli
from remat_pass.recompute import schedule as schedules
from remat_pass.errors import InvalidSchedule, LayerStackNotFound, RematError, UnsupportedGraph
from remat_pass.plan.planner import Planner
from remat_pass.graph.regions import find_layer_stacks
from remat_pass.evaluate.session import Session
from remat_pass.liveness.symbolic_sizes import SizeConverter
from solvers import least_recompute, model_peak, pareto_front

from chain_cases import all_groupings, random_costs
from zoo.common import x
from zoo.dataflow import EncDec


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


class DecoderFirst(EncDec):
    """The decoder's module comes first in ``named_modules`` but runs second."""

    def __init__(self):
        nn.Module.__init__(self)
        self.dec = nn.ModuleList(EncDec().dec)
        self.enc = nn.ModuleList(EncDec().enc)


def enc_dec():
    """Factory for the command line: encoder of 2 layers ('enc'), decoder of 3 ('dec'),
    the decoder's container first in ``named_modules``."""
    torch.manual_seed(0)
    return DecoderFirst(), (x(), x(seed=2)), None


@pytest.fixture(scope="module")
def session() -> Session:
    return Session.create(*enc_dec())


# --------------------------------------------------------------------------- schedules


def test_uniform_and_block_apply_per_stack():
    assert schedules.uniform(2, (2, 3)).groups == ((0, 1), (2, 3), (4,))
    assert schedules.uniform(3, (2, 3)).groups == ((0, 1), (2, 3, 4))
    assert schedules.block(1, (2, 3)).groups == ((0,), (2,))
    assert schedules.block(3, (2, 3)).groups == ((0,), (1,), (2,), (3,), (4,))
    # one stack given as a 1-tuple is the single-stack schedule, byte for byte
    assert schedules.uniform(2, (5,)) == schedules.uniform(2, 5)
    assert schedules.megatron_schedules((12,)) == schedules.megatron_schedules(12)
    assert [s.provenance for s in schedules.megatron_schedules((2, 3))] == [
        "none", "uniform(K=1)", "uniform(K=2)", "uniform(K=3)", "block(N=0)", "block(N=1)", "block(N=2)",
        "block(N=3)"]


def test_k_beyond_the_longest_stack_and_groups_across_stacks_are_refused():
    with pytest.raises(InvalidSchedule, match=r"longest has L=3 layers \(stacks of 2, 3\)"):
        schedules.uniform(4, (2, 3))
    with pytest.raises(InvalidSchedule, match="spans two layer stacks"):
        schedules.optimized(((1, 2),), (2, 3))


def test_schedule_for_one_stack_is_refused_on_two(session):
    """uniform(2, 5) treats the chain as one stack of 5 (its groups [0-1] [2-3] [4]
    happen not to cross here, but block(3, 5) would): the Partition refuses a schedule
    built for other stacks."""
    with pytest.raises(InvalidSchedule, match="layers_per_stack"):
        session.prepare(schedules.uniform(2, 5))


# --------------------------------------------------------------------------- finding stacks


def test_every_stack_is_found_in_forward_order(session):
    """Before: only the longest ('dec') was taken, silently. The decoder's container comes
    first in named_modules here, but the encoder runs first, so it is layers 0-1."""
    s = session
    assert [(sp.path, sp.first_layer, sp.num_layers) for sp in s.stack.stacks] == [("enc", 0, 2), ("dec", 2, 3)]
    assert s.stack.layer_path(3) == "dec.1" and s.stack.layers_per_stack == (2, 3)
    # a backward node of the decoder's layer 0 is chain layer 2
    assert {s.stack.layer_of[n] for n in s.stack.nodes_of_layer(2)} == {2}


def test_named_stacks_are_checked():
    model = EncDec()
    assert [p for p, _ in find_layer_stacks(model, ["dec", "enc"])] == ["dec", "enc"]
    with pytest.raises(LayerStackNotFound, match="twice"):
        find_layer_stacks(model, ["enc", "enc"])
    with pytest.raises(LayerStackNotFound, match="'nope'"):
        find_layer_stacks(model, ["enc", "nope"])


def test_a_stack_inside_a_layer_of_another_is_refused_when_named():
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]),
                          nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    with pytest.raises(LayerStackNotFound, match="inside a layer of the stack ''"):
        find_layer_stacks(model, ["", "0"])


# --------------------------------------------------------------------------- chain model


@pytest.mark.parametrize("L,starts,seed", [(4, (2,), 1), (5, (2,), 2), (6, (1, 4), 3)])
def test_chain_dynamic_program_keeps_groups_inside_stacks(L, starts, seed):
    """The DP with stack boundaries against brute force over the schedules whose groups
    stay inside one stack."""
    c = dataclasses.replace(random_costs(L, seed), stack_starts=starts)
    valid = [g for g in all_groupings(L) if not any(i in starts for grp in g for i in grp[1:])]
    every = [model_peak(c, g) for g in valid]
    least, most = min(s.peak_bytes for s in every), max(s.peak_bytes for s in every)
    for budget in sorted({least, (least + most) // 2, most}):
        sol = least_recompute(c, budget)
        assert sol.recompute_flops == min(s.recompute_flops for s in every if s.peak_bytes <= budget)
        assert not any(i in starts for grp in sol.groups for i in grp[1:]), sol.groups
    assert all(not any(i in starts for grp in p.groups for i in grp[1:]) for p in pareto_front(c))
    crossing = next(g for g in all_groupings(L) if g not in valid)
    with pytest.raises(InvalidSchedule, match="spans two layer stacks"):
        model_peak(c, crossing)


def test_planner_spans_both_stacks(session):
    planner = Planner(session.joint, session.stack, session.report)
    assert planner.costs.stack_starts == (2,)
    least_schedule, least = planner.least_feasible()
    budgets = [planner.unconstrained_peak_bytes, (planner.unconstrained_peak_bytes + least) // 2, least]
    for plan in planner.plan_many(budgets):
        assert plan.schedule.stack_sizes == (2, 3)
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        r = session.evaluate(plan.schedule)
        assert r.grads_equal and r.measured_peak_bytes == r.predicted_peak_bytes, plan.schedule.provenance
    assert any(g[0] >= 2 for g in least_schedule.groups), "the decoder is recomputed at the least peak"


# --------------------------------------------------------------------------- command line


def test_stack_option_is_repeatable_and_the_report_names_the_stacks(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli.main(["report", "--model", "tests.graph.test_stacks:enc_dec", "--stack", "dec", "--stack", "enc",
                     "--schedule", "uniform", "--recompute-num-layers", "2", "--json", str(out)])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    doc = json.loads(out.read_text())
    assert doc["meta"]["layer_stacks"] == [{"path": "enc", "first_layer": 0, "num_layers": 2},
                                           {"path": "dec", "first_layer": 2, "num_layers": 3}]
    assert doc["schedule"]["groups"] == [[0, 1], [2, 3], [4]]
    assert "2 layer stacks" in err and "'enc' (layers 0-1), 'dec' (layers 2-4)" in err


@pytest.mark.slow
def test_sweep_command_over_two_stacks(capsys):
    assert cli.main(["sweep", "--model", "tests.graph.test_stacks:enc_dec"]) == cli.EXIT_OK
    out, _ = capsys.readouterr()
    assert "uniform(K=3)" in out and "uniform(K=4)" not in out  # K runs to the longest stack's L


# --------------------------------------------------------------------------- piecewise sizes


def _converter(lower: int = 2) -> tuple[SizeConverter, sympy.Symbol, sympy.Symbol]:
    s0, s1 = sympy.Symbol("s0", positive=True, integer=True), sympy.Symbol("s1", positive=True, integer=True)
    env = types.SimpleNamespace(var_to_range={s0: ValueRanges(lower, sympy.oo), s1: ValueRanges(lower, sympy.oo)},
                                replace=lambda e: e)
    joint = types.SimpleNamespace(symbols={"batch": (s0,), "seq": (s1,)}, shape_env=env)
    return SizeConverter(joint), s0, s1


def test_piecewise_size_is_the_argument_that_wins_over_the_whole_range():
    """Before: T5's ``Max(1, seq - 1)`` raised sympy's PolynomialError."""
    conv, s0, s1 = _converter()
    p = conv(8 * s1 + 8 * (s0 - 1) * sympy.Max(1, s1 - 1) - 8)
    want = conv(8 * s1 + 8 * (s0 - 1) * (s1 - 1) - 8)
    assert p == want
    assert conv(sympy.Min(s1, 2 * s1)) == conv(s1)


def test_piecewise_size_without_a_winner_is_refused():
    conv, s0, s1 = _converter()
    with pytest.raises(RematError, match="piecewise"):
        conv(sympy.Max(s0, s1))
    conv1, _, s1 = _converter(lower=1)
    with pytest.raises(RematError, match="piecewise"):  # seq = 1 would make it 1, not seq - 1
        conv1(sympy.Max(1, s1 - 1))


# --------------------------------------------------------------------------- untraceable op


@torch.library.custom_op("remat_pass_test::bf16_only", mutates_args=())
def bf16_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@bf16_only.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    torch._check(x.dtype == torch.bfloat16, lambda: f"Expected inputs of BF16 type but got {x.dtype}")
    return torch.empty_like(x)


bf16_only.register_autograd(lambda ctx, g: g * 2)


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return bf16_only(self.fc(x))


def test_op_whose_meta_refuses_the_inputs_is_named(capfd):
    """As Mixtral's default grouped_mm experts in fp32: eager runs, tracing cannot. The
    error names the op and its cause, without the fake-tensor log's traceback."""
    model = nn.Sequential(Doubler(), Doubler())
    with pytest.raises(UnsupportedGraph, match=r"remat_pass_test\.bf16_only\.default runs eagerly") as e:
        Session.create(model, (torch.randn(3, 4),), lambda y: y.sum())
    assert "Expected inputs of BF16 type" in str(e.value)
    assert "failed while attempting to run meta" not in capfd.readouterr().err
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_mixtral_grouped_mm_is_refused_with_the_fix(capfd):
    """transformers' Mixtral with its default grouped_mm experts in fp32 (slow to build:
    the error is what is checked, no sweep)."""
    hf = pytest.importorskip("remat_pass.models.hf_families")
    pytest.importorskip("transformers")
    model, inputs, loss_fn = hf.mixtral(layers=2, experts_implementation=None)
    with pytest.raises(UnsupportedGraph, match="_experts_implementation = 'batched_mm'") as e:
        Session.create(model, inputs, loss_fn)
    assert "aten._grouped_mm" in str(e.value)
    err = capfd.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) < 5, err

