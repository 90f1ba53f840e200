"""Liveness against hand counts and against the measured peak (exact on CPU)."""

from __future__ import annotations

import pytest
import torch

from remat_pass.recompute import schedule
from remat_pass.liveness.timeline import analyze
from remat_pass.measure.run import measure_step
from remat_pass.evaluate.session import Session

MIB = 2**20


def linear_chain_session(layers: int) -> Session:
    # Linear(512, 512, bias=False), batch 512, fp32: every activation, every
    # activation gradient and every weight gradient is exactly 1 MiB.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(layers)])
    x = torch.randn(512, 512)
    return Session.create(model, (x,), lambda y: y.sum())


@pytest.mark.parametrize("layers", [2, 4, 6])
def test_linear_chain_peak_matches_hand_count(layers):
    """Hand count for ``none`` on L bias-free Linear layers, loss = sum(y):

    Forward saves h_1..h_{L-1} (each layer's input; x is static) and frees h_L after
    the sum, so forward peaks at L MiB. Backward of layer i (the order AOTAutograd
    traces from MmBackward: weight gradient first, then input gradient):
      A: gW_i = mm(t(g_i), h_{i-1})  live: h_1..h_{i-1}, g_i, gW_{i+1..L}, gW_i
      B: g_{i-1} = mm(g_i, W_i)      live: h_1..h_{i-2}, g_i, gW_i..gW_L, g_{i-1}
    g_L = expand(tangent) is a view of a static scalar (0 bytes). For i < L, step A
    holds (i-1) + 1 + (L-i) + 1 = L+1 MiB, the peak; the 4-byte loss lives throughout.
    """
    session = linear_chain_session(layers)
    step, report, _ = session.prepare(schedule.none(layers))
    hand = (layers + 1) * MIB + 4
    assert report.peak_bytes == hand, report.timeline
    assert report.peak_phase == "backward"
    measured = measure_step(step, session.joint)
    assert measured.peak_bytes == report.peak_bytes
    # saved activations: h_1..h_{L-1}
    assert report.saved_activation_bytes == (layers - 1) * MIB
    # static: L weights + the input + the tangent scalar
    assert report.static_bytes == layers * MIB + MIB + 4


def test_views_share_storage_and_count_once():
    """A chain of views of one activation adds no bytes: peak equals the plain chain's."""

    class Viewy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            y = self.lin(x)
            return y.view(-1).view(32, 64).t().t().relu()

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(x).relu()

    peaks = []
    for cls in (Viewy, Plain):
        torch.manual_seed(0)
        model = torch.nn.Sequential(cls(), cls())
        s = Session.create(model, (torch.randn(32, 64),), lambda y: y.sum())
        step, report, _ = s.prepare(schedule.none(2))
        assert measure_step(step, s.joint).peak_bytes == report.peak_bytes
        peaks.append(report.peak_bytes)
    assert peaks[0] == peaks[1]


def test_cuda_allocator_rounds_each_block_to_512_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 7))
    s = Session.create(model, (torch.randn(11, 3),), lambda y: y.sum())
    step, cpu, _ = s.prepare(schedule.none(2))
    cuda = analyze(step, allocator="cuda")
    cpu_bytes = {t.name: t.nbytes for t in cpu.saved}
    # every storage here is under 512 bytes, so each is exactly one 512-byte block
    assert all(t.nbytes == 512 for t in cuda.live_at_peak)
    assert cuda.peak_bytes == 512 * len(cuda.live_at_peak)
    assert all(0 < b < 512 for b in cpu_bytes.values())
    assert [t.name for t in cuda.saved] == [t.name for t in cpu.saved]
    assert all(t.nbytes == 512 for t in cuda.saved)
    assert cuda.peak_bytes > cpu.peak_bytes
    with pytest.raises(ValueError, match="allocator"):
        analyze(step, allocator="tpu")


@pytest.mark.parametrize(
    "make", [lambda L: schedule.none(L), lambda L: schedule.uniform(2, L), lambda L: schedule.block(1, L)]
)
def test_prediction_equals_measurement_on_gpt2(gpt2_session, make):
    s = gpt2_session
    step, report, _ = s.prepare(make(s.stack.num_layers))
    m = measure_step(step, s.joint, seed=s.seed)
    assert m.peak_bytes == report.peak_bytes
    # the peak step's live tensors add up to the peak
    assert sum(t.nbytes for t in report.live_at_peak) == report.peak_bytes
    assert sum(report.live_at_peak_by_layer.values()) == report.peak_bytes
    assert report.timeline[report.peak_step].live_bytes == report.peak_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cuda_prediction_models_caching_allocator():
    from remat_pass.models import tiny_gpt

    model, (ids,), _ = tiny_gpt(batch=2, seq=32, layers=3, hidden=64, vocab=128)
    model = model.cuda()
    ids = ids.cuda()
    s = Session.create(model, (ids,), lambda y: y.float().logsumexp(-1).mean())
    step, _, _ = s.prepare(schedule.uniform(1, 3))
    report = analyze(step, allocator="cuda")
    m = measure_step(step, s.joint)
    assert abs(report.peak_bytes - m.peak_bytes) <= 0.03 * m.peak_bytes
