"""Graph constants in the liveness sweep (remat_pass/liveness/intervals.py): a constant
the step reads in many places (Megatron-Core's ``GlobalMemoryBuffer``: every layer's
``get_tensor`` is a view of one buffer) is one static storage, under every schedule,
however many get_attr nodes forward, recompute and backward read it through."""

from __future__ import annotations

import torch
from torch import nn

from remat_pass.evaluate.session import Session
from remat_pass.recompute import schedule


class SharedBuffer:
    """A preallocated buffer handed out as views (as ``GlobalMemoryBuffer.get_tensor``)."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(4 * 16)

    def get_tensor(self, shape: tuple[int, int]) -> torch.Tensor:
        return self.buffer[0:shape[0] * shape[1]].view(*shape)


class Layer(nn.Module):
    def __init__(self, buffer: SharedBuffer | None) -> None:
        super().__init__()
        self.lin, self.buffer = nn.Linear(16, 16), buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.buffer is not None:  # baddbmm(buffer, ..., beta=0) in Megatron's attention
            y = torch.addmm(self.buffer.get_tensor((4, 16)), y, self.lin.weight, beta=0.0)
        return torch.tanh(y)


class Stack(nn.Module):
    def __init__(self, readers: int) -> None:
        super().__init__()
        shared = SharedBuffer()
        self.layers = nn.ModuleList(Layer(shared if i < readers else None) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _static_bytes(readers: int, sch: schedule.Schedule) -> tuple[int, int]:
    torch.manual_seed(0)
    session = Session.create(Stack(readers), (torch.randn(4, 16),), layers="layers", calibration=None)
    step, report, _ = session.prepare(sch)
    constants = sum(n.op == "get_attr" for g in (step.forward, step.backward) for n in g.graph.nodes)
    return report.static_bytes, constants


def test_a_constant_read_by_every_layer_is_one_static_storage():
    for sch in (schedule.none(3), schedule.uniform(1, 3)):
        one, one_reads = _static_bytes(1, sch)
        three, three_reads = _static_bytes(3, sch)
        assert three_reads > one_reads >= 1  # more nodes read the one buffer...
        assert three == one, sch.provenance  # ...which is counted once
