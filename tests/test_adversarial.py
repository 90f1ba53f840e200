"""Adversarial models: odd module structures, dtypes, RNG, aliasing and losses.

Every test sweeps ``none``, every uniform K and every block N
(``megatron_schedules(L)``) on a tiny model and requires, for each schedule, either

- a result with gradients bitwise equal to the un-rewritten joint graph, parameter
  gradients close to eager autograd, and a predicted peak equal to the measured peak
  (exact on CPU), or
- a ``RematError`` subclass with a message (UnsupportedGraph, LayerStackNotFound,
  InvalidSchedule).

Anything else (a wrong gradient, an inexact prediction, a non-remat exception, a layer
silently left out of the stack) fails. Cases that expose a known bug are marked
``xfail(strict=True)`` with the bug in the reason, so they flip when it is fixed.

Schedules with the same recomputed groups are one rewrite (``none`` = ``block(N=0)``,
``uniform(K=1)`` = ``block(N=L)``), so each distinct group set is evaluated once.
Models are tiny (batch 4, seq 8, width 16, 1-4 layers) to keep the file fast.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat_pass import schedule as schedules
from remat_pass.errors import InvalidSchedule, LayerStackNotFound, RematError, UnsupportedGraph
from remat_pass.sweep import Session, megatron_schedules

B, T, D = 4, 8, 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared 2-core machine, OpenMP spin-waiting makes these
    tiny graphs 10-20x slower with the default thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _x(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (B, T, D)), generator=g).to(dtype)


def sq(y: torch.Tensor) -> torch.Tensor:
    """A loss with no Python-scalar ops in its forward or backward."""
    return (y * y).sum()


def _distinct_schedules(num_layers: int) -> list[schedules.Schedule]:
    out, seen = [], set()
    for s in megatron_schedules(num_layers):
        if s.groups not in seen:
            seen.add(s.groups)
            out.append(s)
    return out


def sweep_model(
    model: nn.Module,
    inputs,
    loss_fn=None,
    layers: str | None = None,
    *,
    num_layers: int | None = None,
    uncalled: tuple[int, ...] = (),
    allow_refusal: bool = False,
    eager_tol: float = 1e-5,
) -> Session | None:
    """Create a Session and evaluate every distinct Megatron schedule.

    Returns the Session, or None when Session.create refused with a RematError and
    ``allow_refusal``. Fails on any schedule with differing gradients, an inexact
    peak, or a non-remat exception; also when a layer of the stack (other than
    ``uncalled``) received no node of the graph (a silent miss).
    """
    torch.manual_seed(0)
    try:
        session = Session.create(model, inputs, loss_fn, layers=layers)
    except RematError as e:
        assert allow_refusal, f"Session.create refused: {type(e).__name__}: {e}"
        assert str(e), "a RematError without a message"
        return None
    L = session.stack.num_layers
    if num_layers is not None:
        assert L == num_layers, f"stack {session.stack.path!r} has L={L}, expected {num_layers}"
    empty = [i for i in range(L) if not session.stack.nodes_of_layer(i)]
    assert empty == list(uncalled), (
        f"layers {empty} of {session.stack.path!r} hold no graph node (expected {list(uncalled)})"
    )
    problems = []
    for sch in _distinct_schedules(L):
        try:
            r = session.evaluate(sch, strict=False)
        except RematError as e:
            assert str(e), f"{sch.provenance}: RematError without a message"
            continue
        if not r.grads_equal:
            problems.append(f"{sch.provenance}: gradients differ from the un-rewritten graph")
        elif r.predicted_peak_bytes != r.measured_peak_bytes:
            problems.append(
                f"{sch.provenance}: predicted {r.predicted_peak_bytes} B != measured "
                f"{r.measured_peak_bytes} B (peak at {r.peak_phase} {r.peak_node})"
            )
        if not r.max_grad_diff_vs_eager <= eager_tol:
            problems.append(f"{sch.provenance}: max |grad - eager| {r.max_grad_diff_vs_eager:.3g}")
    assert not problems, "\n".join(problems)
    return session


class Block(nn.Module):
    """Linear -> tanh -> Linear plus residual."""

    def __init__(self, d: int = D, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, out or d)
        self.res = out is None or out == d

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y + x if self.res else y


class Stack(nn.Module):
    """``blocks`` called in order, loss ``sq`` of the output (or the output itself)."""

    def __init__(self, blocks, return_hidden: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.return_hidden = return_hidden

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x if self.return_hidden else sq(x)


def _stack(n: int = 3, cls=Block) -> Stack:
    torch.manual_seed(0)
    return Stack([cls() for _ in range(n)])


def test_plain_stack_baseline():
    sweep_model(_stack(3), (_x(),), num_layers=3)


# ---- 1. one module instance used several times --------------------------------------


def test_same_instance_twice_in_modulelist():
    """Refused (LayerStackNotFound) or swept as 3 layers; the model is never altered.
    (Bug fixed in 1785695: tracing left a FunctionalTensor in the shared block.)"""
    torch.manual_seed(0)
    b = Block()
    model = Stack([b, b, Block()])
    weight = b.fc1.weight
    try:
        sweep_model(model, (_x(),), num_layers=3, allow_refusal=True)
    finally:
        assert b.fc1.weight is weight, "tracing replaced the model's own parameter"


def test_block_called_twice_in_forward():
    class Twice(Stack):
        def forward(self, x):
            x = self.blocks[0](self.blocks[0](x))
            for b in self.blocks[1:]:
                x = b(x)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Twice([Block() for _ in range(3)]), (_x(),), num_layers=3)


def test_first_block_called_again_after_the_last():
    class Again(Stack):
        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return sq(self.blocks[0](x))

    torch.manual_seed(0)
    sweep_model(Again([Block() for _ in range(3)]), (_x(),), num_layers=3)


def test_stack_called_in_reverse_order():
    class Reverse(Stack):
        def forward(self, x):
            for b in reversed(self.blocks):
                x = b(x)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Reverse([Block() for _ in range(3)]), (_x(),), num_layers=3)


# ---- 2. skips across layers, per-layer losses ----------------------------------------


def test_unet_skip_connections():
    class UNet(Stack):
        def forward(self, x):
            outs = []
            for i, b in enumerate(self.blocks):
                if i == 2:
                    x = x * outs[1]
                if i == 3:
                    x = x + outs[0]
                x = b(x)
                outs.append(x)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(UNet([Block() for _ in range(4)]), (_x(),), num_layers=4)


def test_per_layer_auxiliary_loss():
    class Aux(Stack):
        def forward(self, x):
            loss = 0
            for b in self.blocks:
                x = b(x)
                loss = loss + sq(x)
            return loss

    torch.manual_seed(0)
    sweep_model(Aux([Block() for _ in range(3)]), (_x(),), num_layers=3)


def test_layer_reads_previous_layers_internal_value():
    class Gated(Block):
        def forward(self, x, prev_h):
            h = torch.tanh(self.fc1(x))
            if prev_h is not None:
                h = h * prev_h
            return self.fc2(h) + x, h

    class Net(Stack):
        def forward(self, x):
            h = None
            for b in self.blocks:
                x, h = b(x, h)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Net([Gated() for _ in range(3)]), (_x(),), num_layers=3)


def test_outer_ops_between_and_inside_layers():
    class Shared(nn.Module):
        def __init__(self, proj):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.__dict__["proj"] = proj  # an outer module, not a child of the layer

        def forward(self, x):
            return self.fc(torch.tanh(self.proj(x))) + x

    class Net(Stack):
        def __init__(self):
            proj = nn.Linear(D, D)
            super().__init__([Shared(proj) for _ in range(3)])
            self.proj = proj
            self.mid = nn.Linear(D, D)

        def forward(self, x):
            for i, b in enumerate(self.blocks):
                x = b(x)
                if i == 1:
                    x = torch.relu(self.mid(x))
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Net(), (_x(),), num_layers=3)


def test_encoder_decoder_two_stacks():
    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(D, D)
            self.k = nn.Linear(D, D)

        def forward(self, x, memory):
            a = torch.softmax(self.q(x) @ self.k(memory).transpose(-1, -2), -1)
            return a @ memory + x

    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList([Block() for _ in range(2)])
            self.dec = nn.ModuleList([Cross() for _ in range(3)])

        def forward(self, src, tgt):
            for b in self.enc:
                src = b(src)
            for b in self.dec:
                tgt = b(tgt, src)
            return sq(tgt)

    inputs = (_x(), _x(seed=2))
    torch.manual_seed(0)
    s = sweep_model(EncDec(), inputs, num_layers=3)
    assert s.stack.path == "dec"
    torch.manual_seed(0)
    sweep_model(EncDec(), inputs, layers="enc", num_layers=2)


def test_loss_reads_values_inside_layers():
    class Inner(Block):
        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            return self.fc2(h) + x, h

    class Net(Stack):
        def forward(self, x):
            hs = []
            for b in self.blocks:
                x, h = b(x)
                hs.append(h[:, :2])
            return sq(x) + sum(sq(h) for h in hs)

    torch.manual_seed(0)
    sweep_model(Net([Inner() for _ in range(3)]), (_x(),), num_layers=3)


# ---- 3. tuple / dict layers, shared side inputs --------------------------------------


def test_tuple_outputs_with_shared_mask_and_positions():
    class Attn(Block):
        def forward(self, x, mask, pos):
            y = self.fc1(x) + pos
            w = torch.softmax((y @ y.transpose(-1, -2)).masked_fill(mask, float("-inf")), -1)
            return self.fc2(w @ y) + x, w

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(T, D)
            self.blocks = nn.ModuleList([Attn() for _ in range(3)])

        def forward(self, x):
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            pos = self.pos(torch.arange(T))
            loss = 0
            for b in self.blocks:
                x, w = b(x, mask, pos)
                loss = loss + sq(w)
            return loss + sq(x)

    torch.manual_seed(0)
    sweep_model(Net(), (_x(),), num_layers=3)


def test_dict_in_dict_out_sequential():
    class DictBlock(Block):
        def forward(self, d):
            h = self.fc2(torch.relu(self.fc1(d["h"]))) + d["h"]
            return {"h": h, "stat": h.sum(-1)}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[DictBlock() for _ in range(3)])

        def forward(self, x):
            out = self.blocks({"h": x})
            return sq(out["h"]) + sq(out["stat"])

    torch.manual_seed(0)
    sweep_model(Net(), (_x(),), num_layers=3)


def test_integer_side_tensors():
    class IdBlock(Block):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, D)

        def forward(self, x, ids):
            return torch.tanh(self.fc1(x)) + self.emb(ids) + x

    class Net(Stack):
        def forward(self, x, ids):
            for b in self.blocks:
                x = b(x, ids)
                ids = torch.remainder(ids + 1, 10)
            return sq(x)

    torch.manual_seed(0)
    ids = torch.randint(0, 10, (B, T), generator=torch.Generator().manual_seed(1))
    sweep_model(Net([IdBlock() for _ in range(3)]), (_x(), ids), num_layers=3)


# ---- 4. in-place ops, views crossing layer boundaries --------------------------------


def test_inplace_ops_inside_layers():
    class InPlace(Block):
        def forward(self, x):
            y = self.fc1(x)
            y.relu_()
            z = self.fc2(y)
            z.add_(x)
            z.masked_fill_(x > 1.5, 0.0)
            return z

    sweep_model(_stack(3, InPlace), (_x(),), num_layers=3)


def test_layer_mutates_its_input_in_place():
    class Mut(Block):
        def forward(self, x):
            x.mul_(2)
            return torch.tanh(self.fc1(x)) + x

    class Net(Stack):
        def __init__(self):
            super().__init__([Mut() for _ in range(3)])
            self.pre = nn.Linear(D, D)

        def forward(self, x):
            return super().forward(self.pre(x))

    torch.manual_seed(0)
    sweep_model(Net(), (_x(),), num_layers=3)


def test_transposed_views_cross_layer_boundaries():
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):  # (B, D, T) view in, (B, D, T) view out
            h = x.transpose(1, 2)
            return (torch.tanh(self.fc(h)) + h).transpose(1, 2)

    class Net(Stack):
        def forward(self, x):
            x = x.transpose(1, 2)
            for b in self.blocks:
                x = b(x)
            return sq(x[..., ::2])

    torch.manual_seed(0)
    sweep_model(Net([Transposed() for _ in range(3)]), (_x(),), num_layers=3)


def test_layer_returns_slice_of_larger_tensor():
    class Slice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 3 * D)

        def forward(self, x):
            return torch.tanh(self.fc(x))[..., D : 2 * D]

    sweep_model(_stack(3, Slice), (_x(),), num_layers=3)


def test_view_chains_and_alias_returning_layer():
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return self.fc(x).view(B, T * D).view(B, T, D)

    class Alias(nn.Module):
        def forward(self, x):
            return x.view(x.shape)

    torch.manual_seed(0)
    model = Stack([Views(), Alias(), Views()])
    sweep_model(model, (_x(),), layers="blocks", num_layers=3)


def test_python_scalar_ops_at_the_peak():
    """(Bug fixed in 30d755d: the 12 B wrapped-scalar scratch was not modelled.)"""
    torch.manual_seed(0)
    model = Stack([Block() for _ in range(3)], return_hidden=True)
    # the loss's largest temporaries meet at mul.Scalar: it is the peak step
    sweep_model(model, (_x(),), lambda y: (y.repeat(1, 1, 8) * 0.5).sum(), num_layers=3)


@pytest.mark.xfail(
    strict=True,
    reason="pre-norm LayerNorm blocks: CPU native_layer_norm_backward allocates and frees "
    "per-thread dgamma/dbeta buffers (threads x 2 x D x 4 B: 128 B here on 1 thread, 256 B "
    "on 2), not modelled by costs.transient_bytes; uniform(K) peaks (at the first "
    "layer-norm backward) under-predicted by 128 B",
)
def test_prenorm_layernorm_blocks():
    class PreNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return self.fc(self.norm(x)) + x

    sweep_model(_stack(3, PreNorm), (_x(),), num_layers=3)


def test_user_hooks_on_layers():
    model = _stack(3)
    for b in model.blocks:
        b.register_forward_pre_hook(lambda mod, args: (torch.tanh(args[0]),))
        b.register_forward_hook(lambda mod, args, out: out * torch.sigmoid(out))
    sweep_model(model, (_x(),), num_layers=3)


def test_weight_norm_parametrization():
    from torch.nn.utils import parametrizations

    model = _stack(3)
    for b in model.blocks:
        parametrizations.weight_norm(b.fc1)
    sweep_model(model, (_x(),), num_layers=3)


@pytest.mark.xfail(
    strict=True,
    reason="orthogonal parametrization: CPU linalg_matrix_exp allocates scratch (4112 B "
    "forward, 49176 B for the 2n x 2n exp in backward) not modelled by "
    "costs.transient_bytes; peak under-predicted 20548 vs 69724 B measured (none, L=2)",
)
def test_orthogonal_parametrization():
    from torch.nn.utils import parametrizations

    model = _stack(2)
    for b in model.blocks:
        parametrizations.orthogonal(b.fc2)
    sweep_model(model, (_x(),), num_layers=2)


def test_spectral_norm_power_iteration_is_refused():
    from torch.nn.utils import parametrizations

    model = _stack(2)
    for b in model.blocks:
        parametrizations.spectral_norm(b.fc1)  # updates its u/v buffers in train mode
    with pytest.raises(UnsupportedGraph):
        Session.create(model, (_x(),), None)


# ---- 5. buffers ---------------------------------------------------------------------


def test_buffers_read_inside_layers():
    class Scaled(Block):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(D) + 0.5)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return torch.tanh(self.fc1(x)) * self.scale + x

    sweep_model(_stack(3, Scaled), (_x(),), num_layers=3)


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(T)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_batchnorm_train_mode_is_refused():
    with pytest.raises(UnsupportedGraph, match="BatchNorm|mutat"):
        Session.create(_stack(2, BNBlock), (_x(),), sq)


def test_buffer_written_in_place_is_refused():
    class Counter(Block):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(D))

        def forward(self, x):
            y = self.fc1(x)
            self.acc.add_(y.detach().mean((0, 1)))
            return y

    with pytest.raises(UnsupportedGraph):
        Session.create(_stack(2, Counter), (_x(),), sq)


@pytest.mark.xfail(
    strict=True,
    reason="BatchNorm eval on CPU: _native_batch_norm_legit_no_training allocates mean/invstd "
    "scratch (2 x C x 4 B = 64 B here) and native_batch_norm_backward an input-sized "
    "temporary (2048 B here), neither modelled by costs.transient_bytes; peak under-predicted",
)
def test_batchnorm_eval_mode():
    model = _stack(2, BNBlock)
    model.eval()
    sweep_model(model, (_x(),), num_layers=2)


# ---- 6. dtypes ------------------------------------------------------------------------


def test_float64():
    sweep_model(_stack(3).double(), (_x(dtype=torch.float64),), num_layers=3)


BF16_SCRATCH = (
    "bfloat16 on CPU: every addmm/mm allocates and frees a scratch buffer (~7.2 KB here with "
    "1 thread, 18 KB for 64x32 @ 32x32 with 2 threads) not modelled by "
    "costs.transient_bytes; peak under-predicted on every schedule"
)


@pytest.mark.xfail(strict=True, reason=BF16_SCRATCH)
def test_bfloat16():
    model = _stack(3).to(torch.bfloat16)
    sweep_model(model, (_x(dtype=torch.bfloat16),), lambda y: sq(y.float()), eager_tol=1e-1)


@pytest.mark.xfail(strict=True, reason=BF16_SCRATCH)
def test_bfloat16_layer_upcasts_to_float32():
    class Upcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            h = self.fc(x)
            return torch.softmax(h.float(), -1).to(x.dtype) * h + x

    model = _stack(3, Upcast).to(torch.bfloat16)
    sweep_model(model, (_x(dtype=torch.bfloat16),), lambda y: sq(y.float()), eager_tol=1e-1)


def test_float16_matmuls():
    # float16 CPU matmuls allocate no scratch, unlike bfloat16 (see test_bfloat16)
    model = _stack(2).to(torch.float16)
    sweep_model(model, (_x(dtype=torch.float16),), lambda y: sq(y.float()), eager_tol=1e-1)


# ---- 7. random ops --------------------------------------------------------------------


def test_random_ops_in_layers_and_outer_region():
    class Random(Block):
        def forward(self, x):
            h = nn.functional.dropout(torch.tanh(self.fc1(x)), 0.3, True)
            h = h * torch.rand_like(h) + torch.randn(h.shape)
            h = h * torch.bernoulli(torch.full_like(h, 0.7))
            perm = torch.randperm(h.shape[1])
            return self.fc2(h[:, perm]) + x

    class Net(Stack):
        def forward(self, x):
            x = nn.functional.dropout(x + torch.randn_like(x), 0.2, True)
            return super().forward(x)

    torch.manual_seed(0)
    s = sweep_model(Net([Random() for _ in range(3)]), (_x(),), num_layers=3)
    step, _, _ = s.prepare(schedules.uniform(1, 3))
    assert sum(len(seg.rng_replayed) for seg in step.segments) >= 3 * 4


def test_random_mask_passed_to_next_layer_and_loss():
    class Masked(Block):
        def forward(self, x, mask):
            h = torch.tanh(self.fc1(x))
            if mask is not None:
                h = h * mask
            return self.fc2(h) + x, torch.bernoulli(torch.full_like(h, 0.8)) * h

    class Net(Stack):
        def forward(self, x):
            mask = None
            for b in self.blocks:
                x, mask = b(x, mask)
            return sq(x) + sq(mask)

    torch.manual_seed(0)
    sweep_model(Net([Masked() for _ in range(3)]), (_x(),), num_layers=3)


def test_dropout_module_only():
    class Drop(Block):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.tanh(self.fc1(x))) + x

    sweep_model(_stack(3, Drop), (_x(),), num_layers=3)


# ---- 8. tied, frozen, input gradients --------------------------------------------------


class TiedLM(nn.Module):
    V = 40

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(D, self.V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, target):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, TiedLM.V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_tied_embedding_and_head():
    torch.manual_seed(0)
    sweep_model(TiedLM(), (_ids(1), _ids(2)), num_layers=3)


def test_frozen_layer():
    torch.manual_seed(0)
    model = TiedLM()
    model.blocks[1].requires_grad_(False)
    s = sweep_model(model, (_ids(1), _ids(2)), num_layers=3)
    labels, grads = s.joint.primal_labels, s.reference_grads
    frozen = [g for label, g in zip(labels, grads) if label.startswith("blocks.1.")]
    assert frozen and all(g is None for g in frozen)


def test_all_parameters_frozen_input_requires_grad():
    model = _stack(2)
    model.requires_grad_(False)
    x = _x().requires_grad_()
    s = sweep_model(model, (x,), num_layers=2)
    (ref,) = torch.autograd.grad(model(x), [x])
    assert (s.reference_grads[s.joint.primal_labels.index("input[0]")] - ref).abs().max() <= 1e-5


def test_input_requires_grad():
    model = _stack(3)
    x = _x().requires_grad_()
    s = sweep_model(model, (x,), num_layers=3)
    (ref,) = torch.autograd.grad(model(x), [x])
    i = s.joint.primal_labels.index("input[0]")
    assert (s.reference_grads[i] - ref).abs().max() <= 1e-5


def test_same_tensor_passed_twice_and_view_input():
    class Two(Stack):
        def forward(self, a, b):
            return super().forward(a + b)

    x = _x()
    torch.manual_seed(0)
    sweep_model(Two([Block() for _ in range(2)]), (x, x), num_layers=2)
    torch.manual_seed(0)
    sweep_model(Two([Block() for _ in range(2)]), (x, x[:, :, :]), num_layers=2)


def test_nested_list_and_dict_inputs():
    class Nested(Stack):
        def forward(self, batch):
            return super().forward(batch["x"][0] + batch["x"][1])

    torch.manual_seed(0)
    sweep_model(Nested([Block() for _ in range(2)]), ({"x": [_x(), _x(seed=5)]},), num_layers=2)


def test_no_grad_region_and_detach_in_layer():
    class Gate(Block):
        def forward(self, x):
            with torch.no_grad():
                g = torch.sigmoid(self.fc2(x))
            return torch.tanh(self.fc1(x)) * g + x.detach() + x

    sweep_model(_stack(3, Gate), (_x(),), num_layers=3)


# ---- 9. torch's own attention / transformer / recurrent modules -----------------------


def test_multihead_attention_layers():
    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

        def forward(self, x, mask):
            y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=True)
            return y + x

    class Net(Stack):
        def forward(self, x):
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            for b in self.blocks:
                x = b(x, mask)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Net([MHA() for _ in range(2)]), (_x(),), num_layers=2)


@pytest.mark.parametrize(
    "dropout",
    [0.0, 0.1],
)
def test_transformer_encoder_stack(dropout):
    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=dropout, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

        def forward(self, x):
            return sq(self.enc(x))

    torch.manual_seed(0)
    s = sweep_model(Enc(), (_x(),), num_layers=2)
    assert s.stack.path == "enc.layers"


def test_gru_inside_layers():
    class GRUBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(D, D, batch_first=True)

        def forward(self, x):
            y, _ = self.gru(x)
            return y + x

    sweep_model(_stack(2, GRUBlock), (_x(B, 3, D),), num_layers=2)


@pytest.mark.xfail(
    strict=True,
    reason="Conv2d on CPU: convolution (8896 B here) and convolution_backward (8-19 KB) "
    "allocate im2col/packing scratch, native_group_norm_backward 128 B, none modelled by "
    "costs.transient_bytes; peak under-predicted by 9-17 KB (none: 32840 vs 46180 B)",
)
def test_conv_groupnorm_layers():
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)
            self.norm = nn.GroupNorm(2, 8)

        def forward(self, x):
            return nn.functional.gelu(self.norm(self.conv(x))) + x

    torch.manual_seed(0)
    sweep_model(_stack(2, Conv), (_x(2, 8, 8, 8),), sq, num_layers=2)


# ---- 10. stack shapes ----------------------------------------------------------------


def test_stack_of_one_layer():
    with pytest.raises(LayerStackNotFound):
        Session.create(_stack(1), (_x(),), None)
    sweep_model(_stack(1), (_x(),), layers="blocks", num_layers=1)


def test_layer_never_called():
    class Skips(Stack):
        def forward(self, x):
            for i, b in enumerate(self.blocks):
                if i != 1:
                    x = b(x)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Skips([Block() for _ in range(3)]), (_x(),), num_layers=3, uncalled=(1,))


def test_heterogeneous_widths():
    def make():
        torch.manual_seed(0)
        return Stack([Block(D, 24), Block(24, 8), Block(8, D)])

    sweep_model(make(), (_x(),), layers="blocks", num_layers=3)
    sweep_model(make(), (_x(),), num_layers=3)


def test_heterogeneous_classes_named_explicitly():
    torch.manual_seed(0)
    model = Stack([Block(), nn.Sequential(nn.Linear(D, D), nn.ReLU()), Block()])
    sweep_model(model, (_x(),), layers="blocks", num_layers=3)


def test_model_is_the_stack_itself():
    torch.manual_seed(0)
    s = sweep_model(nn.Sequential(*[Block() for _ in range(3)]), (_x(),), sq, num_layers=3)
    assert s.stack.path == ""


def test_module_dict_stack_is_refused_clearly():
    class Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({f"l{i}": Block() for i in range(3)})

        def forward(self, x):
            for b in self.blocks.values():
                x = b(x)
            return sq(x)

    with pytest.raises(LayerStackNotFound, match="ModuleList"):
        Session.create(Dict(), (_x(),), None)


def test_bad_stacks_are_refused():
    with pytest.raises(LayerStackNotFound, match="nope"):
        Session.create(_stack(2), (_x(),), None, layers="nope")

    class Identities(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])

        def forward(self, x):
            x = self.fc(x)
            for b in self.blocks:
                x = b(x)
            return sq(x)

    with pytest.raises(LayerStackNotFound):
        Session.create(Identities(), (_x(),), None)


def test_schedule_for_another_length_is_refused():
    s = Session.create(_stack(2), (_x(),), None)
    with pytest.raises(InvalidSchedule, match="L=3"):
        s.evaluate(schedules.uniform(1, 3))


# ---- 11. losses -------------------------------------------------------------------------


def test_loss_closure_over_target_tensor():
    target = _x(seed=3)
    model = Stack([Block() for _ in range(3)], return_hidden=True)
    sweep_model(model, (_x(),), lambda y: sq(y - target), num_layers=3)


def test_model_returns_object_with_loss_and_kwargs():
    @dataclasses.dataclass
    class Output:
        loss: torch.Tensor
        logits: torch.Tensor

    class Net(Stack):
        def forward(self, x, labels=None):
            for b in self.blocks:
                x = b(x)
            return Output(loss=sq(x - labels), logits=x)

    torch.manual_seed(0)
    sweep_model(Net([Block() for _ in range(3)]), {"x": _x(), "labels": _x(seed=3)}, num_layers=3)


def test_zero_size_and_complex_intermediates():
    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return torch.cat([torch.tanh(self.fc(x)), x[:, :0] * x[:, :0]], 1) + x

    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            f = torch.fft.rfft(self.fc(x), dim=-1)
            return torch.fft.irfft(f * f.conj(), n=D, dim=-1) + x

    sweep_model(_stack(3, Empty), (_x(),), num_layers=3)
    sweep_model(_stack(2, Spectral), (_x(),), num_layers=2)


def test_parallel_branches_not_a_chain():
    class Parallel(Stack):
        def forward(self, x):
            return sq(sum(b(x) for b in self.blocks))

    torch.manual_seed(0)
    sweep_model(Parallel([Block() for _ in range(3)]), (_x(),), num_layers=3)


class MoE(nn.Module):
    """A layer holding a ModuleList of 4 experts (longer than the 2-layer stack)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 4)
        self.experts = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])

    def forward(self, x):
        g = torch.softmax(self.gate(x), -1)
        return x + sum(g[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


def test_moe_layers_with_stack_named():
    sweep_model(_stack(2, MoE), (_x(),), layers="blocks", num_layers=2)


def test_moe_layers_stack_found_automatically():
    s = sweep_model(_stack(2, MoE), (_x(),))
    assert s.stack.path == "blocks"


class SDPA(nn.Module):
    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.dropout_p = dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)
        return y.transpose(1, 2).reshape(B, T, D) + x


@pytest.mark.xfail(
    strict=True,
    reason="CPU flash attention: _scaled_dot_product_flash_attention_for_cpu and its "
    "backward allocate per-thread scratch (576 B / 544 B here on 1 thread) not modelled "
    "by costs.transient_bytes; every schedule under-predicted by ~550 B",
)
def test_sdpa_without_dropout():
    sweep_model(_stack(2, SDPA), (_x(),), num_layers=2)


def test_sdpa_without_dropout_needs_no_rng_replay():
    """Attention with dropout_p=0 draws no random numbers: no RNG state is saved."""
    torch.manual_seed(0)
    s = Session.create(_stack(2, SDPA), (_x(),), None)
    step, _, _ = s.prepare(schedules.uniform(1, 2))
    assert [seg.rng_replayed for seg in step.segments] == [(), ()]


def test_sdpa_with_dropout():
    sweep_model(_stack(2, lambda: SDPA(0.1)), (_x(),), num_layers=2)


def test_multi_output_ops_with_integer_results():
    class TopK(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            h = self.fc(x)
            v, i = h.topk(4, -1)
            ordered, _ = h.sort(-1)
            top, _ = h.max(-1, keepdim=True)
            return torch.tanh(h) * top + ordered + x.scatter(-1, i, v)

    sweep_model(_stack(3, TopK), (_x(),), num_layers=3)


class _Item(Block):
    def forward(self, x):
        return self.fc1(x) * float(x.abs().max().item())


class _Branch(Block):
    def forward(self, x):
        return self.fc1(x) if x.sum() > 0 else -self.fc1(x)


class _MaskIndex(Block):
    def forward(self, x):
        h = self.fc1(x)
        return h[h > 0].sum() + x


@pytest.mark.parametrize("cls", [_Item, _Branch, _MaskIndex], ids=["item", "branch", "mask_index"])
def test_data_dependent_ops_are_refused(cls):
    with pytest.raises(UnsupportedGraph):
        Session.create(_stack(2, cls), (_x(),), None)


def test_losses_that_are_not_a_differentiable_scalar_are_refused():
    model = Stack([Block() for _ in range(2)], return_hidden=True)
    with pytest.raises(RematError, match="scalar"):
        Session.create(model, (_x(),), lambda y: y.sum(-1))
    with pytest.raises(RematError, match="scalar"):
        Session.create(model, (_x(),), None)
    with pytest.raises(RematError):
        Session.create(model, (_x(),), lambda y: (y > 0).sum())
    frozen = _stack(2)
    frozen.requires_grad_(False)
    with pytest.raises(RematError, match="requires grad"):
        Session.create(frozen, (_x(),), None)


def test_dropout_in_eval_mode():
    def block():
        return nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5))

    model = _stack(2, block)
    model.eval()
    sweep_model(model, (_x(),), num_layers=2)


# ---- 12. the user's own activation checkpointing ---------------------------------------


def test_torch_checkpoint_non_reentrant_in_model():
    class Ckpt(Stack):
        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=False)
            return sq(x)

    torch.manual_seed(0)
    sweep_model(Ckpt([Block() for _ in range(3)]), (_x(),), num_layers=3)


def test_torch_checkpoint_reentrant_in_model():
    class Ckpt(Stack):
        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=True)
            return sq(x)

    torch.manual_seed(0)
    x = _x().requires_grad_()
    sweep_model(Ckpt([Block() for _ in range(3)]), (x,), num_layers=3, allow_refusal=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gpt2_with_gradient_checkpointing_enabled(reentrant):
    # transformers' packed-sequence check branches on tensor values when not compiling:
    # a clear UnsupportedGraph is as good as a correct sweep
    pytest.importorskip("transformers")
    from remat_pass.models import gpt2

    model, inputs, loss_fn = gpt2(
        batch=2, seq=8, layers=2, hidden=16, heads=2, vocab=64, dropout=0.0
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    sweep_model(model, inputs, loss_fn, num_layers=2, allow_refusal=True)
