"""Bad input gets a clear error that says what was wrong and what is allowed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from remat_pass.recompute import schedule
from remat_pass.errors import InvalidSchedule, LayerStackNotFound, RematError
from remat_pass.graph.regions import find_layer_stack
from remat_pass.evaluate.session import Session


class NoStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)])

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


def test_model_without_layer_stack():
    with pytest.raises(LayerStackNotFound) as e:
        Session.create(NoStack(), (torch.randn(2, 8),), lambda y: y.sum())
    msg = str(e.value)
    assert "ModuleList" in msg and "layers=" in msg


def test_mixed_container_is_not_a_stack_but_can_be_named():
    with pytest.raises(LayerStackNotFound, match="'layers'"):
        find_layer_stack(Mixed())
    s = Session.create(Mixed(), (torch.randn(2, 8),), lambda y: y.sum(), layers="layers")
    assert s.stack.num_layers == 3


def test_unknown_stack_name_lists_candidates():
    with pytest.raises(LayerStackNotFound, match="transformer.h") as e:
        find_layer_stack(Mixed(), "transformer.h")
    assert "'layers'" in str(e.value)


@pytest.mark.parametrize("k", [0, -1, 9, 2.0, True])
def test_bad_uniform_k_names_L(k):
    with pytest.raises(InvalidSchedule, match=r"L=8"):
        schedule.uniform(k, 8)


@pytest.mark.parametrize("n", [-1, 9, None])
def test_bad_block_n_names_L(n):
    with pytest.raises(InvalidSchedule, match=r"L=8"):
        schedule.block(n, 8)


def test_schedule_for_wrong_stack_refused():
    from remat_pass.models import linear_chain

    s = Session.create(*linear_chain(batch=4, width=8, layers=3))
    with pytest.raises(InvalidSchedule, match="L=3"):
        s.prepare(schedule.uniform(2, 4))


def test_invalid_groups_refused():
    with pytest.raises(InvalidSchedule, match="consecutive"):
        schedule.optimized(((0, 2),), 4)
    with pytest.raises(InvalidSchedule, match="outside"):
        schedule.optimized(((3, 4),), 4)
    with pytest.raises(InvalidSchedule, match="overlaps"):
        schedule.optimized(((0, 1), (1, 2)), 4)


def test_no_scalar_loss():
    with pytest.raises(RematError, match="scalar loss"):
        Session.create(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), (torch.randn(2, 4),))


def test_buffer_mutation_traced():
    """BatchNorm in train mode writes its running statistics in place (issue 23: was
    refused): traced functionally, each buffer's new value a forward output."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)])
    s = Session.create(model.train(), (torch.randn(3, 4),), lambda y: y.sum())
    assert sorted(s.joint.primal_labels[i] for i in s.joint.buffer_updates) == sorted(n for n, _ in model.named_buffers())
