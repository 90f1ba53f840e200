"""Ops whose meta function and CPU kernel disagree on an output's strides.

``native_dropout_backward``'s meta function returns a contiguous output, but its CPU
kernel returns the layout of its input (it is traced as that kernel's ``grad * mask *
scale`` now, so its layout is right; the real layouts below are recorded for every op): after a conv1d (whose gradient input is a transpose),
that layout makes the transpose that follows contiguous, and ``convolution_backward``
then makes no contiguous copy of it. Calibration used to run each op on the traced
strides and charged that copy; the pass now records the real layout of every value in
the un-rewritten step's reference run and calibrates (and keys each op signature) with
it. The expected figures are the measured peaks and the un-rewritten step's gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat_pass.recompute import schedule as schedules
from remat_pass.evaluate.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")


class ConvStack(nn.Module):
    """``L`` layers, each ``conv(dropout(h))`` over the sequence (``dropout_first``) or
    ``dropout(conv(h))``, with one Conv1d shared by every layer (``shared``) or one
    each; a Linear first when ``linear_input``; ``(B, T, D) -> (B, T, D)``."""

    def __init__(self, d: int, layers: int, dropout_first: bool, shared: bool, kernel: int = 3,
                 linear_input: bool = False):
        super().__init__()
        self.inp = nn.Linear(d, d) if linear_input else nn.Identity()
        conv = nn.Conv1d(d, d, kernel, padding=kernel // 2)
        self.layers = nn.ModuleList(
            Layer(conv if shared else nn.Conv1d(d, d, kernel, padding=kernel // 2), dropout_first)
            for _ in range(layers))

    def forward(self, h):
        h = self.inp(h)
        for layer in self.layers:
            h = layer(h)
        return h


class Layer(nn.Module):
    def __init__(self, conv: nn.Conv1d, dropout_first: bool):
        super().__init__()
        self.conv, self.dropout_first = conv, dropout_first

    def forward(self, h):
        if self.dropout_first:
            h = F.dropout(h, 0.1, training=True)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return h if self.dropout_first else F.dropout(h, 0.1, training=True)


def conv_session(dropout_first: bool, shared: bool, batch: int = 1, seq: int = 3, d: int = 8, layers: int = 3) -> Session:
    torch.manual_seed(0)
    model = ConvStack(d, layers, dropout_first, shared)
    return Session.create(model, (torch.randn(batch, seq, d),), lambda y: (y * y).sum())


@pytest.mark.parametrize("shared", [True, False], ids=["shared_weight", "own_weights"])
@pytest.mark.parametrize("dropout_first", [True, False], ids=["dropout_then_conv", "conv_then_dropout"])
def test_conv1d_behind_dropout_is_exact(dropout_first, shared):
    """Before: ``none`` / ``block(N=0)`` predicted 96 B (a [1, 3, 8] fp32 copy) above
    the measured peak, at ``convolution_backward``. Every distinct Megatron schedule is
    now predicted to the byte, with gradients bitwise equal to the un-rewritten step's
    (``evaluate`` raises GradientMismatch otherwise)."""
    session = conv_session(dropout_first, shared)
    rows = []
    for s in schedules.distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(s)
        rows.append((s.provenance, r.predicted_peak_bytes, r.measured_peak_bytes, r.grads_equal))
    assert all(equal for *_, equal in rows), rows
    assert [p for _, p, _, _ in rows] == [m for _, _, m, _ in rows], rows


def test_dropout_backward_is_traced_with_the_cpu_kernels_layout():
    """Before: at batch 2 the real layout of ``native_dropout_backward``'s output made
    the traced ``view`` of the Linear backward that follows impossible (``view size is
    not compatible``), and the step was refused. Traced as the CPU kernel runs it
    (``grad * mask * scale``: ``trace_context.cpu_decompositions``), its layout is the
    real one: every schedule runs, predicted to the byte, gradients bitwise equal to
    the un-rewritten step's and to eager PyTorch's."""
    torch.manual_seed(0)
    model = ConvStack(4, 2, dropout_first=True, shared=False, linear_input=True)
    session = Session.create(model, (torch.randn(2, 5, 4),), lambda y: (y * y).sum())
    assert not any(n.target is torch.ops.aten.native_dropout_backward.default for n in session.joint.gm.graph.nodes)
    for s in schedules.distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(s)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, s.provenance
        assert r.max_grad_diff_vs_eager == 0.0, s.provenance


def test_grouped_mm_offsets_are_recorded_and_needed_for_calibration():
    """``aten._grouped_mm`` (transformers' MoE kernel) allocates by its offsets' values:
    the reference run records them on the offsets node, the op signature carries them,
    and a step whose values are unknown (a fake trace of the same model) gets no
    calibrated figure for the op, with the reason."""
    transformers = pytest.importorskip("transformers")
    from remat_pass.graph.fake_trace import trace_joint_fake
    from remat_pass.models.hf_families import mixtral
    from remat_pass.graph.op_signature import VALUE_ARGUMENTS, op_call, recorded_values, value_arguments
    from remat_pass.graph.regions import assign_layers
    from remat_pass.recompute.rewrite import rewrite

    transformers.logging.set_verbosity_error()
    model, inputs, _ = mixtral(layers=2, hidden=32, seq=16, experts_implementation=None)
    model = model.to(torch.bfloat16)
    session = Session.create(model, inputs)
    session.check_runs()
    sched = schedules.none(2)
    step = session.prepare(sched)[0]

    def grouped(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in gm.graph.nodes if (c := op_call(n)) is not None and str(c.op.overloadpacket) in VALUE_ARGUMENTS]

    nodes = grouped(step.forward) + grouped(step.backward)
    assert nodes
    for n in nodes:
        (offs,) = value_arguments(op_call(n))
        values = recorded_values(offs)
        assert values is not None and len(values) == offs.meta["val"].numel() and values[-1] > 0, n.name
    memory = session.memory_model(step)
    assert all(memory.node_memory(n).source == "calibrated" for n in nodes)

    with torch.device("meta"):
        meta_model = type(model)(model.config).to(torch.bfloat16).train()
    meta_inputs = {k: torch.empty_like(v, device="meta") for k, v in inputs.items()}
    fake = trace_joint_fake(meta_model, meta_inputs)
    fake_step = rewrite(fake, assign_layers(fake), sched)
    fake_memory = session.memory_model(fake_step)
    for n in grouped(fake_step.forward) + grouped(fake_step.backward):
        m = fake_memory.node_memory(n)
        assert m.source != "calibrated" and "router" in m.detail, (n.name, m)


def _node_metadata(step) -> list[tuple]:
    """Every node of a rewritten step with its metadata: name, op, target, meta keys,
    recorded real layout, and the traced value's shape, strides and dtype."""
    from remat_pass.graph.op_signature import REAL_LAYOUT

    def val(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.dtype
        return tuple(val(x) for x in v) if isinstance(v, (tuple, list)) else repr(v)

    return [(n.name, n.op, str(n.target), tuple(sorted(n.meta)), n.meta.get(REAL_LAYOUT), val(n.meta.get("val")))
            for gm in (step.forward, step.backward) for n in gm.graph.nodes]


def test_a_reference_run_does_not_change_the_rewrite():
    """``rewrite(joint, stack, s)`` is a function of its arguments: a run of the step
    (the session's reference run, which records the real layouts) leaves the traced
    step as it was, so the rewrite gives the same node metadata before and after it
    with the same layouts argument; the layouts reach the nodes only as that argument.
    Before, the run wrote them into the JointGraph and the second rewrite differed."""
    import dataclasses

    from remat_pass.recompute.rewrite import rewrite

    session = conv_session(dropout_first=True, shared=False)
    sched = schedules.none(session.stack.layers_per_stack)
    before = _node_metadata(rewrite(session.joint, session.stack, sched))
    layouts = session.real_layouts  # runs the un-rewritten step
    assert layouts and all(n in {m.name for m in session.joint.gm.graph.nodes} for n in layouts)
    session.evaluate(sched)
    assert _node_metadata(rewrite(session.joint, session.stack, sched)) == before
    given = _node_metadata(rewrite(session.joint, session.stack, sched, layouts))
    assert given != before  # the argument is what carries them
    assert _node_metadata(rewrite(session.joint, session.stack, sched, session.real_layouts)) == given
    with pytest.raises(dataclasses.FrozenInstanceError):
        session.joint.fake = True  # type: ignore[misc]


@pytest.mark.parametrize("calibrate", [True, False], ids=["calibrated", "table_only"])
def test_every_rewrite_of_a_session_takes_the_same_layouts(calibrate):
    """A session rewrites every schedule with the same layouts whatever ran before:
    the reference run's when it calibrates, none without a calibrator (before, an
    uncalibrated session's first rewrite had none and every rewrite after its first
    ``evaluate`` had the reference run's)."""
    from remat_pass.memory.calibration import CalibrationOptions

    torch.manual_seed(0)
    model = ConvStack(8, 3, dropout_first=True, shared=False)
    session = Session.create(model, (torch.randn(1, 3, 8),), lambda y: (y * y).sum(),
                             calibration=CalibrationOptions() if calibrate else None)
    sched = schedules.uniform(1, session.stack.layers_per_stack)
    first = _node_metadata(session.prepare(sched)[0])
    session.evaluate(schedules.none(session.stack.layers_per_stack))
    assert _node_metadata(session.prepare(sched)[0]) == first
    assert bool(session.real_layouts) == calibrate


class NormsOverTransposes(nn.Module):
    """Group norm over the channels of a [1, T, C] input (a transpose), then train-mode
    batch norm over its [T, C] rows (a transposed view at batch 1), then group norm."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.gn1, self.gn2 = nn.GroupNorm(2, c), nn.GroupNorm(2, c)
        self.bn = nn.BatchNorm1d(c)

    def forward(self, h):
        h = self.gn1(h.transpose(1, 2)).transpose(1, 2)
        h = self.bn(h.reshape(-1, h.shape[-1])).view(h.shape)
        return self.gn2(h.transpose(1, 2)).transpose(1, 2)


def test_batch_norm_of_a_transposed_view_is_traced_in_the_cpu_kernels_layout():
    """Before: batch norm's meta function gave the output the input's transposed strides,
    the CPU kernel a contiguous one, and group norm after it failed on the real tensors
    (the step was refused; the long property profile's train-mode BatchNorm class).
    Traced on a contiguous copy of its input (``trace_context.cpu_kernel_layouts``),
    every schedule runs, predicted to the byte, gradients bitwise equal to the traced
    step's and within 1e-5 of eager PyTorch's (the kernel reduces over another layout)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[NormsOverTransposes() for _ in range(3)])
    x = torch.randn(1, 6, 4)
    session = Session.create(model, (x,), lambda y: (y * y).sum())
    for s in schedules.distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(s)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, s.provenance
        assert r.max_grad_diff_vs_eager < 1e-5, (s.provenance, r.max_grad_diff_vs_eager)


def test_softplus_backward_of_two_layouts_is_traced_in_the_gradients_layout():
    """Before: under a transposed group norm's gradient, softplus_backward's meta
    function gave a contiguous output and the CPU kernel the gradient's layout, so the
    traced ``view`` of the Linear backward below failed on the real tensors and the step
    was refused (the long property profile's group-norm class, 3 stacks). With its input
    copied into the gradient's layout first (``trace_context.cpu_decompositions``) every
    schedule runs, predicted to the byte, gradients bitwise equal to the traced step's
    and within rounding of eager PyTorch's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from stacks import StackSpec, build

    spec = StackSpec(batch=2, seq=7, hidden=2, heads=1, num_layers=4, input="dense", loss="sum", tuple_layers=True,
                     container="dict", blocks=(("norm", "groupnorm", 2), ("linear", True), ("act", "gelu"),
                                               ("act", "softplus")))
    session = Session.create(*build(spec))
    copies = [n for n in session.joint.gm.graph.nodes if n.target is torch.ops.aten.copy.default]
    assert copies and all(any(u.target is torch.ops.aten.softplus_backward.default for u in c.users) for c in copies)
    for s in schedules.distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(s)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, s.provenance
        assert r.max_grad_diff_vs_eager < 1e-6, (s.provenance, r.max_grad_diff_vs_eager)
