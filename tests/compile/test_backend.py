"""The torch.compile backend: training loops equal to eager, reports, options, breaks."""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat_pass
from remat_pass.recompute import schedule as schedules
from remat_pass.compile.backend import (
    REPORT_DIR_ENV,
    InvalidBackendOption,
    registered_backend,
)
from remat_pass.compile.graph import GraphBreakWarning, NoLayerStackWarning, RematFallbackWarning
from remat_pass.errors import InvalidSchedule, LayerStackNotFound
from remat_pass.graph.module_paths import recorded_paths
from remat_pass.report.inspection import load_dump
from remat_pass.models import TinyGPT
from remat_pass.evaluate.session import Session

from small_models import small_gpt2, small_tiny_gpt

STEPS = 5
SCHEDULES = {"uniform2": ("uniform", 2), "block3": ("block", 3), "none": ("none", None)}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def _model(name: str, dropout: float):
    """(model, loss_of(model) -> scalar): GPT-2 returns .loss (the loss sits behind
    Hugging Face's graph break); TinyGPT returns logits and the loss is taken outside
    the compiled module (forward output = logits, not the loss)."""
    if name == "gpt2":
        model, inputs, _ = small_gpt2(layers=3, dropout=dropout)
        return model, lambda m: m(**inputs).loss
    model, (ids,), loss_fn = small_tiny_gpt(layers=3, dropout=dropout)
    return model, lambda m: loss_fn(m(ids))


def _train(model, loss_of, steps: int = STEPS, seed: int = 0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        torch.manual_seed(seed + s)  # same dropout masks in eager and compiled runs
        loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


_EAGER: dict = {}


def _eager_run(name: str, dropout: float):
    if (name, dropout) not in _EAGER:
        model, loss_of = _model(name, dropout)
        start = copy.deepcopy(model)
        losses = _train(model, loss_of)
        _EAGER[name, dropout] = (start, loss_of, losses, [p.detach().clone() for p in model.parameters()])
    return _EAGER[name, dropout]


@pytest.mark.parametrize(
    "name,dropout,sched",
    [
        pytest.param("gpt2", 0.0, "uniform2", marks=pytest.mark.slow),
        pytest.param("gpt2", 0.0, "block3", marks=pytest.mark.slow),
        pytest.param("gpt2", 0.0, "none", marks=pytest.mark.slow),
        pytest.param("gpt2", 0.1, "uniform2", marks=pytest.mark.slow),
        ("tiny", 0.0, "uniform2"),
        ("tiny", 0.0, "block3"),
        ("tiny", 0.0, "none"),
        ("tiny", 0.1, "block3"),
    ],
)
def test_training_equals_eager(name, dropout, sched):
    """5 AdamW steps under the backend: losses and final parameters equal eager's bit
    for bit (CPU, eager compiler; with dropout, eager with the same seeds)."""
    start, loss_of, eager_losses, eager_params = _eager_run(name, dropout)
    method, k = SCHEDULES[sched]
    b = remat_pass.backend(schedule=method, recompute_num_layers=k)
    model = copy.deepcopy(start)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)  # GPT-2's loss graph break
        losses = _train(torch.compile(model, backend=b), loss_of)
    assert [float(x) for x in losses] == [float(x) for x in eager_losses]
    assert all(torch.equal(a, b_) for a, b_ in zip(losses, eager_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_params))

    # one training graph holds the stack; compiled once, not per step
    stacked = [r for r in b.reports if r.layer_stack is not None]
    assert len(stacked) == 1, [r.graph_id for r in b.reports]
    r = stacked[0]
    sch = schedules.make(method, k, 3) if method != "none" else schedules.none(3)
    assert r.layer_stack == ("transformer.h" if name == "gpt2" else "blocks")
    assert r.layers == (0, 1, 2)
    assert r.schedule == sch.provenance
    assert sorted(s.layers for s in r.step.segments) == list(sch.groups)  # run order: backward's
    if dropout:
        assert any(s.rng_replayed for s in r.step.segments)
    assert b.inference_graphs == []


def test_report_equals_traced_pipeline():
    """The backend's MemoryReport for a compiled loss step equals the trace_joint
    pipeline's (Session.prepare) for the same model and schedule."""
    model, (ids,), loss_fn = small_tiny_gpt(layers=3)

    class WithLoss(torch.nn.Module):
        """The model and its loss, targets from the batch as tiny_gpt's loss_fn (a
        captured constant would be a graph input under Dynamo but a constant in
        trace_joint's graph, whose views allocate nothing)."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return F.cross_entropy(self.model(x).flatten(0, 1), x.roll(-1, 1).flatten())

    step_module = WithLoss()
    session = Session.create(step_module, (ids,), None)
    for sch in (schedules.uniform(2, 3), schedules.none(3)):
        torch._dynamo.reset()
        _, expected, _ = session.prepare(sch)
        b = remat_pass.backend(sch.method, sch.recompute_num_layers)
        step = torch.compile(step_module, backend=b)
        step(ids).backward()
        got = b.reports[0].memory
        assert (got.peak_bytes, got.peak_node, got.saved_activation_bytes) == (
            expected.peak_bytes, expected.peak_node, expected.saved_activation_bytes
        ), sch.provenance
    model.zero_grad(set_to_none=True)


@pytest.mark.slow  # more than 4 s on 2 cores
def test_optimized_schedule_with_budget():
    """schedule='optimized': the least-recompute groups whose predicted peak fits the
    budget (a budget halfway between uniform(K=1)'s peak and none's); gradients equal
    eager's; a budget below the least feasible peak raises InfeasibleBudget with it."""
    from remat_pass.errors import InfeasibleBudget

    model, (ids,), loss_fn = small_tiny_gpt(layers=3)
    session = Session.create(model, (ids,), loss_fn)
    peak_none = session.prepare(schedules.none(3))[1].peak_bytes
    peak_k1 = session.prepare(schedules.uniform(1, 3))[1].peak_bytes
    budget = (peak_none + peak_k1) // 2
    ref = copy.deepcopy(model)

    def step(m):
        return lambda x: F.cross_entropy(m(x).flatten(0, 1), x.roll(-1, 1).flatten())

    b = remat_pass.backend("optimized", budget_bytes=budget)
    loss = torch.compile(step(model), backend=b)(ids)
    loss.backward()
    eager = step(ref)(ids)
    eager.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    (r,) = b.reports
    assert r.schedule.startswith("optimized(") and r.step.schedule.groups
    assert peak_k1 <= r.memory.peak_bytes <= budget < peak_none

    torch._dynamo.reset()
    tight = remat_pass.backend("optimized", budget_bytes=peak_k1 // 2)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(step(copy.deepcopy(ref)), backend=tight)(ids)
    inner = info.value.inner_exception
    assert isinstance(inner, InfeasibleBudget)
    assert peak_k1 // 2 < inner.least_feasible_peak_bytes <= peak_k1


class _NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return torch.relu(self.norm(self.linear(x))) + x


def test_batchnorm_buffer_updates_in_a_recomputed_stack():
    """BatchNorm in train mode mutates its running statistics (AOTAutograd keeps
    ``copy_(buffer, new)`` in the joint): the backend takes the mutations out, rewrites,
    and puts them back at the end of forward; recomputed batch norms read a clone of the
    statistics from before the update. Gradients and buffers equal eager's after 3 steps.
    The stack is the compiled nn.Sequential itself (path "")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_NormBlock() for _ in range(4)])
    ref = copy.deepcopy(model)
    b = remat_pass.backend("uniform", 2)
    compiled = torch.compile(model, backend=b)
    for i in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        compiled(x).sum().backward()
        ref(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(model.buffers(), ref.buffers()))
    (r,) = b.reports
    assert r.layer_stack == "" and r.layers == (0, 1, 2, 3)
    assert sorted(s.layers for s in r.step.segments) == [(0, 1), (2, 3)]


def test_eval_and_no_grad_are_not_rewritten():
    model, loss_of = _model("tiny", 0.0)
    ref = copy.deepcopy(model)
    b = remat_pass.backend("uniform", 2)
    compiled = torch.compile(model, backend=b)
    _train(compiled, loss_of, steps=1)
    _train(ref, loss_of, steps=1)
    n_train = len(b.reports)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    model.eval()
    ref.eval()
    with torch.no_grad():
        out = compiled(ids)
    assert torch.equal(out, ref(ids))
    assert len(b.reports) == n_train and len(b.inference_graphs) == 1
    with torch.no_grad():  # train mode, no grad: an inference graph too
        model.train()
        compiled(ids)
    assert len(b.reports) == n_train and len(b.inference_graphs) == 2


@pytest.mark.slow
def test_changing_batch_shape():
    """A second batch size recompiles with a symbolic batch (automatic dynamic shapes);
    gradients stay equal to eager's; the symbolic graph's report, at the batch that
    triggered it, equals the report of a static compile at that batch."""
    model = TinyGPT(vocab=128, hidden=64, heads=4, layers=3, seq=32)
    ref = copy.deepcopy(model)
    b = remat_pass.backend("uniform", 2)
    compiled = torch.compile(model, backend=b)

    def loss(m, x):
        return F.cross_entropy(m(x).flatten(0, 1), x.roll(-1, 1).flatten())

    for batch, seq in ((2, 32), (3, 32), (4, 32)):
        x = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch))
        a, e = loss(compiled, x), loss(ref, x)
        a.backward()
        e.backward()
        assert torch.equal(a, e)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert len(b.reports) >= 2 and not b.reports[0].symbolic and b.reports[1].symbolic
    assert b.reports[1].example_shapes[0] == (3, 32)

    torch._dynamo.reset()
    static = remat_pass.backend("uniform", 2)
    x = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(3))
    loss(torch.compile(copy.deepcopy(ref), backend=static, dynamic=False), x).backward()
    assert b.reports[1].memory.peak_bytes == static.reports[0].memory.peak_bytes


class UnrolledGPT(TinyGPT):
    """TinyGPT with its 4 layers called one by one and a graph break after layer 1."""

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        x = self.blocks[1](self.blocks[0](x))
        torch._dynamo.graph_break()
        x = self.blocks[3](self.blocks[2](x))
        return self.head(self.ln_f(x))


def test_graph_break_between_layers():
    """Each graph gets its own layer mapping (global layer indices); the recompute group
    [0-2] spans the break, each graph recomputes its part; a warning says so and gives
    the bytes crossing the break; gradients stay equal to eager."""
    torch.manual_seed(0)
    model = UnrolledGPT(vocab=128, hidden=64, heads=4, layers=4, seq=32)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    b = remat_pass.backend("uniform", 3)
    with pytest.warns(GraphBreakWarning) as caught:
        loss = F.cross_entropy(torch.compile(model, backend=b)(ids).flatten(0, 1), ids.flatten())
        loss.backward()
    eager = F.cross_entropy(ref(ids).flatten(0, 1), ids.flatten())
    eager.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert [r.layers for r in b.reports] == [(0, 1), (2, 3)]
    assert [sorted(s.layers for s in r.step.segments) for r in b.reports] == [[(0, 1, 2)], [(0, 1, 2), (3,)]]
    first = b.reports[0]
    # the tensor crossing the break: the residual stream after layer 1, [2, 32, 64] fp32
    assert first.boundary_output_bytes == 2 * 32 * 64 * 4
    text = str(caught[-1].message)
    assert "recompute group [0-2] spans graphs" in text and first.graph_id in text
    assert b.graph_breaks() == text


class _BreakThen(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.inner(x)


def test_graph_break_inside_layer_loop():
    """A break inside a layer called from a loop: Dynamo skips the loop's frame and
    compiles each layer's forward as its own frame, rooted at the layer, so no graph
    records the stack path: they are compiled with ``none``, the warning says so, and
    gradients stay equal to eager."""
    model, (ids,), loss_fn = small_tiny_gpt(layers=3)
    model.blocks[1].ln_2 = _BreakThen(model.blocks[1].ln_2)
    ref = copy.deepcopy(model)
    b = remat_pass.backend("uniform", 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = loss_fn(torch.compile(model, backend=b)(ids))
        loss.backward()
    eager = loss_fn(ref(ids))
    eager.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert b.reports and all(r.layers == () and r.schedule == "none" for r in b.reports)
    texts = [str(w.message) for w in caught]
    assert any("holds no layer of the stack" in t for t in texts)
    assert "hold no layer of the stack" in b.graph_breaks()


def test_report_dir_option_and_env(tmp_path, monkeypatch):
    suffixes = [".json", ".md", ".remat.json"]

    model, loss_of = _model("tiny", 0.0)
    b = remat_pass.backend("block", 3, report_dir=tmp_path / "opt")
    _train(torch.compile(model, backend=b), loss_of, steps=1)
    (r,) = b.reports
    stem = "graph_" + r.graph_id.replace("/", "_")
    folder = tmp_path / "opt"
    names = [stem + s for s in suffixes] + ["step.json", "step.md"]  # the step report, after the first step
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)
    assert sorted(map(str, b.files)) == sorted(str(folder / n) for n in names)
    data = json.loads((folder / f"{stem}.json").read_text())
    assert data["graph_id"] == r.graph_id and data["schedule"] == "block(N=3)"
    assert data["memory"]["peak_bytes"] == r.memory.peak_bytes
    assert "block(N=3)" in (folder / f"{stem}.md").read_text()
    assert load_dump(folder / f"{stem}.remat.json")

    torch._dynamo.reset()
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path / "env"))
    model, loss_of = _model("tiny", 0.0)
    b = remat_pass.backend("none")
    _train(torch.compile(model, backend=b), loss_of, steps=1)
    assert len(list((tmp_path / "env").glob("graph_*"))) == len(suffixes)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"schedule": "sometimes"}, InvalidSchedule, "none, uniform, block"),
        ({"schedule": "uniform", "recompute_num_layers": 0}, InvalidSchedule, "1..L"),
        ({"schedule": "uniform", "recompute_num_layers": None}, InvalidSchedule, "1..L"),
        ({"schedule": "block", "recompute_num_layers": -1}, InvalidSchedule, "0..L"),
        ({"schedule": "uniform", "budget_bytes": 10}, InvalidSchedule, "optimized"),
        ({"schedule": "optimized"}, InvalidSchedule, "needs budget_bytes"),
        ({"schedule": "optimized", "budget_bytes": -5}, InvalidSchedule, "integer > 0"),
        ({"compiler": "tvm"}, InvalidBackendOption, "eager, inductor"),
    ],
)
def test_option_errors(kwargs, error, words):
    with pytest.raises(error, match=words.replace(".", r"\.")):
        remat_pass.backend(**kwargs)


def test_option_errors_at_compile_and_registered_options():
    with pytest.raises(InvalidBackendOption, match="schedule, recompute_num_layers"):
        registered_backend({"schedul": "uniform"})
    # the old name of recompute_num_layers still works, with a DeprecationWarning
    with pytest.warns(DeprecationWarning, match="recompute_num_layers"):
        assert registered_backend({"schedule": "uniform", "num_layers": 2}).options.recompute_num_layers == 2
    # K larger than the stack: found when the graph compiles, and the message names L
    model, loss_of = _model("tiny", 0.0)
    b = remat_pass.backend("uniform", 9)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        loss_of(torch.compile(model, backend=b))
    inner = info.value.inner_exception
    assert isinstance(inner, InvalidSchedule) and "1..L" in str(inner) and "L=3" in str(inner)


def test_registered_name():
    """``backend="remat"`` through the torch_dynamo_backends entry point, with options."""
    from torch._dynamo.backends.registry import list_backends

    assert "remat" in list_backends()
    start, loss_of, eager_losses, eager_params = _eager_run("tiny", 0.0)
    model = copy.deepcopy(start)
    options = {"schedule": "uniform", "recompute_num_layers": 2}
    losses = _train(torch.compile(model, backend="remat", options=options), loss_of)
    assert all(torch.equal(a, b_) for a, b_ in zip(losses, eager_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager_params))
    reports = registered_backend(options).reports
    assert reports and reports[-1].schedule == "uniform(K=2)"


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")) or os.environ.get("REMAT_PASS_SKIP_INDUCTOR") == "1",
    reason="Inductor needs a C++ compiler on CPU (or REMAT_PASS_SKIP_INDUCTOR=1 was set)",
)
def test_inductor_compiler():
    """compiler='inductor': the rewritten graphs go through Inductor; the loss and
    gradients match eager within float tolerance (Inductor fuses and reorders)."""
    model, (ids,), loss_fn = small_tiny_gpt(layers=2)
    ref = copy.deepcopy(model)
    b = remat_pass.backend("uniform", 1, compiler="inductor")
    loss = loss_fn(torch.compile(model, backend=b)(ids))
    loss.backward()
    eager = loss_fn(ref(ids))
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    (r,) = b.reports
    assert r.schedule == "uniform(K=1)" and sorted(s.layers for s in r.step.segments) == [(0,), (1,)]


@pytest.mark.slow
def test_t5_is_planned_on_both_stacks():
    """T5 has two layer stacks, ``encoder.block`` and ``decoder.block``: the backend finds
    both in the module paths Dynamo recorded (the rule ``trace_joint``'s pipeline uses on
    the module), chained encoder then decoder, and uniform(K=1) recomputes every layer of
    both. Before: only the encoder was the stack, the decoder's layers were outer (saved
    whole). Gradients equal eager's."""
    hf = pytest.importorskip("remat_pass.models.hf_families")
    pytest.importorskip("transformers")
    model, inputs, _ = hf.t5(layers=2, seq=8)
    ref = copy.deepcopy(model)
    b = remat_pass.backend("uniform", 1)
    loss = torch.compile(model, backend=b)(**inputs).loss
    loss.backward()
    eager = ref(**inputs).loss
    eager.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    (r,) = [r for r in b.reports if r.layer_stack is not None]
    assert r.layer_stack == "encoder.block, decoder.block"
    assert r.layers == (0, 1, 2, 3)  # encoder layers 0-1, decoder layers 2-3
    assert r.schedule == "uniform(K=1)"
    assert sorted(s.layers for s in r.step.segments) == [(0,), (1,), (2,), (3,)]
    # every forward and backward node recorded under a block is in the stack: none outer
    seen: dict[str, set] = {"encoder": set(), "decoder": set()}
    for gm in (r.step.forward, r.step.backward):
        for n in gm.graph.nodes:
            recorded = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
            paths = [p for p, _ in recorded_paths(recorded)]
            for part, layers in seen.items():
                if any(p.startswith(part + ".block.") for p in paths):
                    layers.add(r.step.layer_of.get(n.name))
    assert seen == {"encoder": {0, 1}, "decoder": {2, 3}}


def test_uniform_or_block_without_k_is_refused():
    """No silent K: the backend used to run uniform with K = 4 (K = L on a 4-layer model)."""
    for schedule in ("uniform", "block"):
        with pytest.raises(InvalidSchedule, match="none was given"):
            remat_pass.backend(schedule=schedule)
        with pytest.raises(InvalidSchedule, match="none was given"):
            registered_backend({"schedule": schedule})


def test_layers_typo_is_an_error_after_the_first_step():
    """``layers=`` naming no stack of any graph ran the step without recompute behind a
    warning; now the first step ends in LayerStackNotFound (fallback: a warning)."""
    model, loss_of = _model("tiny", 0.0)
    b = remat_pass.backend("uniform", 1, layers="blockz")
    with pytest.warns(NoLayerStackWarning), pytest.raises(LayerStackNotFound, match="'blockz' names no layer stack"):
        loss_of(torch.compile(model, backend=b)).backward()
    torch._dynamo.reset()
    fallback = remat_pass.backend("uniform", 1, layers="blockz", on_error="fallback")
    with pytest.warns(RematFallbackWarning, match="nothing was recomputed"):
        loss_of(torch.compile(copy.deepcopy(model), backend=fallback)).backward()
