"""The rewrite (remat_pass/recompute/rewrite.py) on its own: what each node of the
rewritten graphs is (forward, recompute, backward), what forward returns for backward,
and a Partition that would change gradients refused before anything is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remat_pass.errors import InvalidSchedule
from remat_pass.graph.regions import assign_layers
from remat_pass.graph.trace import trace_joint
from remat_pass.models import linear_chain
from remat_pass.recompute import schedule
from remat_pass.recompute.partition import partition
from remat_pass.recompute.rewrite import rewrite


@pytest.fixture(scope="module")
def chain():
    model, inputs, loss_fn = linear_chain(batch=4, width=8, layers=4)
    joint = trace_joint(model, inputs, loss_fn)
    return joint, assign_layers(joint)


def _kinds(step, graph):
    return [step.kind_of[n.name] for n in graph.graph.nodes if n.op == "call_function"]


def test_what_each_schedule_saves_and_recomputes(chain):
    """Four Linear layers, loss = sum of the output. A Linear's backward reads its input
    (for the weight gradient) and its weight transposed (for the input gradient), so:
    none saves every layer's input but the first (a primal) and every transpose but the
    first's (layer 0's input gradient is not needed); uniform(2) saves only group 1's input
    (addmm_1) and rebuilds each group whole before its backward, group 1 first; uniform(1)
    saves every layer's input and rebuilds only the transposes (views of parameters)."""
    joint, stack = chain
    none = rewrite(joint, stack, schedule.none(4))
    assert none.saved == ("addmm", "t_1", "addmm_1", "t_2", "addmm_2", "t_3")
    assert "recompute" not in _kinds(none, none.backward) and set(_kinds(none, none.forward)) == {"forward"}
    uni2 = rewrite(joint, stack, schedule.uniform(2, 4))
    assert uni2.saved == ("addmm_1",)
    assert [(s.group, s.nodes, s.checkpoints) for s in uni2.segments] == [
        (1, ("t_2", "addmm_2", "t_3"), ("addmm_1",)), (0, ("t", "addmm", "t_1"), ())]
    assert {uni2.layer_of[n.name] for n in uni2.backward.graph.nodes
            if uni2.kind_of.get(n.name) == "recompute"} == {0, 1, 2, 3}
    uni1 = rewrite(joint, stack, schedule.uniform(1, 4))
    assert uni1.saved == ("addmm", "addmm_1", "addmm_2")
    assert [s.nodes for s in uni1.segments] == [("t_3",), ("t_2",), ("t_1",)]


def test_forward_returns_the_loss_then_the_saved_values(chain):
    joint, stack = chain
    for sched in (schedule.none(4), schedule.uniform(1, 4), schedule.block(2, 4)):
        step = rewrite(joint, stack, sched)
        (out,) = [n for n in step.forward.graph.nodes if n.op == "output"]
        returned = [a.name for a in out.args[0]]
        assert returned == ["sum_1", *step.saved] and step.num_fwd_outputs == 1
        assert {s.name for s in step.partition.saved} == set(step.saved)


def test_uniform_saves_less_than_none(chain):
    joint, stack = chain
    saved = {s.provenance: len(rewrite(joint, stack, s).saved)
             for s in (schedule.none(4), schedule.uniform(1, 4), schedule.uniform(4, 4))}
    assert saved["uniform(K=4)"] < saved["uniform(K=1)"] < saved["none"]


def test_a_partition_that_drops_a_value_backward_reads_is_refused(chain):
    """uniform(2)'s Partition with group 1's checkpoint (addmm_1) no longer saved: its
    recompute would read a value neither saved nor recomputed. The rewrite refuses it (it
    would change gradients)."""
    joint, stack = chain
    p = partition(joint, stack, schedule.uniform(2, 4))
    dropped = dataclasses.replace(p, saved=tuple(s for s in p.saved if s.name != "addmm_1"))
    assert len(dropped.saved) == len(p.saved) - 1
    with pytest.raises(InvalidSchedule, match="reads addmm_1, which is neither"):
        rewrite(joint, stack, dropped)


def test_a_schedule_for_another_stack_length_is_refused(chain):
    joint, stack = chain
    with pytest.raises(InvalidSchedule, match="L=3|3 layers"):
        rewrite(joint, stack, schedule.uniform(1, 3))


def test_the_joint_graph_is_not_modified(chain):
    joint, stack = chain
    before = [(n.name, n.op, str(n.target)) for n in joint.gm.graph.nodes]
    rewrite(joint, stack, schedule.uniform(2, 4))
    assert [(n.name, n.op, str(n.target)) for n in joint.gm.graph.nodes] == before
    assert torch.is_tensor(joint.primal_values[0])
