"""In-place reuse restored in the rewritten step (remat_pass/recompute/reinplace.py): a
loss that reuses its buffer in place, as Megatron-LM's vocab-parallel cross entropy
does, costs the rewrite no more than the eager program; predicted == measured,
gradients bitwise equal; a value read later, a parameter and a value of another layer
are never written over."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from remat_pass.evaluate.eager_program import eager_program
from remat_pass.evaluate.session import Session
from remat_pass.graph.trace import trace_joint
from remat_pass.graph.regions import assign_layers
from remat_pass.liveness.timeline import analyze
from remat_pass.measure.run import grads_bitwise_equal, measure_step, run_joint
from remat_pass.models import tiny_gpt
from remat_pass.recompute import schedule as schedules
from remat_pass.recompute.reinplace import REINPLACED, inplace_overload
from remat_pass.recompute.rewrite import rewrite


class InPlaceCrossEntropy(torch.autograd.Function):
    """Megatron-LM's ``_VocabParallelCrossEntropy`` at one rank: one [N, V] buffer,
    written in place in forward (``-= max``, ``exp(out=)``, ``div_``) and backward
    (``grad[arange, target] -= 1``, ``mul_``)."""

    @staticmethod
    def forward(ctx, logits, target):
        logits = logits.float()
        logits -= logits.max(dim=-1, keepdim=True)[0]
        predicted = logits.gather(-1, target[:, None]).squeeze(-1).clone()
        torch.exp(logits, out=logits)
        sum_exp = logits.sum(-1)
        loss = torch.log(sum_exp) - predicted
        logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(logits, target)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, target = ctx.saved_tensors
        softmax[torch.arange(softmax.shape[0]), target] -= 1.0
        softmax.mul_(grad)
        return softmax, None


class BigVocab(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 64, vocab: int = 512):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(layers)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return InPlaceCrossEntropy.apply(self.head(x), target)


@pytest.fixture(scope="module")
def big_vocab():
    torch.manual_seed(0)
    return BigVocab(), (torch.randn(256, 64), torch.randint(0, 512, (256,)))


def test_a_loss_that_reuses_its_buffer_costs_the_rewrite_no_more_than_eager(big_vocab):
    """Each setting: the rewrite measured == predicted, gradients bitwise equal to the
    model's, and measured <= the eager program's measured peak; without in-place reuse
    (``in_place=False``, the functional trace as it was) the same step is above eager."""
    model, inputs = big_vocab
    session = Session.create(model, inputs, None, layers="blocks")
    for sch in (schedules.none(2), schedules.uniform(1, 2), schedules.block(1, 2)):
        r = session.evaluate(sch)
        eager = eager_program(model, inputs, None, sch, layers="blocks")
        assert r.grads_equal, sch.provenance
        assert r.predicted_peak_bytes == r.measured_peak_bytes, (sch.provenance, r.predicted_peak_bytes,
                                                                 r.measured_peak_bytes)
        assert r.measured_peak_bytes <= eager.measured_peak_bytes, (sch.provenance, r.measured_peak_bytes,
                                                                    eager.measured_peak_bytes)
        functional = rewrite(session.joint, session.stack, sch, in_place=False)
        assert measure_step(functional, session.joint).peak_bytes > eager.measured_peak_bytes, sch.provenance


def test_the_in_place_ops_are_the_ones_eager_runs_and_values_stay_bitwise(big_vocab):
    """The loss's sub / exp / div (forward) and index_put / mul (backward) run in place;
    the loss and gradients equal the functional step's bit for bit."""
    model, inputs = big_vocab
    joint = trace_joint(model, inputs, None)
    stack = assign_layers(joint, "blocks")
    step = rewrite(joint, stack, schedules.none(2))
    written = {str(n.meta[REINPLACED]) for g in (step.forward, step.backward) for n in g.graph.nodes
               if REINPLACED in n.meta}
    assert {"aten.sub.Tensor", "aten.exp.default", "aten.div.Tensor", "aten.index_put.default",
            "aten.mul.Tensor"} <= written, written
    functional = rewrite(joint, stack, schedules.none(2), in_place=False)
    a, b = measure_step(step, joint), measure_step(functional, joint)
    assert torch.equal(a.loss, b.loss) and grads_bitwise_equal(a.grads, b.grads)
    assert grads_bitwise_equal(a.grads, run_joint(joint)[1])
    assert analyze(step).peak_bytes < analyze(functional).peak_bytes


class ReadLater(nn.Module):
    """``e = exp(h)`` is read after ``e * g``: that mul must allocate; ``w.t() * s``
    reads a view of a parameter: never written over."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.g = nn.Parameter(torch.randn(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        e = torch.exp(x)
        m = e * self.g
        scaled = self.layers[0].weight.t() * torch.sigmoid(self.g)
        return (m + e).sum() + scaled.sum()


def test_a_value_read_later_or_a_parameter_is_never_written_over():
    torch.manual_seed(0)
    model, inputs = ReadLater(), (torch.randn(4, 8),)
    joint = trace_joint(model, inputs, None)
    stack = assign_layers(joint, "layers")
    step = rewrite(joint, stack, schedules.none(2))
    fw = {n.name: n for n in step.forward.graph.nodes}
    mul = next(n for n in fw.values() if REINPLACED not in n.meta and n.target == torch.ops.aten.mul.Tensor
               and n.args[0].target == torch.ops.aten.exp.default)
    assert mul.target == torch.ops.aten.mul.Tensor  # exp is read by the add after it
    for n in fw.values():
        if REINPLACED in n.meta:
            assert n.args[0].op != "placeholder" and n.args[0].target != torch.ops.aten.t.default, n.format_node()
    assert grads_bitwise_equal(measure_step(step, joint).grads, run_joint(joint)[1])


def test_a_residual_stream_stays_in_each_layer():
    """TinyGPT: no reinplaced node writes a storage another layer made (layer reuse's
    rule), and the step is still predicted exactly."""
    model, inputs, loss_fn = tiny_gpt(batch=2, seq=16, layers=3, hidden=32, heads=4, vocab=64, dropout=0.0)
    session = Session.create(model, inputs, loss_fn)
    step, report, _ = session.prepare(schedules.none(3))
    for g in (step.forward, step.backward):
        for n in g.graph.nodes:
            if REINPLACED in n.meta:
                assert step.layer_of.get(n.args[0].name) == step.layer_of.get(n.name), n.format_node()
    r = session.evaluate(schedules.uniform(1, 3))
    assert r.predicted_peak_bytes == r.measured_peak_bytes and r.grads_equal


def test_only_ops_with_an_in_place_overload_are_candidates():
    aten = torch.ops.aten
    assert inplace_overload(aten.mul.Tensor) is aten.mul_.Tensor
    assert inplace_overload(aten.index_put.default) is aten.index_put_.default
    assert inplace_overload(aten.mm.default) is None  # not pointwise
    assert inplace_overload(aten.mul_.Tensor) is None  # already in place
    assert inplace_overload(aten.view.default) is None
