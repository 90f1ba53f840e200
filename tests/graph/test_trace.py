"""Tracing (remat_pass/graph/trace.py) on its own: the joint graph's calling convention,
the FakeTensor value and module path on every node, the model left untouched, and the
op named when a step cannot be traced."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat_pass.errors import UnsupportedGraph
from remat_pass.graph.trace import trace_joint
from remat_pass.measure.run import eager_grads, grads_bitwise_equal, run_joint
from remat_pass.models import linear_chain


def test_primals_tangents_and_outputs_follow_the_calling_convention():
    """3 Linear layers: 6 parameter primals then the input; one tangent (the loss's); the
    output is the loss, then one gradient per primal (None for the input, which needs none)."""
    model, inputs, loss_fn = linear_chain(batch=4, width=8, layers=3)
    joint = trace_joint(model, inputs, loss_fn)
    assert joint.primal_kinds == ["param"] * 6 + ["input"]
    assert joint.primal_labels == [n for n, _ in model.named_parameters()] + ["input[0]"]
    assert all(v is p for v, p in zip(joint.primal_values, model.parameters()))
    assert len(joint.tangents) == 1 and joint.num_fwd_outputs == 1 and joint.output == "loss"
    placeholders = [n.name for n in joint.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == joint.primals + joint.tangents
    (out,) = [n for n in joint.gm.graph.nodes if n.op == "output"]
    flat = out.args[0]
    assert len(flat) == 1 + len(joint.primals) and flat[-1] is None
    assert joint.num_params == 6 and not joint.fake and joint.symbols == {}


def test_every_op_has_a_fake_value_and_a_module_path():
    model, inputs, loss_fn = linear_chain(batch=4, width=8, layers=3)
    joint = trace_joint(model, inputs, loss_fn)
    ops = [n for n in joint.gm.graph.nodes if n.op == "call_function"]
    assert ops and all(isinstance(n.meta.get("val"), (FakeTensor, tuple, list, torch.SymInt, int, type(None)))
                       for n in ops)
    mm = [n for n in ops if n.target == torch.ops.aten.addmm.default]
    assert len(mm) == 3
    paths = [list(n.meta["nn_module_stack"])[-1] for n in mm]
    assert paths == ["0", "1", "2"]  # the Sequential's children, in forward order
    assert [tuple(n.meta["val"].shape) for n in mm] == [(4, 8)] * 3


def test_the_joint_graph_computes_eager_gradients_and_leaves_the_model_alone():
    model, inputs, loss_fn = linear_chain(batch=4, width=8, layers=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    joint = trace_joint(model, inputs, loss_fn)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    loss, grads = eager_grads(model, inputs, loss_fn)
    outs, joint_grads = run_joint(joint)
    assert torch.equal(outs[0], loss)
    assert grads_bitwise_equal(joint_grads[: joint.num_params], grads)


class ItemInForward(nn.Module):
    """A forward that reads a tensor's value into Python (``.item()``): eager runs it,
    AOTAutograd's fake tensors cannot."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * float(x.abs().max().item())
        return x


def test_a_data_dependent_scalar_is_traced_specialized_naming_the_op():
    """(issue 23: was refused) traced with each .item() a constant of the batch."""
    model = ItemInForward()
    x = torch.randn(4, 8)
    model(x).sum().backward()  # eager runs it
    j = trace_joint(model, (x,), lambda y: y.sum())
    (note,) = j.specialized  # one line per op and Python line: the two values of the loop's line
    line = inspect.getsourcelines(ItemInForward.forward)[1] + 2
    assert "aten._local_scalar_dense" in note and f"test_trace.py:{line} (in forward)" in note and "2 calls giving" in note


def test_a_loss_that_is_not_a_scalar_is_refused():
    model, inputs, _ = linear_chain(batch=4, width=8, layers=2)
    with pytest.raises(Exception, match="scalar"):
        trace_joint(model, inputs, lambda y: y)
