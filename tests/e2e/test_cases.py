"""The cases users reported (../shared/cases/README.md), each with its right behaviour.

C2 (budgets) lives with the optimized schedule's tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from remat_pass.recompute import schedule
from remat_pass.measure.run import measure_step, run_joint, run_step, grads_bitwise_equal
from remat_pass.models import linear_chain, tiny_gpt
from remat_pass.evaluate.session import Session


# ---------------------------------------------------------------- C1
@pytest.fixture(scope="module")
def c1_session():
    # GPT-style: embedding, L = 8 pre-LN blocks (hidden 256, 4 heads, causal SDPA,
    # 4x GELU MLP), final LN, vocab head, fp32 cross entropy; batch 8, seq 128.
    model, inputs, loss_fn = tiny_gpt(batch=8, seq=128, layers=8, hidden=256, heads=4, vocab=512)
    return Session.create(model, inputs, loss_fn)


@pytest.mark.slow
def test_c1_peak_grows_with_group_size(c1_session):
    s = c1_session
    L = s.stack.num_layers
    results = {k: s.evaluate(schedule.uniform(k, L)) for k in (1, 2, 4, 8)}
    none = s.evaluate(schedule.none(L))
    measured = [results[k].measured_peak_bytes for k in (1, 2, 4, 8)]
    assert measured == sorted(measured) and len(set(measured)) == 4, measured
    for r in [*results.values(), none]:
        assert r.grads_equal
        assert r.predicted_peak_bytes == r.measured_peak_bytes
        # the report names the step and what is live there
        assert r.peak_node and r.live_at_peak_by_layer
    # every group of K layers is rebuilt at once: the peak sits in the backward of the
    # group's last layer
    for k, r in results.items():
        assert r.peak_phase == "backward" and r.peak_layer == k - 1
    # K = L is close to none (within 5 %), and below it
    close = (none.measured_peak_bytes - results[8].measured_peak_bytes) / none.measured_peak_bytes
    assert 0 <= close < 0.05, close


def test_c1_report_names_live_tensors_at_peak(c1_session):
    s = c1_session
    step, report, _ = s.prepare(schedule.uniform(2, s.stack.num_layers))
    names = {t.name for t in report.live_at_peak}
    # the recomputed values of the group being differentiated are live at its peak
    assert any(step.kind_of.get(n) == "recompute" for n in names)
    layers = {t.layer for t in report.live_at_peak if t.kind == "recompute"}
    assert layers <= set(step.schedule.groups[report.peak_layer // 2])


@pytest.mark.slow
def test_c1_large_vocab_head_dominates():
    # vocab 16384: the logits and their gradient dominate the peak
    model, inputs, loss_fn = tiny_gpt(batch=4, seq=128, layers=8, hidden=128, heads=4, vocab=16384)
    s = Session.create(model, inputs, loss_fn)
    L = s.stack.num_layers
    peaks = {k: s.prepare(schedule.uniform(k, L))[1] for k in (1, 2, 4, 8)}
    none = s.prepare(schedule.none(L))[1]
    spread = max(r.peak_bytes for r in peaks.values()) - min(r.peak_bytes for r in peaks.values())
    # differences between K shrink relative to the peak (head dominates) ...
    assert spread / none.peak_bytes < 0.25
    # ... and none is clearly worst
    assert none.peak_bytes > max(r.peak_bytes for r in peaks.values()) * 1.05
    # the head is what is live at those peaks
    for r in peaks.values():
        assert r.live_at_peak_by_layer.get("outer", 0) > r.peak_bytes / 2
    # measurement agrees
    step = s.prepare(schedule.uniform(4, L))[0]
    assert measure_step(step, s.joint).peak_bytes == peaks[4].peak_bytes


# ---------------------------------------------------------------- C3
class DropoutBlock(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.relu(self.lin(x)))


class SinDropout(nn.Module):
    """The bare ``dropout(sin(x * w))``."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return torch.nn.functional.dropout(torch.sin(x * self.w), p=0.1, training=True)


@pytest.mark.parametrize("block", [DropoutBlock, SinDropout])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_c3_dropout_replays_rng_under_recompute(block, k):
    torch.manual_seed(0)
    model = nn.Sequential(*[block() for _ in range(3)]).train()
    x = torch.randn(16, 32)
    s = Session.create(model, (x,), lambda y: (y * y).sum())
    step, report, _ = s.prepare(schedule.uniform(k, 3))
    assert sum(len(seg.rng_replayed) for seg in step.segments) == 3  # every dropout replayed
    r = s.evaluate(schedule.uniform(k, 3))
    assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes
    # the seed matters: a different seed gives different gradients (the check can fail)
    torch.manual_seed(1)
    _, other = run_step(step, s.joint)
    assert not grads_bitwise_equal(other, s.reference_grads)


def test_c3_fresh_randomness_would_be_caught():
    """Recompute with fresh randomness (RNG replay stripped) must not pass the check."""
    from torch._prims.rng_prims import run_with_rng_state

    torch.manual_seed(0)
    model = nn.Sequential(*[DropoutBlock() for _ in range(2)]).train()
    s = Session.create(model, (torch.randn(16, 32),), lambda y: y.sum())
    step, _, _ = s.prepare(schedule.uniform(1, 2))
    for n in step.backward.graph.nodes:
        if n.target is run_with_rng_state:
            n.args = n.args[1:]  # (op, *args): run the op with whatever RNG state is current
            n.target = n.args[0]
            n.args = n.args[1:]
    step.backward.recompile()
    torch.manual_seed(s.seed)
    _, grads = run_step(step, s.joint)
    assert not grads_bitwise_equal(grads, s.reference_grads)


# ---------------------------------------------------------------- C4
def test_c4_group_of_one_op_saves_nothing():
    model, inputs, loss_fn = linear_chain(batch=137, width=256, layers=8)
    s = Session.create(model, inputs, loss_fn)
    none = s.evaluate(schedule.none(8))
    k1 = s.evaluate(schedule.uniform(1, 8))
    assert k1.grads_equal and none.grads_equal
    assert k1.predicted_peak_bytes == none.predicted_peak_bytes
    assert k1.measured_peak_bytes == none.measured_peak_bytes
    assert k1.saved_activation_bytes == none.saved_activation_bytes
    assert k1.peak_saving_vs_none_bytes == 0
    from remat_pass.report.schedule_report import sweep_rows

    assert "saves nothing" in sweep_rows([k1])[0]


# ---------------------------------------------------------------- C5
class DataBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(24, 48)
        self.lin2 = nn.Linear(48, 24)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


def test_c5_input_without_grad():
    torch.manual_seed(0)
    model = nn.Sequential(DataBlock(), DataBlock())
    x = torch.randn(10, 24)  # straight from the data: requires_grad=False
    s = Session.create(model, (x,), lambda y: y.pow(2).mean())
    r = s.evaluate(schedule.uniform(1, 2))
    assert r.grads_equal and r.measured_peak_bytes is not None
    step = s.prepare(schedule.uniform(1, 2))[0]
    torch.manual_seed(0)
    _, grads = run_step(step, s.joint)
    n = s.joint.num_params
    assert all(g is not None for g in grads[:n])  # no parameter gradient dropped
    assert grads[n:] == [None]  # the data gets none
    # and they match eager autograd
    eager = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    for g, e in zip(grads[:n], eager):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_c5_no_peak_next_to_wrong_gradients():
    """If gradients differed, the result carries no peak and strict evaluation raises."""
    from remat_pass.errors import GradientMismatch

    torch.manual_seed(0)
    model = nn.Sequential(DataBlock(), DataBlock())
    s = Session.create(model, (torch.randn(10, 24),), lambda y: y.pow(2).mean())
    s.reference_grads = [g * 2 if g is not None else None for g in s.reference_grads]
    with pytest.raises(GradientMismatch, match="differs"):
        s.evaluate(schedule.uniform(1, 2))
    r = s.evaluate(schedule.uniform(1, 2), strict=False)
    assert not r.grads_equal
    assert r.predicted_peak_bytes is None and r.measured_peak_bytes is None


# ---------------------------------------------------------------- C6
class InplaceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        y = self.proj(x)  # the matmul output, saved by relu's backward ...
        y.add_(x)  # ... then updated in place with the residual
        return y.relu_()


@pytest.mark.parametrize("make", [schedule.none, lambda L: schedule.uniform(1, L), lambda L: schedule.uniform(3, L)])
def test_c6_inplace_on_saved_value(make):
    torch.manual_seed(0)
    model = nn.Sequential(*[InplaceBlock() for _ in range(3)])
    x = torch.randn(8, 32)
    s = Session.create(model, (x,), lambda y: y.sum())
    r = s.evaluate(make(3))
    assert r.grads_equal
    eager = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    step = s.prepare(make(3))[0]
    _, grads = run_step(step, s.joint)
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------- C7
@pytest.mark.parametrize("k", [2, 3])
def test_c7_groups_chain_layer_to_layer(tiny_gpt_session, k):
    s = tiny_gpt_session  # L = 5: not divisible by 2 or 3
    L = s.stack.num_layers
    sch = schedule.uniform(k, L)
    assert len(sch.groups[-1]) == L % k  # the last group, next to the head, is shorter
    step, _, _ = s.prepare(sch)
    torch.manual_seed(s.seed)
    loss, grads = run_step(step, s.joint)
    torch.manual_seed(s.seed)
    ref_loss, ref_grads = run_joint(s.joint)
    assert torch.equal(loss[0], ref_loss[0])
    assert grads_bitwise_equal(grads, ref_grads)
    # structure: inside a group, layer i+1's recompute reads layer i's recomputed output;
    # the only saved values a segment starts from lie outside its group
    layer_of = s.stack.layer_of
    for seg in step.segments:
        assert {layer_of[c] for c in seg.checkpoints}.isdisjoint(seg.layers), seg
        rec = {n.name: n for n in step.backward.graph.nodes if step.kind_of.get(n.name) == "recompute"}
        for layer in seg.layers[1:]:
            reads = {
                a.name
                for n in rec.values()
                if step.layer_of[n.name] == layer
                for a in n.all_input_nodes
                if step.layer_of.get(a.name) == layer - 1
            }
            assert reads and all(step.kind_of.get(a) == "recompute" for a in reads), (layer, reads)
        # the segment runs right before the group's backward starts
        assert layer_of[seg.insert_before] in seg.layers


def test_c7_wrong_chaining_would_be_caught(tiny_gpt_session):
    """Feeding layer i+1 the group input instead of layer i's output changes gradients."""
    s = tiny_gpt_session
    step, _, _ = s.prepare(schedule.uniform(2, s.stack.num_layers))
    seg = step.segments[-1]
    rec = [n for n in step.backward.graph.nodes if step.kind_of.get(n.name) == "recompute"
           and step.layer_of[n.name] == seg.layers[1]]
    ckpt = next(n for n in step.backward.graph.nodes if n.op == "placeholder"
                and n.name in seg.checkpoints and n.meta["val"].dim() == 3)
    first = rec[0]
    swapped = False
    for n in rec:
        for a in n.all_input_nodes:
            if step.layer_of.get(a.name) == seg.layers[0] and a.meta["val"].shape == ckpt.meta["val"].shape:
                n.replace_input_with(a, ckpt)
                swapped = True
                break
        if swapped:
            break
    assert swapped, first
    step.backward.recompile()
    torch.manual_seed(s.seed)
    _, grads = run_step(step, s.joint)
    assert not grads_bitwise_equal(grads, s.reference_grads)
