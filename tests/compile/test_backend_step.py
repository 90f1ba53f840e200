"""The torch.compile backend predicts the whole training step: graphs split by breaks,
dynamic shapes, autocast, budgets over the step, bad input, Inductor (slow)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings

import jsonschema
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat_pass
from remat_pass.compile.graph import GraphBreakWarning, RematFallbackWarning
from remat_pass.graph.costs import node_flops
from remat_pass.formatting import fmt_bytes
from remat_pass.errors import InfeasibleBudget, InvalidOption, InvalidSchedule, StepNotComposable
from remat_pass.measure.run import profiled_peak_cpu
from remat_pass.models import Block
from remat_pass.report.schedule_report import schema
from remat_pass.plan.planner import Planner
from remat_pass.evaluate.session import Session

from small_models import small_gpt2

needs_cxx = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")) or os.environ.get("REMAT_PASS_SKIP_INDUCTOR") == "1",
    reason="Inductor needs a C++ compiler on CPU (or REMAT_PASS_SKIP_INDUCTOR=1 was set)",
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


class Breaky(nn.Module):
    """Embedding, ``layers`` blocks, head and cross entropy, with a graph break inside
    the loss (as transformers' GPT-2 breaks at ``self.loss_function``) and, with
    ``split_at``, one inside the layer stack (after block ``split_at - 1``)."""

    def __init__(self, layers: int = 3, split_at: int | None = None, vocab: int = 128, hidden: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.split_at = split_at

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        split = len(self.blocks) if self.split_at is None else self.split_at
        for block in self.blocks[:split]:  # a break inside a loop would make Dynamo skip the frame
            x = block(x)
        if self.split_at is not None:
            torch._dynamo.graph_break()
        for block in self.blocks[split:]:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return _loss(logits, ids)


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # the break inside the loss
    return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _ids(batch: int = 2, seq: int = 32, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch))


def _measured(model: nn.Module, step) -> int:
    """Two warm-up steps, then the measured peak of one step (``.grad`` None before
    each, so the step allocates its gradients)."""
    params = list(model.parameters())
    for _ in range(2):
        for p in params:
            p.grad = None
        step()
    for p in params:
        p.grad = None
    return profiled_peak_cpu(step)[0]


def test_break_inside_the_loss_step_equals_measured(tmp_path):
    """Two training graphs (layers + head, loss): the composed step equals the measured
    step to the byte (eager compiler, uniform K=1); the step report is written to
    report_dir, valid against the schema, and the GraphBreakWarning gives its cost."""
    torch.manual_seed(0)
    model = Breaky()
    ids = _ids()
    b = remat_pass.backend("uniform", 1, report_dir=tmp_path)
    f = torch.compile(model, backend=b)
    with pytest.warns(GraphBreakWarning) as caught:
        measured = _measured(model, lambda: f(ids).backward())
    report = b.step_report()
    assert [r.layers for r in b.reports] == [(0, 1, 2), ()]
    assert report.exact and report.peak_bytes == measured
    assert report.backward_order == tuple(r.graph_id for r in reversed(b.reports))
    assert {t.kind for t in report.crossing()} == {"crossing", "passed gradient"}
    text = str(caught[-1].message)
    assert f"peaks at {fmt_bytes(report.peak_bytes)}" in text and "the graph breaks cost" in text
    doc = json.loads((tmp_path / "step.json").read_text())
    jsonschema.validate(doc, schema())
    assert doc["peak_bytes"] == measured and doc["kind"] == "remat-pass-step-report"
    assert "predicted step peak" in (tmp_path / "step.md").read_text()
    assert [e.peak_bytes for e in b.step_log] == [measured] * 3


@pytest.mark.parametrize("sched", [("uniform", 2), pytest.param(("none", None), marks=pytest.mark.slow)])
def test_break_inside_the_layer_stack_step_equals_measured(sched):
    """Three graphs (layers 0-1, layer 2 + head, loss): the recompute group [0-1] ends at
    the break; predicted == measured for the step; gradients equal eager's."""
    torch.manual_seed(0)
    model = Breaky(layers=3, split_at=2)
    ref = copy.deepcopy(model)
    ids = _ids()
    b = remat_pass.backend(*sched)
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f(ids).backward())
    assert [r.layers for r in b.reports] == [(0, 1), (2,), ()]
    assert b.step_report().peak_bytes == measured
    ref(ids).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.slow
class BreakBeforeHead(Breaky):
    """Layers and the final norm, a view of its output and a slice of that view, then a
    graph break before the head: the first graph's outputs are both views of one
    intermediate (``AliasBackward0`` after ``ViewBackward0``), as transformers' GPT-2
    hands them over when its ``lm_head`` is compiled apart (``hidden_states.view(...)``
    kept in the model's output, ``hidden_states[:, slice_indices, :]`` to the head)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x).view(*x.shape)
        s = h[:, 0:, :]
        torch._dynamo.graph_break()
        logits = self.head(s)
        assert h.shape[0] == ids.shape[0]  # h lives after the break: an output of the first graph
        return _loss(logits, ids)


def test_graph_whose_outputs_are_views_has_its_backward_observed():
    """Three graphs whose first returns only views of an intermediate: its backward is
    observed (the compiled node behind the views), so the step is predicted to the
    byte; before, that backward was missed and every one of its steps was counted at
    the end of its forward (predicted several times the measured peak, no note)."""
    torch.manual_seed(0)
    model = BreakBeforeHead(layers=3)
    ids = _ids()
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f(ids).backward())
    report = b.step_report()
    assert len(b.reports) == 3 and len(report.backward_order) == 3
    assert report.exact and report.peak_bytes == measured


def test_a_backward_not_observed_is_named_in_the_notes(monkeypatch):
    """Should a graph's backward go unseen (its compiled node not found behind its
    outputs), the step report says so instead of predicting silently."""
    from remat_pass.compile import step_recorder

    monkeypatch.setattr(step_recorder, "_compiled_node",  # the compiled node only, not behind a view
                        lambda node: node if type(node).__name__ == step_recorder.COMPILED_BACKWARD else None)
    torch.manual_seed(0)
    model = BreakBeforeHead(layers=2)
    ids = _ids()
    b = remat_pass.backend("uniform", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        torch.compile(model, backend=b)(ids).backward()
    report = b.step_report()
    assert len(report.backward_order) == 2 and not report.exact
    assert any("the backward of 0/0 (call 0) was not observed" in n for n in report.notes)


def test_dynamic_batch_is_reported_per_shape():
    """dynamic=True, batches 2, 4, 8 through one symbolic compile: every step's
    prediction, looked up by its input shape, equals its measured peak, and the graphs
    save what a static compile saves (at the first batch)."""
    torch.manual_seed(0)
    model = Breaky(layers=2)
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b, dynamic=True)
    measured = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        for batch in (2, 4, 8):
            ids = _ids(batch)
            measured[batch] = _measured(model, lambda: f(ids).backward())
    assert all(r.symbolic for r in b.reports) and len(b.reports) == 2
    assert {batch: b.step_report((batch, 32)).peak_bytes for batch in measured} == measured
    assert len({e.peak_bytes for e in b.step_log}) == 3
    with pytest.raises(KeyError, match="shapes seen"):
        b.step_report((3, 32))
    torch._dynamo.reset()
    static = remat_pass.backend("uniform", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        torch.compile(copy.deepcopy(model), backend=static, dynamic=False)(_ids(2)).backward()
    assert [r.memory.saved_activation_bytes for r in b.reports] == [
        r.memory.saved_activation_bytes for r in static.reports]


def test_autocast_step_is_exact():
    """bf16 autocast inside the compiled step: the casts autocast inserts (weights,
    activations, gradients back to fp32) and their lifetimes are graph nodes, so the
    step is predicted to the byte; gradients equal eager autocast's."""
    torch.manual_seed(0)
    model = Breaky(layers=2)
    ref = copy.deepcopy(model)
    ids = _ids(4)

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(ids)

    b = remat_pass.backend("uniform", 1)
    f = torch.compile(lambda: step(model), backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f().backward())
    assert b.step_report().peak_bytes == measured
    assert any(n.meta["val"].dtype == torch.bfloat16 for n in b.reports[0].step.forward.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor))
    step(ref).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.slow
def test_budget_bounds_the_measured_step():
    """schedule='optimized', budget_bytes=B: after the first step the schedules are
    chosen against the composed step and recompiled; the measured step is within B, and
    the least feasible step peak is within 1 % of the single-graph planner's on the same
    model; a budget below it raises InfeasibleBudget out of the first backward."""
    torch.manual_seed(0)
    model = Breaky(layers=4)
    ids = _ids(4)
    session = Session.create(copy.deepcopy(model), (ids,), None)
    planner = Planner(session.joint, session.stack, session.report)
    least = planner.least_feasible()[1]
    budget = (least + planner.unconstrained_peak_bytes) // 2
    b = remat_pass.backend("optimized", budget_bytes=budget)
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f(ids).backward())
    assert measured <= budget and b.step_report().peak_bytes == measured
    torch._dynamo.reset()
    tight = remat_pass.backend("optimized", budget_bytes=least // 2)
    with pytest.raises(InfeasibleBudget) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphBreakWarning)
            torch.compile(copy.deepcopy(model), backend=tight)(ids).backward()
    assert abs(info.value.least_feasible_peak_bytes - least) <= 0.01 * least


@pytest.mark.parametrize("kwargs,error,words", [
    ({"schedule": "optimized", "budget_bytes": "80"}, InvalidSchedule, "has no unit"),
    ({"schedule": "optimized", "budget_bytes": "eighty MiB"}, InvalidSchedule, "not a number"),
    ({"on_error": "ignore"}, InvalidOption, "raise, fallback"),
])
def test_bad_options_are_refused_when_made(kwargs, error, words):
    with pytest.raises(error, match=words):
        remat_pass.backend(**kwargs)


def test_budget_with_unit_and_unsupported_mode():
    assert remat_pass.backend("optimized", budget_bytes="80MiB").options.budget_bytes == 80 * 2**20
    model = Breaky(layers=2)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(model, backend=remat_pass.backend("uniform", 1), mode="max-autotune")(_ids())
    assert isinstance(info.value.inner_exception, InvalidOption)
    assert "mode='default'" in str(info.value.inner_exception)


class TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        return self.blocks[1](x)


def test_step_that_cannot_be_composed_raises_or_falls_back():
    """A backward outside autograd's order for one loss.backward() (a graph's backward
    run twice): StepNotComposable out of the backward; with on_error='fallback' a
    warning, the graphs run un-rewritten and gradients equal eager's."""
    torch.manual_seed(0)
    model = TwoGraphs()
    x = torch.randn(4, 16)

    def step(m):
        y = m(x)
        y.sum().backward(retain_graph=True)
        y.pow(2).sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        with pytest.raises(StepNotComposable, match="ran twice"):
            step(torch.compile(copy.deepcopy(model), backend=remat_pass.backend("uniform", 1)))
        torch._dynamo.reset()
        ref = copy.deepcopy(model)
        fallback = remat_pass.backend("uniform", 1, on_error="fallback")
        compiled = torch.compile(model, backend=fallback)
        with pytest.warns(RematFallbackWarning, match="un-rewritten"):
            step(compiled)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            step(compiled)
            step(ref)
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert fallback.step_report() is None


@pytest.mark.slow
def test_gpt2_dynamic_saves_what_static_saves():
    """transformers' GPT-2 under dynamic=True: the ops Dynamo's float tensorification
    creates without module metadata take their layer, so the rewrite saves what the
    static rewrite saves (give or take 0-dim scalars), and each batch is predicted."""
    model, inputs, _ = small_gpt2(layers=2, dropout=0.0)
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        for batch in (2, 4):
            ids = _ids(batch, vocab=256)
            measured = _measured(model, lambda: f(input_ids=ids, labels=ids).loss.backward())
            assert b.step_report((batch, 32)).peak_bytes == measured
        torch._dynamo.reset()
        static = remat_pass.backend("uniform", 1)
        ids = _ids(2, vocab=256)
        torch.compile(copy.deepcopy(model), backend=static, dynamic=False)(input_ids=ids, labels=ids).loss.backward()
    dyn = b.reports[0].memory.saved_activation_bytes
    assert 0 <= dyn - static.reports[0].memory.saved_activation_bytes <= 64


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_inductor_step_is_predicted_from_its_code(sched):
    """compiler='inductor': the step is predicted from Inductor's generated code (fused
    buffers, reuse, frees at last use, fallback outputs and scratch), to the byte."""
    torch.manual_seed(0)
    model = Breaky(layers=2)
    ids = _ids(4)
    b = remat_pass.backend(*sched, compiler="inductor")
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f(ids).backward())
    report = b.step_report()
    assert report.model == "inductor" and report.peak_bytes == measured
    assert report.peak_bytes < sum(r.peak_bytes for r in b.reports)


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_inductor_gpt2_step_is_predicted_from_its_code(sched):
    """compiler='inductor' on transformers' GPT-2 with dropout (one graph break at the
    loss, Inductor's own RNG): the composed step predicted from the generated code of
    both graphs equals the measured step peak, to the byte."""
    torch._dynamo.reset()
    model, _, _ = small_gpt2(layers=2, dropout=0.1)
    ids = _ids(4, vocab=256)
    b = remat_pass.backend(*sched, compiler="inductor")
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f(input_ids=ids, labels=ids).loss.backward())
    report = b.step_report()
    assert report.model == "inductor" and len(b.reports) == 2
    assert report.peak_bytes == measured
    torch._dynamo.reset()


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_inductor_gpt2_dynamic_step_is_predicted_per_batch(sched):
    """compiler='inductor' with dynamic=True on transformers' GPT-2: one compile, run at
    batches 2 and 4, each step predicted to the byte from the symbolic code. Before,
    Inductor refused the backward ("expected [s67] to have been codegen-ed": a shape
    symbol of a saved tensor had no SymInt input), its code's saved values were paired
    with the wrong forward buffers (the SymInt returns counted as tensors: 8-12 % over),
    and the 0-dim float64 inputs Dynamo makes of Python floats at each call, saved for
    backward, were missed (16 B)."""
    torch._dynamo.reset()
    model, _, _ = small_gpt2(layers=2, dropout=0.0)
    b = remat_pass.backend(*sched, compiler="inductor")
    f = torch.compile(model, backend=b, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        for batch in (2, 4):
            ids = _ids(batch, vocab=256)
            measured = _measured(model, lambda: f(input_ids=ids, labels=ids).loss.backward())
            report = b.step_report((batch, 32))
            assert report.model == "inductor" and report.exact
            assert report.peak_bytes == measured
    assert any(t.kind == "made input" for t in report.composed.tensors)
    torch._dynamo.reset()


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_inductor_sdpa_dynamic_step_is_predicted_per_batch(sched):
    """compiler='inductor' with dynamic=True on a model with CPU flash attention (its
    fallback kernel's scratch depends on the symbolic sequence length: a Piecewise of
    the block sizes; before, reading the code raised "cannot determine truth value of
    Relational"): batches 2 and 4 each predicted to the byte."""
    from remat_pass.models import TinyGPT

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, hidden=64, heads=4, layers=2, seq=32)
    b = remat_pass.backend(*sched, compiler="inductor")
    f = torch.compile(lambda ids: F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()), backend=b, dynamic=True)
    for batch in (2, 4):
        ids = _ids(batch)
        measured = _measured(model, lambda: f(ids).backward())
        report = b.step_report((batch, 32))
        assert report.model == "inductor" and report.exact and report.peak_bytes == measured
    torch._dynamo.reset()


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_inductor_dropout_equals_inductor_without_the_pass(sched):
    """With dropout, compiler='inductor' gives gradients bitwise equal to
    torch.compile(backend='inductor') with the same seed (Inductor's RNG is its own:
    dropout becomes inductor_random of a seed drawn once per forward, a pure function,
    so the recompute needs no replay), and leaves the RNG in the same state."""
    from remat_pass.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, hidden=32, heads=2, layers=2, seq=16, dropout=0.1)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    b = remat_pass.backend(*sched, compiler="inductor")
    mine, theirs = torch.compile(model, backend=b), torch.compile(ref, backend="inductor")
    for step in range(2):
        torch.manual_seed(100 + step)
        F.cross_entropy(mine(ids).flatten(0, 1), ids.flatten()).backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        F.cross_entropy(theirs(ids).flatten(0, 1), ids.flatten()).backward()
        assert torch.equal(state, torch.get_rng_state())
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert not any(s.rng_replayed for r in b.reports for s in r.step.segments)


@pytest.mark.slow
def test_budget_over_two_graphs_with_layers():
    """A break inside the layer stack: both graphs' schedules are chosen together; at a
    budget equal to uniform K=1's step peak, and halfway to none's, the measured step is
    within the budget and equals the prediction; half of it is infeasible, and the
    least feasible step peak carried is uniform K=1's (measured)."""
    torch.manual_seed(0)
    model = Breaky(layers=4, split_at=2)
    ids = _ids(4)
    measured = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        for sched in [("none", None), ("uniform", 1)]:
            torch._dynamo.reset()
            m = copy.deepcopy(model)
            f = torch.compile(m, backend=remat_pass.backend(*sched))
            measured[sched[0]] = _measured(m, lambda: f(ids).backward())
        for budget in (measured["uniform"], (measured["uniform"] + measured["none"]) // 2):
            torch._dynamo.reset()
            b = remat_pass.backend("optimized", budget_bytes=budget)
            m = copy.deepcopy(model)
            f = torch.compile(m, backend=b)
            peak = _measured(m, lambda: f(ids).backward())
            assert peak <= budget and b.step_report().peak_bytes == peak
            assert len([c for c in b.step_report().calls if c.layers]) == 2
        torch._dynamo.reset()
        with pytest.raises(InfeasibleBudget) as info:
            tight = remat_pass.backend("optimized", budget_bytes=measured["uniform"] // 2)
            torch.compile(copy.deepcopy(model), backend=tight)(ids).backward()
    assert info.value.least_feasible_peak_bytes == measured["uniform"]


def _recompute_flops(report) -> int:
    step = report.step
    return sum(int(node_flops(n)) for n in step.backward.graph.nodes if step.kind_of.get(n.name) == "recompute")


def _op_level_step(model: nn.Module, ids: torch.Tensor, budget: int):
    """The op-level optimum (FLOPs-only costs) compiled at ``budget``: the backend, the
    measured peak (after the step re-planning) and whether the gradients equal eager's."""
    torch._dynamo.reset()
    m, ref = copy.deepcopy(model), copy.deepcopy(model)
    b = remat_pass.backend(granularity="op", budget_bytes=budget, flops_per_byte=0)
    f = torch.compile(m, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(m, lambda: f(ids).backward())
    ref(ids).backward()
    return b, measured, all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))


@pytest.mark.slow  # more than 4 s on 2 cores
def test_op_level_is_planned_against_the_step():
    """granularity='op' on a model with a break inside the loss: each graph is first
    planned alone (its own peak holds its outputs and gradients to its end, more than
    the step does); after the first step the op-level choices are picked against the
    composed step. At 70 % of the un-rewritten step's measured peak the measured step is
    within the budget, the step report equals it to the byte, the gradients equal
    eager's, and the step recomputes fewer FLOPs than the per-graph plans (the graphs'
    first compiles) did."""
    torch.manual_seed(0)
    model, ids = Breaky(layers=4), _ids(4)
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    f = torch.compile(m, backend=remat_pass.backend("none"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        plain = _measured(m, lambda: f(ids).backward())
    budget = plain * 7 // 10
    b, measured, grads_equal = _op_level_step(model, ids, budget)
    assert measured <= budget and b.step_report().peak_bytes == measured and grads_equal
    first, last = {}, {}
    for r in b.reports:
        first.setdefault(r.graph_id, r)
        last[r.graph_id] = r
    assert len(b.reports) > len(first), "the step re-planning recompiled no graph"
    per_graph = sum(_recompute_flops(r) for r in first.values())
    step_planned = sum(_recompute_flops(r) for r in last.values())
    assert step_planned < per_graph
    assert all(r.step.partition.policy == "op_optimal" for r in last.values() if r.layers)


@pytest.mark.slow
def test_op_level_step_least_feasible_peak_fits():
    """A budget below the least step peak the op-level planner finds raises
    InfeasibleBudget out of the first step, carrying that peak; at that peak the
    layers' graph on its own cannot fit (its first compile, planned alone, is over the
    budget: it was given its least feasible choice, not refused), and after the step
    re-planning the measured step fits and equals the step report."""
    torch.manual_seed(0)
    model, ids = Breaky(layers=4), _ids(4)
    with pytest.raises(InfeasibleBudget) as info:
        _op_level_step(model, ids, 2**16)
    least = info.value.least_feasible_peak_bytes
    b, measured, grads_equal = _op_level_step(model, ids, least)
    assert b.reports[0].layers and b.reports[0].memory.peak_bytes > least
    assert measured <= least and b.step_report().peak_bytes == measured and grads_equal


class HeldLogits(Breaky):
    """Breaky returning ``(loss, logits)``: a caller that binds the result keeps the
    logits alive through backward."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return _loss(logits, ids), logits


def _bound_step(f, ids: torch.Tensor) -> None:
    out = f(ids)  # the common loop: the result bound, backward on its loss
    out[0].backward()


def test_the_backend_keeps_no_activation_of_a_step():
    """Dynamo hands the loss graph the real logits as its example input; the backend
    keeps only their layout (for a recompile), so they are not alive after the step and
    the first step is predicted as the later ones (nothing held but the loss)."""
    torch.manual_seed(0)
    model = Breaky()
    ids = _ids()
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, lambda: f(ids).backward())
    for state in b.graph_states.values():
        kept = state.compiled.planned.captured.example_inputs
        assert not [x for x in kept if type(x) is torch.Tensor]
    assert [e.peak_bytes for e in b.step_log] == [measured] * 3


@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_outputs_the_caller_holds_through_backward_are_predicted(sched):
    """``out = model(ids); out[0].backward()`` keeps the logits alive through backward:
    the step report counts them (predicted == measured to the byte) and its note gives
    their bytes, which a loop that keeps ``out`` into the next forward adds there;
    ``model(ids)[0].backward()`` drops them, with no note."""
    torch.manual_seed(0)
    model = HeldLogits(vocab=512)
    ids = _ids(vocab=512)
    peaks = {}
    for bound in (False, True):
        torch._dynamo.reset()
        b = remat_pass.backend(*sched)
        f = torch.compile(model, backend=b)
        step = (lambda: _bound_step(f, ids)) if bound else (lambda: f(ids)[0].backward())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphBreakWarning)
            measured = _measured(model, step)
        report = b.step_report()
        assert report.peak_bytes == measured
        peaks[bound] = measured
        logits = 2 * 32 * 512 * 4
        held = [t for t in report.composed.tensors if t.kind == "held output"]
        if bound:
            assert [t.nbytes for t in held] == [logits]
            assert len(report.notes) == 1 and f"({logits} bytes" in report.notes[0]
        else:
            assert not held and report.notes == ()
    assert peaks[True] > peaks[False]


def test_a_budget_counts_the_outputs_the_caller_holds():
    """The step planner plans against the step as it ran: with the logits held, the
    optimized schedule at a budget between uniform K=1's and none's held-logits peaks is
    measured within the budget and as predicted."""
    torch.manual_seed(0)
    model = HeldLogits(layers=4, vocab=512)
    ids = _ids(vocab=512)
    measured = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        for sched in [("none", None), ("uniform", 1)]:
            torch._dynamo.reset()
            f = torch.compile(model, backend=remat_pass.backend(*sched))
            measured[sched[0]] = _measured(model, lambda: _bound_step(f, ids))
        budget = (measured["uniform"] + measured["none"]) // 2
        torch._dynamo.reset()
        b = remat_pass.backend("optimized", budget_bytes=budget)
        f = torch.compile(model, backend=b)
        peak = _measured(model, lambda: _bound_step(f, ids))
    assert peak <= budget and b.step_report().peak_bytes == peak


@pytest.mark.slow
def test_gpt2_output_held_by_the_caller_is_predicted():
    """transformers' GPT-2 (one break at the loss): ``out = model(...);
    out.loss.backward()`` keeps ``out.logits`` (and the key/value outputs) through
    backward; the step report predicts the step to the byte and says what is held."""
    model, _, _ = small_gpt2(layers=2, dropout=0.0)
    ids = _ids(vocab=256)
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b)

    def step():
        out = f(input_ids=ids, labels=ids)
        out.loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        measured = _measured(model, step)
    report = b.step_report()
    held = [t for t in report.composed.tensors if t.kind == "held output"]
    assert report.peak_bytes == measured
    assert 2 * 32 * 256 * 4 in [t.nbytes for t in held] and "caller held" in report.notes[0]
