"""The node-level decision of a schedule, pinned on small graphs: exactly which values
are saved (and why), which are recomputed in which segment, and the order segments run.

Each expected name was checked by hand against the printed joint graph (a failure
prints it): in the Linear chain, layer i is ``t_i``/``addmm_i``; in the dropout stack,
layer i is ``fc1 -> tanh -> fc2 -> * mask -> dropout -> + residual`` and ``mul`` is the
shared mask built outside the stack.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat_pass.recompute import schedule as schedules
from remat_pass.models import linear_chain
from remat_pass.recompute.partition import partition
from remat_pass.graph.regions import assign_layers
from remat_pass.graph.trace import trace_joint


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def decision(joint, stack, schedule):
    """(saved names, forced saves {name: reason}, segments as (layers, nodes,
    checkpoints, insert_before, rng_replayed) in run order) of ``schedule``."""
    p = partition(joint, stack, schedule)
    segments = [(s.layers, s.nodes, s.checkpoints, s.insert_before, s.rng_replayed) for s in p.segments]
    return p.saved_names, p.forced_saves, segments


def check(joint, stack, schedule, saved, forced, segments):
    got = decision(joint, stack, schedule)
    assert got == (tuple(saved), forced, segments), (
        f"{schedule.provenance}: got\n{got}\nexpected\n{(tuple(saved), forced, segments)}\n"
        f"joint graph:\n{joint.gm.graph}"
    )


@pytest.fixture(scope="module")
def chain():
    model, inputs, loss_fn = linear_chain(batch=4, width=8, layers=4)
    joint = trace_joint(model, inputs, loss_fn)
    return joint, assign_layers(joint)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))) * mask)


class _DropoutStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        mask = torch.ones(8) * 0.5
        for b in self.blocks:
            x = b(x, mask)
        return self.head(x).square().sum()


@pytest.fixture(scope="module")
def dropout_stack():
    torch.manual_seed(0)
    model = _DropoutStack().train()
    joint = trace_joint(model, (torch.randn(2, 8),))
    return joint, assign_layers(joint)


def test_chain_none_saves_every_layer_input(chain):
    joint, stack = chain
    check(joint, stack, schedules.none(4),
          ["addmm", "t_1", "addmm_1", "t_2", "addmm_2", "t_3"], {}, [])


def test_chain_uniform2_saves_the_group_boundary(chain):
    joint, stack = chain
    # layer 1's output addmm_1 is read by layer 2's weight gradient (mm_3): saved; group
    # [2, 3] is rebuilt from it first, group [0, 1] from the batch (a primal)
    check(joint, stack, schedules.uniform(2, 4),
          ["addmm_1"],
          {"addmm_1": "read by the backward of layer 2 (mm_3), outside the group"},
          [((2, 3), ("t_2", "addmm_2", "t_3"), ("addmm_1",), "t_4", ()),
           ((0, 1), ("t", "addmm", "t_1"), (), "t_12", ())])


def test_chain_uniform4_saves_nothing(chain):
    joint, stack = chain
    check(joint, stack, schedules.uniform(4, 4), [], {},
          [((0, 1, 2, 3), ("t", "addmm", "t_1", "addmm_1", "t_2", "addmm_2", "t_3"), (), "t_4", ())])


def test_chain_block1_keeps_the_stored_layers(chain):
    joint, stack = chain
    # layer 0's only backward-read value is its output: nothing to recompute
    check(joint, stack, schedules.block(1, 4),
          ["addmm", "t_1", "addmm_1", "t_2", "addmm_2", "t_3"],
          {"addmm": "read by the backward of layer 1 (mm_5), outside the group"}, [])


def test_dropout_stack_uniform2_replays_rng_and_saves_the_mask_once(dropout_stack):
    joint, stack = dropout_stack
    check(joint, stack, schedules.uniform(2, 3),
          ["mul", "add_1", "add_2", "t_6", "addmm_6"],
          {"add_1": "read by the backward of layer 2 (mm_5), outside the group",
           "add_2": "read by the backward of the outer region (mm_1), outside the group"},
          [((2,), ("t_4", "addmm_4", "tanh_2", "detach_2", "t_5", "addmm_5", "mul_3",
                   "native_dropout_2", "getitem_5"),
            ("add_1", "mul"), "mul_6", ("native_dropout_2",)),
           ((0, 1), ("t", "addmm", "tanh", "detach", "t_1", "addmm_1", "mul_1", "native_dropout",
                     "getitem", "getitem_1", "add", "t_2", "addmm_2", "tanh_1", "detach_1", "t_3",
                     "addmm_3", "mul_2", "native_dropout_1", "getitem_3"),
            ("mul",), "mul_9", ("native_dropout", "native_dropout_1"))])


def test_dropout_stack_block1(dropout_stack):
    joint, stack = dropout_stack
    check(joint, stack, schedules.block(1, 3),
          ["mul", "add", "t_2", "tanh_1", "detach_1", "t_3", "getitem_3", "add_1", "t_4", "tanh_2",
           "detach_2", "t_5", "getitem_5", "add_2", "t_6", "addmm_6"],
          {"add": "read by the backward of layer 1 (mm_9), outside the group"},
          [((0,), ("t", "addmm", "tanh", "detach", "t_1", "addmm_1", "mul_1", "native_dropout",
                   "getitem_1"),
            ("mul",), "mul_12", ("native_dropout",))])


def test_dropout_stack_none(dropout_stack):
    joint, stack = dropout_stack
    check(joint, stack, schedules.none(3),
          ["mul", "tanh", "detach", "t_1", "getitem_1", "add", "t_2", "tanh_1", "detach_1", "t_3",
           "getitem_3", "add_1", "t_4", "tanh_2", "detach_2", "t_5", "getitem_5", "add_2", "t_6",
           "addmm_6"], {}, [])
