"""One layer-stack rule for a module and for the module paths a graph records
(``regions.stacks_among``): the graph finder finds every stack the module finder finds,
several of them, and gives every node the same layer; a graph after a break finds the
stacks an earlier graph found; a stack continued past a graph keeps its spans."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from remat_pass.errors import LayerStackNotFound
from remat_pass.graph.regions import (
    LayerStack,
    StackSpan,
    assign_layers,
    assign_layers_in_graph,
    find_layer_stacks,
    find_layer_stacks_in_graph,
)
from remat_pass.graph.trace import trace_joint

from zoo.common import x
from zoo.dataflow import EncDec


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


class MoEBlock(nn.Module):
    """A layer whose experts are a ModuleList of one class (a stack inside a layer)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, h):
        return h + sum(e(h) for e in self.experts)


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock() for _ in range(3))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _traced(model, *inputs):
    return trace_joint(model, inputs, lambda y: y.sum())


def test_graph_finder_finds_what_the_module_finder_finds():
    """Both stacks of an encoder-decoder (before: the graph finder kept only the longest),
    and not the experts inside a layer; the same layer for every node."""
    for model, inputs in ((EncDec(), (x(), x(seed=2))), (MoEModel(), (torch.randn(2, 8),))):
        joint = _traced(model, *inputs)
        in_graph = find_layer_stacks_in_graph(joint.gm)
        assert sorted(in_graph) == sorted(find_layer_stacks(model)), in_graph
        by_module = assign_layers(joint)
        by_graph = assign_layers_in_graph(joint.gm, joint.num_fwd_outputs)
        assert by_graph == by_module
    assert [(s.path, s.first_layer, s.num_layers) for s in by_graph.stacks] == [("layers", 0, 3)]


def test_named_stacks_in_a_graph():
    joint = _traced(EncDec(), x(), x(seed=2))
    assert find_layer_stacks_in_graph(joint.gm, ["dec", "enc"]) == [("dec", ["0", "1", "2"]), ("enc", ["0", "1"])]
    with pytest.raises(LayerStackNotFound, match="twice"):
        find_layer_stacks_in_graph(joint.gm, ["enc", "enc"])
    with pytest.raises(LayerStackNotFound, match="'nope'"):
        find_layer_stacks_in_graph(joint.gm, "nope")
    stack = assign_layers_in_graph(joint.gm, joint.num_fwd_outputs, "dec")
    assert stack.path == "dec" and stack.num_layers == 3


class Tail(nn.Module):
    """What a graph after a break holds: only the last layer of ``h`` (``h.3``)."""

    def __init__(self):
        super().__init__()
        self.h = nn.ModuleDict({"3": nn.Linear(8, 8)})

    def forward(self, v):
        return self.h["3"](v)


def test_a_graph_after_a_break_takes_the_stacks_an_earlier_graph_found():
    joint = _traced(Tail(), torch.randn(2, 8))
    with pytest.raises(LayerStackNotFound, match="no layer stack is recorded"):
        assign_layers_in_graph(joint.gm, joint.num_fwd_outputs)  # one child: not a stack to the search
    stack = assign_layers_in_graph(joint.gm, joint.num_fwd_outputs, known=["enc", "h"])
    assert stack.path == "h" and stack.child_names == ("0", "1", "2", "3")
    assert {i for i in stack.layer_of.values() if i is not None} == {3}


def test_widened_continues_the_last_stack():
    one = LayerStack("h", ("0", "1"), 2, {}, ())
    assert one.widened(3) == LayerStack("h", ("0", "1", "2"), 3, {}, ())
    assert one.widened(2) is one
    two = LayerStack("enc, dec", ("0", "1", "0"), 3, {}, (), (StackSpan("enc", ("0", "1"), 0), StackSpan("dec", ("0",), 2)))
    wide = two.widened(2)
    assert wide.layers_per_stack == (2, 2) and wide.num_layers == 4
    assert wide.layer_path(3) == "dec.1" and wide.child_names == ("0", "1", "0", "1")


class SharedBlock(nn.Module):
    """A layer that calls a module every layer shares (one instance: ``named_modules``
    lists it once, under layer 0's path, and a call records that path)."""

    def __init__(self, shared: nn.Module):
        super().__init__()
        self.own = nn.Linear(8, 8)
        self.shared = shared

    def forward(self, h):
        return self.shared(torch.tanh(self.own(h)))


class SharedModel(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(8, 8)
        self.layers = nn.ModuleList(SharedBlock(shared) for _ in range(3))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def test_a_module_shared_by_every_layer_runs_in_the_layer_that_calls_it():
    """The shared module's nodes take the layer whose call they are (the outermost
    recorded path in the stack), not layer 0, whose path the module records."""
    joint = _traced(SharedModel(), torch.randn(2, 8))
    stack = assign_layers(joint)
    layers_of_addmm = [stack.layer_of[n.name] for n in joint.gm.graph.nodes
                       if n.op == "call_function" and n.target is torch.ops.aten.addmm.default
                       and n.name in stack.forward_nodes]
    assert layers_of_addmm == [0, 0, 1, 1, 2, 2]


def test_a_stack_with_a_shared_module_sweeps_exactly():
    """Every Megatron setting of the shared-module stack: gradients bitwise equal to the
    un-rewritten step's and the predicted peak equal to the measured one."""
    from remat_pass.evaluate.session import Session
    from remat_pass.recompute import schedule as schedules

    torch.manual_seed(0)
    session = Session.create(SharedModel(), (torch.randn(4, 8),), lambda y: y.square().sum())
    for sch in schedules.distinct_megatron_schedules(3):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
