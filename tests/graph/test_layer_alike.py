"""One rule for "these layers are alike" (``graph.layer_alike``), over the evidence of
each caller: a config's modules (``differing_layer``), a rewritten block
(``BlockType.matches``), an op-level layer's nodes (``op_planner``'s layer kinds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from remat_pass.graph.layer_alike import (
    alike,
    alike_key,
    block_evidence,
    first_unlike,
    module_evidence,
    node_evidence,
    numbering,
)
from remat_pass.graph.regions import assign_layers
from remat_pass.graph.trace import trace_joint
from remat_pass.liveness.layer_template import BlockType


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


class Layer(nn.Module):
    def __init__(self, idx: int, width: int = 8, act: type = nn.GELU):
        super().__init__()
        self.layer_idx = idx  # numbers the layers: left out
        self.fc = nn.Linear(8, width)
        self.out = nn.Linear(width, 8)
        self.act = act()

    def forward(self, h):
        return h + self.out(self.act(self.fc(h)))


def test_the_rule_leaves_out_the_numbering_and_names_the_first_difference():
    same = [module_evidence(Layer(i)) for i in range(3)]
    assert numbering(same) == {".layer_idx"}
    assert first_unlike(same) is None and alike(same[0], same[1])
    wider = same + [module_evidence(Layer(3, width=16))]
    assert first_unlike(wider) == (3, "fc.out_features")
    # the caller's order names the most telling difference first (classes first)
    other = same[:1] + [module_evidence(Layer(1, width=16, act=nn.ReLU))]
    assert first_unlike(other, order=lambda k: (not k.endswith(":class"), k.count("."), k)) == (1, "act:class")
    # a fact one layer lacks counts as None
    assert first_unlike([{"a": 1}, {"a": 1, "b": None}]) is None
    assert first_unlike([{"a": 1}, {"a": 1, "b": 2}]) == (1, "b")


def _layers(model: nn.Module, inputs):
    joint = trace_joint(model, inputs, lambda y: y.sum())
    stack = assign_layers(joint)
    per_layer: dict[int, list] = {}
    forward = set(stack.forward_nodes)
    for n in joint.gm.graph.nodes:
        layer = stack.layer_of.get(n.name)
        if n.name in forward and n.op == "call_function" and layer is not None:
            per_layer.setdefault(layer, []).append(n)
    return per_layer


def test_node_evidence_groups_alike_layers_into_kinds():
    """Layer 1 is wider: a kind of its own; layers 2 and 3 are one kind (node positions,
    not names, so their evidence is equal); layer 0 reads the model's input (a
    placeholder, not a node of another layer): a kind of its own too."""
    model = nn.Sequential(Layer(0), Layer(1, width=16), Layer(2), Layer(3), Layer(4))  # the loss joins layer 4
    per_layer = _layers(model, (torch.randn(2, 8),))
    keys = {i: alike_key(node_evidence(nodes, {}, i)) for i, nodes in per_layer.items()}
    assert keys[2] == keys[3] and len({keys[0], keys[1], keys[2]}) == 3
    assert alike(node_evidence(per_layer[2], {}, 2), node_evidence(per_layer[3], {}, 3))
    assert not alike(node_evidence(per_layer[2], {}, 2), node_evidence(per_layer[1], {}, 1))
    # who reads a value in backward is evidence too
    first = per_layer[2][0]
    assert not alike(node_evidence(per_layer[2], {first: {2}}, 2), node_evidence(per_layer[3], {}, 3))


def test_block_types_match_by_ops_and_storages():
    model = nn.Sequential(Layer(0), Layer(1), Layer(2))  # the loss joins layer 2
    per_layer = _layers(model, (torch.randn(2, 8),))
    a = BlockType("forward", per_layer[0], 0, [(0, 64, False)])
    b = BlockType("forward", per_layer[1], 0, [(0, 64, False)])
    assert a.matches(b) and alike(block_evidence(a.nodes, a.storages), block_evidence(b.nodes, b.storages))
    assert not a.matches(BlockType("forward", per_layer[1], 0, [(0, 128, False)]))
    assert not a.matches(BlockType("forward", per_layer[1][:-1], 0, [(0, 64, False)]))
