"""The eager code a user's step runs around the compiled graphs (an eager loss after
the compiled model, a function Dynamo runs eagerly between two graphs, the loss kept
alive by the caller) is recorded in the second step of a signature and composed into
the step: predicted == measured to the byte from then on (``compile/eager_recorder``)."""

from __future__ import annotations

import copy
import os
import shutil
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import remat_pass
from remat_pass.measure.run import profiled_peak_cpu
from remat_pass.models import Block

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512


@torch._dynamo.disable
def _eager_mix(x: torch.Tensor) -> torch.Tensor:
    """Run eagerly by Dynamo: between two graphs (its backward between theirs)."""
    return torch.tanh(x) * x + 1.0


class Head(nn.Module):
    """Embedding, blocks, final norm and head: returns the logits (the loss is the
    caller's); ``mix``: ``_eager_mix`` between blocks 1 and 2."""

    def __init__(self, layers: int = 4, hidden: int = 64, mix: bool = False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(Block(hidden, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.mix = mix

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for b in self.blocks[:2]:
            x = b(x)
        if self.mix:
            x = _eager_mix(x)
        for b in self.blocks[2:]:
            x = b(x)
        return self.head(self.ln_f(x))


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, 32), generator=torch.Generator().manual_seed(batch))


def _cross_entropy(f, ids):
    F.cross_entropy(f(ids).float().flatten(0, 1), ids.roll(-1, 1).flatten()).backward()


def _held_logits(f, ids):
    logits = f(ids)  # kept by this frame through backward
    F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()


def _summed(f, ids):
    f(ids).sum().backward()  # the tangent is an expanded ones: AOTAutograd copies it


def _steps(model: nn.Module, b, loss, ids, n: int = 4, compiler_kwargs=None):
    """Measured and predicted peak of each of ``n`` steps (``.grad`` None before each).
    The step of a signature that records the eager ops does not run under a profiler
    (the backend skips the recording then), so each step runs twice: once as is, once
    measured."""
    f = torch.compile(model, backend=b, **(compiler_kwargs or {}))
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            for p in model.parameters():
                p.grad = None
            loss(f, ids)
            r = b.step_report()
            for p in model.parameters():
                p.grad = None
            measured = profiled_peak_cpu(lambda: loss(f, ids))[0]
            out.append((measured, r.peak_bytes if r is not None else None, r.notes if r is not None else None))
    return out


@pytest.mark.parametrize("loss", [_cross_entropy, _held_logits, _summed])
@pytest.mark.parametrize("sched", [("uniform", 1), ("none", None)])
def test_eager_loss_after_the_compiled_model_is_predicted(loss, sched):
    """The first step names the eager loss in its notes (it over-counts the logits);
    from the second step, which records the eager ops, every step is predicted to the
    byte, with no note but the held output's; no dispatch mode is left pushed."""
    torch.manual_seed(0)
    steps = _steps(Head(), remat_pass.backend(*sched), loss, _ids())
    first_notes = steps[0][2]
    assert any("not a loss" in n and "recorded from the next step" in n for n in first_notes)
    for measured, predicted, notes in steps[1:]:
        assert predicted == measured
        assert all("held" in n for n in notes)
    assert steps[0][1] != steps[0][0]  # before the recording, the eager loss is not modelled
    assert not _get_current_dispatch_mode_stack()


@pytest.mark.parametrize("sched", [("uniform", 1), ("uniform", 2), ("none", None)])
def test_eager_function_between_graphs_is_predicted(sched):
    """A function Dynamo runs eagerly between two graphs, and its backward between
    theirs: predicted == measured from the second step; gradients equal eager's."""
    torch.manual_seed(0)
    model = Head(mix=True)
    ref = copy.deepcopy(model)
    ids = _ids()
    steps = _steps(model, remat_pass.backend(*sched), _cross_entropy, ids)
    assert any("eager code between graphs" in n for n in steps[0][2])
    assert [p for _, p, _ in steps[1:]] == [m for m, _, _ in steps[1:]]
    assert all(n == () for _, _, n in steps[1:])
    _cross_entropy(ref, ids)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def test_recording_compiles_nothing_again():
    """The recording mode declares ignore_compile_internals: the recorded step runs
    the same compiled graphs (one compile per graph, no recompile)."""
    torch.manual_seed(0)
    b = remat_pass.backend("uniform", 1)
    _steps(Head(mix=True), b, _cross_entropy, _ids())
    assert len(b.reports) == 2


def test_dynamic_shapes_record_each_shape():
    """Under dynamic=True each new batch's first step is noted, the next one recorded:
    exact from then on, per batch, in one compile."""
    torch.manual_seed(0)
    model = Head()
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in (2, 4):
            ids = _ids(batch)
            for i in range(3):
                for p in model.parameters():
                    p.grad = None
                _cross_entropy(f, ids)
                report = b.step_report((batch, 32))
                for p in model.parameters():
                    p.grad = None
                measured = profiled_peak_cpu(lambda: _cross_entropy(f, ids))[0]
                assert (report.peak_bytes == measured) == (i > 0)
    assert len(b.reports) == 1


def test_optimized_budget_with_an_eager_loss_is_planned_on_the_recorded_step():
    """An eager loss after the model: the step plan waits for the step that records
    it; from the step after, measured <= budget and predicted == measured."""
    torch.manual_seed(0)
    ids = _ids()
    peaks = {}
    for sched in (("uniform", 1), ("none", None)):
        torch._dynamo.reset()
        steps = _steps(Head(mix=True), remat_pass.backend(*sched), _cross_entropy, ids, n=3)
        peaks[sched[0]] = steps[-1][0]
    budget = (peaks["uniform"] + peaks["none"]) // 2
    torch._dynamo.reset()
    steps = _steps(Head(mix=True), remat_pass.backend("optimized", budget_bytes=budget), _cross_entropy, ids, n=5)
    for measured, predicted, _ in steps[2:]:
        assert measured <= budget and predicted == measured


needs_cxx = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")) or os.environ.get("REMAT_PASS_SKIP_INDUCTOR") == "1",
    reason="Inductor needs a C++ compiler on CPU (or REMAT_PASS_SKIP_INDUCTOR=1 was set)",
)


@pytest.mark.slow
@needs_cxx
def test_inductor_eager_loss_is_predicted():
    """Under Inductor the eager loss after the model is recorded the same way."""
    torch.manual_seed(0)
    steps = _steps(Head(), remat_pass.backend("uniform", 1, compiler="inductor"), _cross_entropy, _ids(), n=3)
    assert [p for _, p, _ in steps[1:]] == [m for m, _, _ in steps[1:]]


def test_one_mode_at_a_time_and_a_later_backend_takes_it_over():
    """A backend whose training stops after its first step leaves one pass-through
    mode pushed; a second backend takes it over and records its own steps (exact from
    its second step); ``release_modes`` pops what is left."""
    from remat_pass.compile.eager_recorder import EagerStepMode, release_modes

    torch.manual_seed(0)
    ids = _ids()
    _steps(Head(), remat_pass.backend("uniform", 1), _cross_entropy, ids, n=1)  # 2 steps: the 2nd records
    first = remat_pass.backend("none")
    _cross_entropy(torch.compile(Head(), backend=first), ids)  # one step: its mode waits
    left = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, EagerStepMode)]
    assert len(left) == 1
    torch._dynamo.reset()
    steps = _steps(Head(), remat_pass.backend("uniform", 1), _cross_entropy, ids, n=3)
    assert [p for _, p, _ in steps[1:]] == [m for m, _, _ in steps[1:]]
    assert len([m for m in _get_current_dispatch_mode_stack() if isinstance(m, EagerStepMode)]) <= 1
    release_modes()
    assert not _get_current_dispatch_mode_stack()


def test_gradient_accumulation_records_both_microsteps():
    """Two microbatches per optimizer step: the first steals its gradients into
    ``.grad``, the second adds into them (two signatures). Each is recorded once; from
    then on both are predicted to the byte."""
    torch.manual_seed(0)
    model = Head()
    ids = _ids()
    b = remat_pass.backend("uniform", 1)
    f = torch.compile(model, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            for p in model.parameters():
                p.grad = None
            _cross_entropy(f, ids)
            _cross_entropy(f, ids)
        for p in model.parameters():
            p.grad = None
        stolen = profiled_peak_cpu(lambda: _cross_entropy(f, ids))[0]
        assert b.step_report().peak_bytes == stolen
        added = profiled_peak_cpu(lambda: _cross_entropy(f, ids))[0]
        assert b.step_report().peak_bytes == added
    assert [e.peak_bytes for e in b.step_log[2:6]] == [stolen, added] * 2
