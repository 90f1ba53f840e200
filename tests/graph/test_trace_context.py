"""What a concrete trace runs under (remat_pass/graph/trace_context.py): a scalar computed
only from the graph's constants is known (Megatron-Core's RNG-tracker check), one that
depends on an input stays data-dependent; ``torch.distributed.all_reduce`` is traced as a
functional collective, so its effect token is never taken for an input mutation, and the
step sweeps exactly on a gloo group of one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from remat_pass.evaluate.session import Session
from remat_pass.graph.trace import trace_joint
from remat_pass.recompute.schedule import distinct_megatron_schedules


class ForkCheck(nn.Module):
    """Two Linear layers; around the first, the check of Megatron-Core's
    ``CudaRNGStatesTracker.fork``: ``torch.all(state == torch.get_rng_state()).item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.get_rng_state()
        x = torch.dropout(self.layers[0](x), 0.1, True)
        if not torch.all(state == torch.get_rng_state()).item():
            x = x * 2  # a branch the trace must not take: the states are equal
        return self.layers[1](x).sum()


def test_a_scalar_computed_from_constants_is_known_when_tracing():
    model = ForkCheck()
    joint = trace_joint(model, (torch.randn(4, 8),))
    targets = [str(n.target) for n in joint.gm.graph.nodes if n.op == "call_function"]
    assert not any("_local_scalar_dense" in t for t in targets)
    session = Session.create(model, (torch.randn(4, 8),), layers="layers")
    r = session.evaluate(distinct_megatron_schedules(session.stack.layers_per_stack)[1])
    assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes


def test_a_scalar_of_an_input_stays_data_dependent():
    """Known constants do not cover a scalar of an input: it is data-dependent, so the
    graph is specialized to this batch's value (``data_scalars``) and says so."""
    class OnInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y.sum() if (x.sum() > 0).item() else -y.sum()

    joint = trace_joint(OnInput(), (torch.randn(2, 4),))
    assert len(joint.specialized) == 1 and "test_trace_context.py" in joint.specialized[0]


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A gloo default group of world size 1, destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'rdzv')}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class ReducedLoss(nn.Module):
    """Two Linear layers, then the max-reduction of Megatron's vocab-parallel cross
    entropy: ``torch.distributed.all_reduce(logits_max, op=MAX)`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        m = x.max(dim=-1)[0].detach()
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return (x - m.unsqueeze(-1)).exp().sum()


def test_all_reduce_is_a_functional_collective_not_an_input_mutation(gloo_world_of_one):
    original = dist.all_reduce
    joint = trace_joint(ReducedLoss(), (torch.randn(4, 8),))
    assert dist.all_reduce is original
    assert joint.num_fwd_outputs == 1 and len(joint.primals) == len(joint.primal_values)
    targets = [str(n.target) for n in joint.gm.graph.nodes if n.op == "call_function"]
    assert "_c10d_functional.all_reduce.default" in targets and "_c10d_functional.wait_tensor.default" in targets
    assert not any("with_effects" in t for t in targets)


def test_a_step_with_an_all_reduce_sweeps_exactly(gloo_world_of_one):
    torch.manual_seed(0)
    session = Session.create(ReducedLoss(), (torch.randn(4, 8),), layers="layers")
    for schedule in distinct_megatron_schedules(session.stack.layers_per_stack):
        for _ in range(3):  # the measured free of the reduced tensor is not left to gloo's thread
            r = session.evaluate(schedule)
            assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, schedule.provenance


class _Block(nn.Module):
    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.drop(self.lin(x)))


class _Stack(nn.Module):
    def __init__(self, drop: type[nn.Module] | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(nn.Dropout(0.0) if drop else nn.Identity()) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_dropout_at_p0_adds_no_bytes():
    """Eager dropout at p = 0 returns its input; AOTAutograd's decomposition cloned it
    (one more saved activation per layer). Now the step with nn.Dropout(0.0) is the step
    without it, byte for byte, predicted == measured, gradients bitwise equal."""
    from remat_pass.recompute import schedule

    torch.manual_seed(0)
    with_dropout = _Stack(nn.Dropout)
    without = _Stack(None)
    without.load_state_dict(with_dropout.state_dict())
    x = torch.randn(64, 16)
    joint = trace_joint(with_dropout, (x,))
    assert not [n for n in joint.gm.graph.nodes if n.target == torch.ops.aten.clone.default]
    results = []
    for model in (with_dropout, without):
        session = Session.create(model, (x,), None)
        results.append([session.evaluate(s) for s in (schedule.none(3), schedule.uniform(1, 3))])
    for a, b in zip(*results):
        assert a.predicted_peak_bytes == b.predicted_peak_bytes == a.measured_peak_bytes
        assert a.grads_equal
