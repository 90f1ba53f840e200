"""Why the bytes at a program's peak are live there (``liveness.eager_program.peak_cause``),
for the eager program and the rewrite, and their difference by cause (issue 19, item 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from remat_pass.evaluate.eager_program import peak_difference_by_cause, rewrite_live_by_cause
from remat_pass.evaluate.session import Session
from remat_pass.graph.eager_trace import record_eager_step
from remat_pass.liveness.eager_program import PEAK_CAUSES, eager_peak, peak_cause
from remat_pass.memory.memory_model import MemoryModel
from remat_pass.recompute import schedule as schedules

N = 1 << 16  # elements of every vector: 256 KiB in fp32
VECTOR = 4 * N


class KeepOnContext(torch.autograd.Function):
    """``sin(x)`` that keeps ``2 x`` on its context and never reads it: eager frees it only
    when autograd frees the node, after backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.kept = x * 2
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(N))

    def forward(self, x):
        return KeepOnContext.apply(x * self.w)


class Holds(nn.Module):
    """Two layers ``sin(x * w)`` keeping ``2 x w`` on their contexts; the loss is the sum."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("args, cause", [
    ((False, False, False, True, False, False), "held outputs"),
    ((False, False, False, False, False, False), "the rest"),  # a .grad, the loss: the step keeps it
    ((True, False, False, True, True, False), "the rest"),  # the peak op's own output
    ((False, True, False, True, True, True), "in-place reuse"),
    ((False, True, False, True, False, True), "copies"),
    ((False, False, True, True, False, False), "the rest"),  # read again later: in use
])
def test_the_cause_rules(args, cause):
    assert peak_cause(*args) == cause


def test_eager_holds_what_a_context_keeps_and_the_rewrite_does_not():
    """Counted by hand from the recording. Per layer, forward: ``h = x * w``, ``kept = 2 h``
    (on the context), ``y = sin h``; the loss ``y.sum()``. Eager's peak is layer 1's
    ``g = ones * cos(h1)``. Live there: layer 0's ``h0`` (read later by its ``cos``) and
    output (read later by ``grad w1``), ``g`` and the ``ones`` (4 B): the rest; ``cos(h1)``,
    read for the last time by the op, which makes ``g`` of its size: in-place reuse;
    ``kept0``, ``kept1`` (never read), ``h1`` (last read by ``cos``, freed when the node
    ends) and the loss (the caller's, 4 B, last read by ``ones_like``): held outputs.
    The rewrite frees every storage at its last read: none held, so ``rewrite - eager``
    of held outputs is minus eager's; each side's causes sum to its own peak."""
    model, x = Holds(), torch.randn(N)
    eager = eager_peak(record_eager_step(model, (x,), None), MemoryModel.table_only("cpu"))
    assert dict(eager.live_at_peak_causes) == {"in-place reuse": VECTOR, "copies": 0,
                                               "held outputs": 3 * VECTOR + 4, "dropout masks": 0,
                                               "the rest": 3 * VECTOR + 4}
    assert eager.peak_bytes == 7 * VECTOR + 8
    step, report, _ = Session.create(model, (x,), None).prepare(schedules.none(2))
    rewrite = rewrite_live_by_cause(step, report)
    assert set(rewrite) == set(PEAK_CAUSES) and rewrite["held outputs"] == 0
    assert sum(rewrite.values()) == report.peak_bytes
    diff = dict(peak_difference_by_cause(eager, rewrite))
    assert diff["held outputs"] == -(3 * VECTOR + 4)
    assert sum(diff.values()) == report.peak_bytes - eager.peak_bytes


class Copies(nn.Module):
    """``c = copy of x * w`` saved by ``sin`` (read again in backward), then a temporary
    eight times its size: the forward's peak holds ``c``."""

    def __init__(self, cast: bool):
        super().__init__()
        self.cast = cast
        self.w = nn.Parameter(torch.ones(N))

    def forward(self, x):
        h = x * self.w
        c = h.double() if self.cast else h.clone()
        return c.sin().repeat(8).sum()


def test_a_copy_live_at_the_peak_is_a_copy():
    """``clone`` live at the peak and read later is a copy (one vector); a cast
    (``double``, a ``_to_copy`` that changes the dtype) is not."""
    memory = MemoryModel.table_only("cpu")
    copies = [dict(eager_peak(record_eager_step(Copies(cast), (torch.randn(N),), None),
                              memory).live_at_peak_causes)["copies"] for cast in (False, True)]
    assert copies == [VECTOR, 0]


class Drops(nn.Module):
    """Two layers ``dropout(x * w, 0.5)``; the loss is the sum."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([DropLayer(), DropLayer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class DropLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(N))

    def forward(self, x):
        return torch.nn.functional.dropout(x * self.w, 0.5, True)


def test_dropout_keeps_a_float_noise_on_the_cpu_and_a_bool_mask_on_cuda():
    """Eager dropout on the CPU fills a noise tensor of the input's dtype
    (``bernoulli_``: 4 B per element here), on CUDA ATen's fused ``native_dropout`` saves a
    bool mask (1 B), which the CUDA target records (``eager_kernels_on_cuda``); one mask is
    live at each peak. The CUDA figure counts the caching allocator's 512-byte blocks."""
    from remat_pass.memory.cuda_target import GpuSpec, eager_kernels_on_cuda

    model, x = Drops(), torch.randn(N)
    cpu_trace = record_eager_step(model, (x,), None)
    cuda_trace = record_eager_step(model, (x,), None, kernels=lambda: eager_kernels_on_cuda(GpuSpec()))
    names = [{str(n.target).split(".")[1] for n in t.op_nodes} for t in (cpu_trace, cuda_trace)]
    assert "bernoulli_" in names[0] and "native_dropout" not in names[0]
    assert "native_dropout" in names[1] and "bernoulli_" not in names[1]
    cpu = eager_peak(cpu_trace, MemoryModel.table_only("cpu"))
    cuda = eager_peak(cuda_trace, MemoryModel.table_only("cuda"))
    assert dict(cpu.live_at_peak_causes)["dropout masks"] == 4 * N
    assert dict(cuda.live_at_peak_causes)["dropout masks"] == N
    assert all(b % 512 == 0 for _, b in cuda.live_at_peak)
    assert torch.nn.functional.dropout.__module__ == "torch.nn.functional"  # restored


def test_the_cuda_target_counts_no_host_memory():
    """Under checkpoint (uniform K=1) each checkpointed call stashes the CPU RNG state
    (``torch.get_rng_state``: 5,056 B, host memory): counted on the CPU target, 0 bytes in
    the GPU's memory; the CUDA row says it was predicted, not run."""
    from remat_pass.evaluate.eager_program import ON_CUDA, eager_program
    from remat_pass.memory.cuda_target import GpuSpec

    model, x = Drops(), torch.randn(N)
    cpu, cuda = (eager_program(model, (x,), None, schedules.uniform(1, 2), gpu=gpu, measure=False)
                 for gpu in (None, GpuSpec()))
    assert dict(cpu.predicted.live_at_peak_ops)["get_rng_state"] == 2 * 5056
    assert dict(cuda.predicted.live_at_peak_ops).get("get_rng_state", 0) == 0
    assert cuda.measured_peak_bytes is None and ON_CUDA in cuda.predicted.notes
