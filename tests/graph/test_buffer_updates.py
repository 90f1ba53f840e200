"""Buffer writes traced functionally (issue 23): BatchNorm's running statistics in train
mode become forward outputs after the loss (``JointGraph.buffer_updates``); writes of a
parameter or of a value that requires grad are refused naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conv_models import tiny_resnet_train
from remat_pass.errors import UnsupportedGraph
from remat_pass.graph.fake_trace import trace_joint_fake
from remat_pass.graph.trace import trace_joint


def test_batchnorm_running_statistics_are_forward_outputs_after_the_loss():
    model, inputs, loss_fn = tiny_resnet_train(layers=2)
    j = trace_joint(model, inputs, loss_fn)
    written = [j.primal_labels[i] for i in j.buffer_updates]
    assert sorted(written) == sorted(n for n, _ in model.named_buffers())
    assert all(j.primal_kinds[i] == "buffer" for i in j.buffer_updates)
    assert j.num_user_outputs == 1 and j.num_fwd_outputs == 1 + len(written)
    outs = list(j.gm.graph.output_node().args[0])
    assert outs[0].meta["val"].dim() == 0  # the loss first
    for i, out in zip(j.buffer_updates, outs[1:j.num_fwd_outputs]):
        assert out.meta["val"].shape == j.primal_values[i].shape
        assert out.meta["val"].dtype == j.primal_values[i].dtype


def test_fake_trace_has_the_same_buffer_updates():
    model, inputs, loss_fn = tiny_resnet_train(layers=2)
    real = trace_joint(model, inputs, loss_fn)
    fake = trace_joint_fake(model, inputs, loss_fn)
    assert fake.buffer_updates == real.buffer_updates and fake.num_fwd_outputs == real.num_fwd_outputs


class _WritesWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
        return y


class _WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def test_writing_a_parameter_in_place_is_refused_naming_it():
    with pytest.raises(UnsupportedGraph, match=r"writes fc\.weight in place.*optimizer step"):
        trace_joint(_WritesWeight(), (torch.randn(2, 4),), lambda y: y.sum())


def test_writing_an_input_that_requires_grad_is_refused_naming_it():
    with pytest.raises(UnsupportedGraph, match=r"writes input\[0\] in place"):
        trace_joint(_WritesInput(), (torch.randn(2, 4, requires_grad=True),), lambda y: y.sum())


def test_writing_an_input_without_grad_is_traced():
    j = trace_joint(_WritesInput(), (torch.randn(2, 4),), lambda y: y.sum())
    assert [j.primal_labels[i] for i in j.buffer_updates] == ["input[0]"]
