"""Symbolic memory model: the symbolic peak of every schedule equals the concrete
liveness peak at many shapes (GPT-2 and a heterogeneous stack), closed forms, largest
batch checked by running it, byte parsing."""

from __future__ import annotations

import pytest
import sympy
import torch

from solvers import closed_forms

from remat_pass.recompute import schedule as S
from remat_pass.liveness.timeline import analyze
from remat_pass.measure.run import measure_step
from remat_pass.graph.regions import assign_layers
from remat_pass.recompute.rewrite import rewrite
from remat_pass.formatting import parse_bytes
from remat_pass.plan.chain_calibration import closed_forms as chain_closed_forms
from remat_pass.report.plan_report import symbolic_model_text
from remat_pass.liveness.symbolic import default_symbols, trace_symbolic
from remat_pass.evaluate.session import megatron_schedules
from remat_pass.graph.trace import trace_joint

from small_models import load_hetero

SHAPES = [(2, 8), (3, 16), (4, 12), (5, 24), (7, 40)]




def gpt2_factory(batch, seq):
    pytest.importorskip("transformers")
    from remat_pass.models import gpt2

    # one model for every shape (the factory sizes the position table by seq)
    model, _, loss_fn = gpt2(batch=2, seq=64, layers=2, hidden=64, heads=4, vocab=128, dropout=0.1)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
    return model, {"input_ids": ids, "labels": ids}, loss_fn


def hetero_factory(batch, seq):
    return load_hetero().hetero_gpt(batch=batch, seq=seq, layers=4)


def schedules_for(L):
    return megatron_schedules(L) + [S.optimized(((1,),), L), S.optimized(((0, 1),), L)]


@pytest.mark.slow
@pytest.mark.parametrize("factory", [gpt2_factory, hetero_factory], ids=["gpt2", "hetero"])
def test_symbolic_peak_equals_concrete_at_five_shapes(factory):
    model, inputs, loss_fn = factory(3, 32)
    sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs))
    assert set(sm.gens) == {"batch", "seq"}
    L = sm.num_layers
    exprs = {s: sm.peak(s) for s in schedules_for(L)}
    for e in exprs.values():
        assert e.free_symbols <= {sm.symbol("batch"), sm.symbol("seq")}
    for batch, seq in SHAPES:
        m2, in2, lf2 = factory(batch, seq)
        joint = trace_joint(m2, in2, lf2)
        stack = assign_layers(joint)
        for s, e in exprs.items():
            concrete = analyze(rewrite(joint, stack, s)).peak_bytes
            value = e.xreplace({sm.symbol("batch"): batch, sm.symbol("seq"): seq})
            assert int(value) == concrete, (s.provenance, batch, seq)
            assert sm.peak_at(s, batch=batch, seq=seq) == concrete


def test_aggregates_and_closed_forms_are_polynomials():
    model, inputs, loss_fn = hetero_factory(3, 32)
    sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs))
    agg = sm.aggregates()
    b, s = sm.symbol("batch"), sm.symbol("seq")
    for key in ("checkpoint_bytes", "stored_layer_bytes", "forward_flops"):
        assert len(agg[key]) == sm.num_layers
        for v in agg[key]:
            # a polynomial in batch and seq with integer coefficients (raises otherwise)
            poly = sympy.Poly(v, b, s)
            assert all(c.is_integer for c in poly.coeffs()), v
            assert poly.free_symbols <= {b, s}
    # the layers differ (MLP widths, attention or not)
    assert len({sympy.expand(v) for v in agg["stored_layer_bytes"]}) > 1
    cf = chain_closed_forms(sm)
    K = closed_forms.K
    assert K in cf.peak_uniform.free_symbols and b in cf.peak_uniform.free_symbols
    # a group of one saves its output: s is far below a stored layer's a
    at = {b: 3, s: 32}
    assert 0 < cf.checkpoint_bytes.subs(at) < cf.stored_layer_bytes.subs(at)
    text = symbolic_model_text(sm)
    assert "peak_uniform(K)" in text and "\\mathrm{peak}" in text


@pytest.mark.slow
def test_largest_batch_fits_and_next_does_not():
    model, inputs, loss_fn = hetero_factory(3, 16)
    sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs))
    L = sm.num_layers
    sch = S.uniform(2, L)
    budget = sm.peak_at(sch, batch=9, seq=16) + 1000  # between two batch sizes
    best = sm.largest_fitting(sch, budget, "batch", seq=16)
    assert best >= 9
    for batch, fits in ((best, True), (best + 1, False)):
        m2, in2, lf2 = hetero_factory(batch, 16)
        joint = trace_joint(m2, in2, lf2)
        step = rewrite(joint, assign_layers(joint), sch)
        predicted = analyze(step).peak_bytes
        assert (predicted <= budget) == fits
        if fits:
            measured = measure_step(step, joint, seed=0).peak_bytes
            assert measured <= budget * 1.03


def test_specialized_symbol_is_refused():
    # seq feeds a python branch only through a closure-free model: a plain Linear chain
    # has no seq; naming a missing dimension is a clear error
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError):
        trace_symbolic(lin, (torch.randn(3, 4),), lambda y: y.sum(), {"seq": [(0, 2)]})


@pytest.mark.parametrize("text,want", [("1.5GiB", 3 * 2**29), ("800MiB", 800 * 2**20),
                                       ("4096", 4096), ("2GB", 2 * 10**9), (123, 123)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["", "1.5 parsecs", "-3", "GiB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)
