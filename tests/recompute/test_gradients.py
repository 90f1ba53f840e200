"""Gradients of every schedule against the un-rewritten step and eager autograd."""

from __future__ import annotations

import pytest
import torch

from remat_pass.measure.run import grads_bitwise_equal, max_abs_diff, run_step
from remat_pass.evaluate.session import megatron_schedules


def _check_all_schedules(session, eager_tol):
    L = session.stack.num_layers
    for sch in megatron_schedules(L):
        step, report, _ = session.prepare(sch)
        torch.manual_seed(session.seed)
        outs, grads = run_step(step, session.joint)
        assert grads_bitwise_equal(grads, session.reference_grads), sch.provenance
        n = session.joint.num_params
        assert all(g is not None for g in grads[:n]), sch.provenance
        assert max_abs_diff(grads[:n], session.eager_param_grads) <= eager_tol, sch.provenance


@pytest.mark.slow
def test_every_schedule_gpt2_transformers(gpt2_session):
    # GPT-2 from transformers with dropout 0.1: the random ops are replayed
    s = gpt2_session
    assert s.stack.path == "transformer.h" and s.stack.num_layers == 3
    _check_all_schedules(s, eager_tol=1e-4)


@pytest.mark.slow
def test_every_schedule_hand_written_gpt(tiny_gpt_session):
    s = tiny_gpt_session
    assert s.stack.path == "blocks" and s.stack.num_layers == 5
    _check_all_schedules(s, eager_tol=1e-4)


def test_recompute_really_happens(tiny_gpt_session):
    """uniform(K) recomputes; none does not; the saved set shrinks."""
    s = tiny_gpt_session
    from remat_pass.recompute import schedule

    none_step, none_rep, _ = s.prepare(schedule.none(5))
    uni_step, uni_rep, _ = s.prepare(schedule.uniform(1, 5))
    assert not none_step.segments and none_rep.recompute_flops == 0
    assert len(uni_step.segments) == 5
    assert uni_rep.recompute_flops > 0
    assert uni_rep.saved_activation_bytes < none_rep.saved_activation_bytes
    # segments run in backward order: the last group first
    assert [seg.group for seg in uni_step.segments] == [4, 3, 2, 1, 0]


def test_gpt2_eager_diff_reported(gpt2_session):
    r = gpt2_session.evaluate(megatron_schedules(3)[2])
    assert r.grads_equal
    assert 0 <= r.max_grad_diff_vs_eager <= 1e-4
