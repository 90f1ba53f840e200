"""The measuring path (remat_pass/measure/run.py) on its own: the profiler's running sum
against allocations counted by hand, a rewritten step's gradients against eager autograd
and its measured peak against liveness, and the gradient comparisons' negative controls."""

from __future__ import annotations

import pytest
import torch

from remat_pass.graph.regions import assign_layers
from remat_pass.graph.trace import trace_joint
from remat_pass.liveness.timeline import analyze
from remat_pass.measure.run import (
    eager_grads,
    grads_bitwise_equal,
    max_abs_diff,
    measure_step,
    profiled_peak_cpu,
    run_joint,
)
from remat_pass.models import linear_chain
from remat_pass.recompute import schedule
from remat_pass.recompute.rewrite import rewrite

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def test_profiled_peak_is_the_hand_count_of_live_bytes():
    """fp32 tensors of 1000, 2000 and 500 elements: 4,000 B, then 12,000 B live, the first
    freed (8,000 B), then 10,000 B: the peak is 12,000 B above the start, exactly (CPU)."""

    def step() -> None:
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a
        c = torch.empty(500)
        del b, c

    step()  # warm up
    peak, running = profiled_peak_cpu(step)
    assert peak == 12_000
    assert running[:4] == [4_000, 12_000, 8_000, 10_000]
    assert running[-1] == 0  # everything the step allocated it freed


@pytest.mark.parametrize("sched", [schedule.none(3), schedule.uniform(1, 3), schedule.block(2, 3)],
                         ids=lambda s: s.provenance)
def test_measured_step_equals_eager_and_liveness(sched):
    """A rewritten Linear chain: the loss and parameter gradients are eager autograd's bit
    for bit, and the measured peak is the liveness prediction."""
    model, inputs, loss_fn = linear_chain(batch=4, width=16, layers=3)
    joint = trace_joint(model, inputs, loss_fn)
    stack = assign_layers(joint)
    step = rewrite(joint, stack, sched)
    m = measure_step(step, joint)
    loss, grads = eager_grads(model, inputs, loss_fn)
    assert torch.equal(m.loss, loss)
    assert grads_bitwise_equal(m.grads[: joint.num_params], grads)
    assert m.peak_bytes == analyze(step, "cpu").peak_bytes


def test_the_rewritten_step_equals_the_joint_graph():
    model, inputs, loss_fn = linear_chain(batch=4, width=16, layers=3)
    joint = trace_joint(model, inputs, loss_fn)
    step = rewrite(joint, assign_layers(joint), schedule.uniform(2, 3))
    _, joint_grads = run_joint(joint)
    assert grads_bitwise_equal(measure_step(step, joint).grads, joint_grads)


def test_gradient_comparisons_see_one_ulp_and_a_missing_gradient():
    """Negative controls: a gradient one ulp off is not bitwise equal; a missing one is
    an infinite difference."""
    g = torch.linspace(0.1, 1.0, 10)
    off = g.clone()
    off[3] = torch.nextafter(off[3], torch.tensor(2.0))
    assert grads_bitwise_equal([g, None], [g.clone(), None])
    assert not grads_bitwise_equal([g], [off])
    assert 0 < max_abs_diff([g], [off]) < 1e-6
    assert max_abs_diff([g], [None]) == float("inf")
    assert not grads_bitwise_equal([g], [None])
    assert not grads_bitwise_equal([g], [g, g])


def test_gradient_comparisons_are_of_bit_patterns():
    """A NaN gradient equals the same NaN (a model whose own gradients overflow is not
    wrongly rewritten); -0.0 is not 0.0; complex and half values compare by their bits."""
    g = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    assert grads_bitwise_equal([g], [g.clone()])
    assert not grads_bitwise_equal([torch.tensor([0.0])], [torch.tensor([-0.0])])
    assert not grads_bitwise_equal([g], [torch.tensor([1.0, 0.0, float("inf"), -float("inf")])])
    for t in (g.to(torch.bfloat16), g.to(torch.float16), torch.complex(g, g), torch.arange(4)):
        assert grads_bitwise_equal([t], [t.clone()])
    assert grads_bitwise_equal([g[::2]], [g[::2].clone()])



def test_a_refusal_names_only_strides_that_matter():
    """A size-1 dimension's stride never moves an element: a scalar tangent's expand to
    ``[2, 1, 2]`` is ``(0, 1, 0)`` traced and ``(0, 0, 0)`` on the CPU, the same layout,
    which the refusal used to name as the first value whose layout differs (the long
    profile's group-norm refusals, whose real cause was softplus_backward); a stride that
    differs in a dimension of size above 1 is named."""
    import torch.fx as fx

    from remat_pass.measure.run import _stride_mismatch

    g = fx.Graph()
    node = g.call_function(torch.ops.aten.expand.default, ())
    node.meta["val"] = torch.empty(()).expand(2, 1, 2).as_strided((2, 1, 2), (0, 1, 0))
    assert _stride_mismatch(node, torch.empty(()).expand(2, 1, 2)) is None
    node.meta["val"] = torch.empty(2, 7, 2)
    said = _stride_mismatch(node, torch.empty(2, 2, 7).transpose(1, 2))
    assert said is not None and "traced strides (14, 2, 1), real (14, 1, 7)" in said
