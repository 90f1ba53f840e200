"""Ops whose meta function and CPU kernel disagree on an output's strides.

``native_dropout_backward`` is traced with a contiguous output, but its CPU kernel
returns the layout of its input: after a conv1d (whose gradient input is a transpose),
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

from remat_pass import schedule as schedules
from remat_pass.errors import UnsupportedGraph
from remat_pass.sweep import Session

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


def test_prediction_refuses_a_step_that_cannot_run():
    """At batch 2 the real layout of ``native_dropout_backward``'s output makes the
    traced ``view`` of the Linear backward that follows impossible (``view size is not
    compatible``): the un-rewritten step cannot run, so no real layout, calibration or
    peak is valid for it. Predicting alone (``report``, no ``evaluate``) refuses it,
    naming the view and the op whose real layout differed, as running it does."""
    torch.manual_seed(0)
    model = ConvStack(4, 2, dropout_first=True, shared=False, linear_input=True)
    session = Session.create(model, (torch.randn(2, 5, 4),), lambda y: (y * y).sum())
    with pytest.raises(UnsupportedGraph, match=r"cannot run: node view\w* \(aten\.view\.default\)") as e:
        session.report(schedules.none(session.stack.layers_per_stack))
    assert "native_dropout_backward" in str(e.value)
