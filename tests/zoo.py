"""The model zoo: tiny adversarial models, one ``ZooEntry`` each, with what the sweep must see."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

from remat_pass import schedule as schedules
from remat_pass.errors import LayerStackNotFound, RematError, UnsupportedGraph
from remat_pass.models import gpt2
from remat_pass.sweep import Session

B, T, D = 4, 8, 16
VOCAB = 40

Built = tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]
"""What ``ZooEntry.build`` returns: ``(model, example_inputs, loss_fn)``."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A RematError the sweep may see (``required=False``) or must see (``required=True``).

    Attributes:
        error: the RematError subclass expected.
        match: a regex the message must match (``pytest.raises(match=)``), or None.
        required: True: ``Session.create`` must raise ``error``. False: ``Session.create``
            or the evaluation of any schedule may raise it, with a message.
    """

    error: type[RematError] = RematError
    match: str | None = None
    required: bool = False


def allowed(error: type[RematError] = RematError) -> Refusal:
    """Either outcome is good: a correct sweep, or ``error`` with a message."""
    return Refusal(error)


def refused(error: type[RematError] = RematError, match: str | None = None) -> Refusal:
    """``Session.create`` must raise ``error`` (with a message matching ``match``)."""
    return Refusal(error, match, required=True)


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo and what sweeping every Megatron schedule over it must give.

    Attributes:
        name: the test id.
        build: returns ``(model, example_inputs, loss_fn)`` with fresh weights seeded 0.
        exercises: one sentence: what the model exercises.
        num_layers: L, the number of layers of the stack found (None: not checked).
        layers: the ``layers=`` stack path (or paths) given to ``Session.create``
            (None: found automatically).
        expect_stack_path: the path the stack must be found at (None: not checked).
        empty_layers: layers of the stack expected to hold no graph node; any other
            empty layer is a silent miss.
        refusal: the RematError allowed or required (None: none is allowed).
        eager_grad_tolerance: largest allowed |grad - eager autograd grad|.
        check: an extra check on the Session after the sweep.
        requires: modules that must be importable (skipped otherwise).
    """

    name: str
    build: Callable[[], Built]
    exercises: str
    num_layers: int | None = None
    layers: str | tuple[str, ...] | None = None
    expect_stack_path: str | None = None
    empty_layers: tuple[int, ...] = ()
    refusal: Refusal | None = None
    eager_grad_tolerance: float = 1e-5
    check: Callable[[Session], None] | None = None
    requires: tuple[str, ...] = ()


# ---- shared helpers -----------------------------------------------------------------


def x(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """A seeded normal tensor, (B, T, D) by default."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (B, T, D)), generator=g).to(dtype)


def ids(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded token ids, (B, T) int64."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def sq(y: torch.Tensor) -> torch.Tensor:
    """A loss with no Python-scalar ops in its forward or backward."""
    return (y * y).sum()


def seeded(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], Any] = lambda: (x(),),
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Callable[[], Built]:
    """A ``build``: the model made after ``torch.manual_seed(0)``, then the inputs."""

    def build() -> Built:
        torch.manual_seed(0)
        return make_model(), make_inputs(), loss_fn

    return build


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


def layers_of(n: int, cls: Callable[[], nn.Module] = Block) -> list[nn.Module]:
    """``n`` fresh layers made by ``cls``."""
    return [cls() for _ in range(n)]


def stack(n: int = 3, cls: Callable[[], nn.Module] = Block) -> Stack:
    """A ``Stack`` of ``n`` layers made by ``cls``."""
    return Stack(layers_of(n, cls))


def stack_of(cls: Callable[[], nn.Module], n: int = 3, **kw) -> Callable[[], Built]:
    """A ``build`` of ``stack(n, cls)`` on one (B, T, D) input (``kw``: see ``seeded``)."""
    return seeded(lambda: stack(n, cls), **kw)


# ---- 1. one module instance used several times --------------------------------------


def shared_instance_stack() -> Stack:
    b = Block()
    return Stack([b, b, Block()])


class Twice(Stack):
    """The first layer called twice in a row."""

    def forward(self, x):
        x = self.blocks[0](self.blocks[0](x))
        for b in self.blocks[1:]:
            x = b(x)
        return sq(x)


class Again(Stack):
    """The first layer called again after the last."""

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return sq(self.blocks[0](x))


class Reverse(Stack):
    """The layers called last to first."""

    def forward(self, x):
        for b in reversed(self.blocks):
            x = b(x)
        return sq(x)


# ---- 2. skips across layers, per-layer losses ----------------------------------------


class UNet(Stack):
    """Layer outputs multiplied and added into later layers' inputs."""

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


class AuxLoss(Stack):
    """A loss term after every layer."""

    def forward(self, x):
        loss = 0
        for b in self.blocks:
            x = b(x)
            loss = loss + sq(x)
        return loss


class Gated(Block):
    """Returns its hidden value, which the next layer reads."""

    def forward(self, x, prev_h):
        h = torch.tanh(self.fc1(x))
        if prev_h is not None:
            h = h * prev_h
        return self.fc2(h) + x, h


class GatedNet(Stack):
    def forward(self, x):
        h = None
        for b in self.blocks:
            x, h = b(x, h)
        return sq(x)


class SharedProj(nn.Module):
    """A layer calling an outer module that is not its child."""

    def __init__(self, proj):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.__dict__["proj"] = proj  # an outer module, not a child of the layer

    def forward(self, x):
        return self.fc(torch.tanh(self.proj(x))) + x


class OuterOpsNet(Stack):
    """An outer projection inside every layer and an outer Linear between layers 1 and 2."""

    def __init__(self):
        proj = nn.Linear(D, D)
        super().__init__([SharedProj(proj) for _ in range(3)])
        self.proj = proj
        self.mid = nn.Linear(D, D)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 1:
                x = torch.relu(self.mid(x))
        return sq(x)


class Cross(nn.Module):
    """Cross-attention of the target onto the encoder's memory."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)

    def forward(self, x, memory):
        a = torch.softmax(self.q(x) @ self.k(memory).transpose(-1, -2), -1)
        return a @ memory + x


class EncDec(nn.Module):
    """An encoder stack of 2 Blocks, then a decoder stack of 3 Cross layers."""

    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList(layers_of(2))
        self.dec = nn.ModuleList(layers_of(3, Cross))

    def forward(self, src, tgt):
        for b in self.enc:
            src = b(src)
        for b in self.dec:
            tgt = b(tgt, src)
        return sq(tgt)


def check_enc_dec_stacks(session: Session) -> None:
    """The encoder's 2 layers are chain layers 0-1, the decoder's 3 layers 2-4, and
    uniform(K=2) makes groups inside each stack (none spans the boundary)."""
    spans = [(s.path, s.first_layer, s.num_layers) for s in session.stack.stacks]
    assert spans == [("enc", 0, 2), ("dec", 2, 3)], spans
    assert schedules.uniform(2, session.stack.layers_per_stack).groups == ((0, 1), (2, 3), (4,))
    assert schedules.block(1, session.stack.layers_per_stack).groups == ((0,), (2,))


class Inner(Block):
    """Returns its hidden value, which the loss reads."""

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h) + x, h


class InnerLossNet(Stack):
    def forward(self, x):
        hs = []
        for b in self.blocks:
            x, h = b(x)
            hs.append(h[:, :2])
        return sq(x) + sum(sq(h) for h in hs)


# ---- 3. tuple / dict layers, shared side inputs --------------------------------------


class Attn(Block):
    """Masked self-attention returning its weights too."""

    def forward(self, x, mask, pos):
        y = self.fc1(x) + pos
        w = torch.softmax((y @ y.transpose(-1, -2)).masked_fill(mask, float("-inf")), -1)
        return self.fc2(w @ y) + x, w


class MaskPosNet(nn.Module):
    """One causal mask and one position table shared by every layer."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(T, D)
        self.blocks = nn.ModuleList(layers_of(3, Attn))

    def forward(self, x):
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        pos = self.pos(torch.arange(T))
        loss = 0
        for b in self.blocks:
            x, w = b(x, mask, pos)
            loss = loss + sq(w)
        return loss + sq(x)


class DictBlock(Block):
    """A dict in, a dict out."""

    def forward(self, d):
        h = self.fc2(torch.relu(self.fc1(d["h"]))) + d["h"]
        return {"h": h, "stat": h.sum(-1)}


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*layers_of(3, DictBlock))

    def forward(self, x):
        out = self.blocks({"h": x})
        return sq(out["h"]) + sq(out["stat"])


class IdBlock(Block):
    """Reads an integer id tensor through its own embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, D)

    def forward(self, x, ids):
        return torch.tanh(self.fc1(x)) + self.emb(ids) + x


class IdNet(Stack):
    def forward(self, x, ids):
        for b in self.blocks:
            x = b(x, ids)
            ids = torch.remainder(ids + 1, 10)
        return sq(x)


# ---- 4. in-place ops, views crossing layer boundaries, parametrizations --------------


class InPlace(Block):
    def forward(self, x):
        y = self.fc1(x)
        y.relu_()
        z = self.fc2(y)
        z.add_(x)
        z.masked_fill_(x > 1.5, 0.0)
        return z


class Mut(Block):
    """Multiplies its input in place."""

    def forward(self, x):
        x.mul_(2)
        return torch.tanh(self.fc1(x)) + x


class MutNet(Stack):
    def __init__(self):
        super().__init__(layers_of(3, Mut))
        self.pre = nn.Linear(D, D)

    def forward(self, x):
        return super().forward(self.pre(x))


class Transposed(nn.Module):
    """A (B, D, T) view in, a (B, D, T) view out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = x.transpose(1, 2)
        return (torch.tanh(self.fc(h)) + h).transpose(1, 2)


class TransposedNet(Stack):
    def forward(self, x):
        x = x.transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        return sq(x[..., ::2])


class Slice(nn.Module):
    """Returns the middle third of a wider tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3 * D)

    def forward(self, x):
        return torch.tanh(self.fc(x))[..., D : 2 * D]


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x).view(B, T * D).view(B, T, D)


class Alias(nn.Module):
    """Returns a view of its input and nothing else."""

    def forward(self, x):
        return x.view(x.shape)


class PreNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(self.norm(x)) + x


def hooked_stack() -> Stack:
    model = stack(3)
    for b in model.blocks:
        b.register_forward_pre_hook(lambda mod, args: (torch.tanh(args[0]),))
        b.register_forward_hook(lambda mod, args, out: out * torch.sigmoid(out))
    return model


def parametrized_stack(n: int, param: Callable[[nn.Module], Any], attr: str) -> Callable[[], Stack]:
    def make() -> Stack:
        model = stack(n)
        for b in model.blocks:
            param(getattr(b, attr))
        return model

    return make


# ---- 5. buffers ---------------------------------------------------------------------


class Scaled(Block):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.rand(D) + 0.5)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return torch.tanh(self.fc1(x)) * self.scale + x


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(T)

    def forward(self, x):
        return self.bn(self.fc(x))


class Counter(Block):
    """Accumulates into a buffer in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(D))

    def forward(self, x):
        y = self.fc1(x)
        self.acc.add_(y.detach().mean((0, 1)))
        return y


def in_eval(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: make().eval()


# ---- 6. dtypes ------------------------------------------------------------------------


class Upcast(nn.Module):
    """A float32 softmax inside a bfloat16 layer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return torch.softmax(h.float(), -1).to(x.dtype) * h + x


def sq_float(y: torch.Tensor) -> torch.Tensor:
    """``sq`` in float32."""
    return sq(y.float())


# ---- 7. random ops --------------------------------------------------------------------


class Random(Block):
    """Dropout, rand_like, randn, bernoulli and randperm in one layer."""

    def forward(self, x):
        h = nn.functional.dropout(torch.tanh(self.fc1(x)), 0.3, True)
        h = h * torch.rand_like(h) + torch.randn(h.shape)
        h = h * torch.bernoulli(torch.full_like(h, 0.7))
        perm = torch.randperm(h.shape[1])
        return self.fc2(h[:, perm]) + x


class RandomNet(Stack):
    def forward(self, x):
        x = nn.functional.dropout(x + torch.randn_like(x), 0.2, True)
        return super().forward(x)


def check_rng_replayed(session: Session) -> None:
    """uniform(K=1) replays the RNG of at least the 4 random ops of each of 3 layers."""
    step, _, _ = session.prepare(schedules.uniform(1, 3))
    assert sum(len(seg.rng_replayed) for seg in step.segments) >= 3 * 4


class Masked(Block):
    """Draws a random mask that the next layer and the loss read."""

    def forward(self, x, mask):
        h = torch.tanh(self.fc1(x))
        if mask is not None:
            h = h * mask
        return self.fc2(h) + x, torch.bernoulli(torch.full_like(h, 0.8)) * h


class MaskedNet(Stack):
    def forward(self, x):
        mask = None
        for b in self.blocks:
            x, mask = b(x, mask)
        return sq(x) + sq(mask)


class Drop(Block):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc1(x))) + x


def linear_dropout() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5))


# ---- 8. tied, frozen, input gradients --------------------------------------------------


class TiedLM(nn.Module):
    """Embedding and LM head share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(layers_of(3))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, target):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def frozen_middle_tied_lm() -> TiedLM:
    model = TiedLM()
    model.blocks[1].requires_grad_(False)
    return model


def check_frozen_layer_has_no_grads(session: Session) -> None:
    """The frozen layer's parameters get no gradient (None), not a zero one."""
    labels, grads = session.joint.primal_labels, session.reference_grads
    frozen = [g for label, g in zip(labels, grads) if label.startswith("blocks.1.")]
    assert frozen and all(g is None for g in frozen)


def frozen_stack(n: int) -> Callable[[], Stack]:
    return lambda: stack(n).requires_grad_(False)


def check_input_grad_matches_autograd(session: Session) -> None:
    """The gradient of ``input[0]`` matches ``torch.autograd.grad`` to 1e-5."""
    model, (inp,) = session.joint.model, session.example_inputs
    (ref,) = torch.autograd.grad(model(inp), [inp])
    got = session.reference_grads[session.joint.primal_labels.index("input[0]")]
    assert (got - ref).abs().max() <= 1e-5


class Two(Stack):
    """Two inputs, added."""

    def forward(self, a, b):
        return super().forward(a + b)


def same_tensor_twice() -> tuple[torch.Tensor, torch.Tensor]:
    t = x()
    return t, t


def tensor_and_its_view() -> tuple[torch.Tensor, torch.Tensor]:
    t = x()
    return t, t[:, :, :]


class Nested(Stack):
    """A dict of a list of tensors as the input."""

    def forward(self, batch):
        return super().forward(batch["x"][0] + batch["x"][1])


class Gate(Block):
    """A gate computed under no_grad, and a detached residual."""

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.fc2(x))
        return torch.tanh(self.fc1(x)) * g + x.detach() + x


# ---- 9. torch's own attention / transformer / recurrent modules -----------------------


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x, mask):
        y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=True)
        return y + x


class MHANet(Stack):
    def forward(self, x):
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        for b in self.blocks:
            x = b(x, mask)
        return sq(x)


class Enc(nn.Module):
    """nn.TransformerEncoder of 2 layers."""

    def __init__(self, dropout: float):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x):
        return sq(self.enc(x))


class GRUBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(D, D, batch_first=True)

    def forward(self, x):
        y, _ = self.gru(x)
        return y + x


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x):
        return nn.functional.gelu(self.norm(self.conv(x))) + x


# ---- 10. stack shapes ----------------------------------------------------------------


class Skips(Stack):
    """Layer 1 is never called."""

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if i != 1:
                x = b(x)
        return sq(x)


def heterogeneous_widths() -> Stack:
    return Stack([Block(D, 24), Block(24, 8), Block(8, D)])


def heterogeneous_classes() -> Stack:
    return Stack([Block(), nn.Sequential(nn.Linear(D, D), nn.ReLU()), Block()])


class DictStack(nn.Module):
    """The layers are a ModuleDict."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({f"l{i}": Block() for i in range(3)})

    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return sq(x)


class Identities(nn.Module):
    """The only ModuleList holds parameter-free Identity layers."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])

    def forward(self, x):
        x = self.fc(x)
        for b in self.blocks:
            x = b(x)
        return sq(x)


# ---- 11. losses and odd ops --------------------------------------------------------------


def closure_loss_build() -> Built:
    torch.manual_seed(0)
    target = x(seed=3)
    return Stack(layers_of(3), return_hidden=True), (x(),), lambda y: sq(y - target)


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class OutputNet(Stack):
    """Keyword inputs; returns an object with ``.loss``."""

    def forward(self, x, labels=None):
        for b in self.blocks:
            x = b(x)
        return Output(loss=sq(x - labels), logits=x)


class Empty(nn.Module):
    """Zero-size intermediates."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.cat([torch.tanh(self.fc(x)), x[:, :0] * x[:, :0]], 1) + x


class Spectral(nn.Module):
    """Complex intermediates (rfft / irfft)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        f = torch.fft.rfft(self.fc(x), dim=-1)
        return torch.fft.irfft(f * f.conj(), n=D, dim=-1) + x


class Parallel(Stack):
    """Every layer reads the input; the outputs are summed."""

    def forward(self, x):
        return sq(sum(b(x) for b in self.blocks))


class MoE(nn.Module):
    """A layer holding a ModuleList of 4 experts (longer than the 2-layer stack)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 4)
        self.experts = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])

    def forward(self, x):
        g = torch.softmax(self.gate(x), -1)
        return x + sum(g[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class SDPA(nn.Module):
    """scaled_dot_product_attention over a fused qkv projection."""

    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.dropout_p = dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)
        return y.transpose(1, 2).reshape(B, T, D) + x


class TopK(nn.Module):
    """topk, sort and max (values and integer indices), and scatter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        v, i = h.topk(4, -1)
        ordered, _ = h.sort(-1)
        top, _ = h.max(-1, keepdim=True)
        return torch.tanh(h) * top + ordered + x.scatter(-1, i, v)


class Item(Block):
    def forward(self, x):
        return self.fc1(x) * float(x.abs().max().item())


class Branch(Block):
    def forward(self, x):
        return self.fc1(x) if x.sum() > 0 else -self.fc1(x)


class MaskIndex(Block):
    def forward(self, x):
        h = self.fc1(x)
        return h[h > 0].sum() + x


def hidden_stack() -> Stack:
    return Stack(layers_of(2), return_hidden=True)


# ---- 12. the user's own activation checkpointing ---------------------------------------


class Ckpt(Stack):
    """Every layer under torch.utils.checkpoint."""

    def __init__(self, blocks, use_reentrant: bool):
        super().__init__(blocks)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.use_reentrant)
        return sq(x)


def hf_gpt2_checkpointed(reentrant: bool) -> Callable[[], Built]:
    def build() -> Built:
        model, inputs, loss_fn = gpt2(
            batch=2, seq=8, layers=2, hidden=16, heads=2, vocab=64, dropout=0.0
        )
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        return model, inputs, loss_fn

    return build


# ---- the zoo ----------------------------------------------------------------------------


ZOO: tuple[ZooEntry, ...] = (
    ZooEntry(
        "plain_stack", stack_of(Block), "the baseline: three Linear-tanh-Linear residual blocks.",
        num_layers=3,
    ),
    # 1. one module instance used several times
    ZooEntry(
        "same_instance_twice_in_modulelist",
        seeded(shared_instance_stack),
        "one Block instance at two positions of the ModuleList: refused or swept as 3 "
        "layers, and tracing never replaces the model's own parameters (bug fixed in "
        "1785695: a FunctionalTensor was left in the shared block).",
        num_layers=3,
        refusal=allowed(LayerStackNotFound),
    ),
    ZooEntry(
        "block_called_twice_in_forward",
        seeded(lambda: Twice(layers_of(3))),
        "a layer called twice in a row in one forward.",
        num_layers=3,
    ),
    ZooEntry(
        "first_block_called_again_after_the_last",
        seeded(lambda: Again(layers_of(3))),
        "the first layer called again after the last one.",
        num_layers=3,
    ),
    ZooEntry(
        "stack_called_in_reverse_order",
        seeded(lambda: Reverse(layers_of(3))),
        "the layers called in the reverse of their ModuleList order.",
        num_layers=3,
    ),
    # 2. skips across layers, per-layer losses
    ZooEntry(
        "unet_skip_connections",
        seeded(lambda: UNet(layers_of(4))),
        "U-Net skips: layer outputs multiplied and added into layers two and three later.",
        num_layers=4,
    ),
    ZooEntry(
        "per_layer_auxiliary_loss",
        seeded(lambda: AuxLoss(layers_of(3))),
        "a loss term read from every layer's output.",
        num_layers=3,
    ),
    ZooEntry(
        "layer_reads_previous_layers_internal_value",
        seeded(lambda: GatedNet(layers_of(3, Gated))),
        "each layer reads a hidden value computed inside the previous layer.",
        num_layers=3,
    ),
    ZooEntry(
        "outer_ops_between_and_inside_layers",
        seeded(OuterOpsNet),
        "an outer module called inside every layer and outer ops between two layers.",
        num_layers=3,
    ),
    ZooEntry(
        "encoder_decoder_two_stacks",
        seeded(EncDec, lambda: (x(), x(seed=2))),
        "two stacks (encoder of 2, decoder of 3 cross-attention layers): both found, one "
        "chain of 5 layers, schedules applied per stack.",
        num_layers=5,
        expect_stack_path="enc, dec",
        check=check_enc_dec_stacks,
    ),
    ZooEntry(
        "encoder_decoder_encoder_named",
        seeded(EncDec, lambda: (x(), x(seed=2))),
        "the shorter encoder stack of an encoder-decoder named with layers='enc', its "
        "output read by every decoder layer.",
        num_layers=2,
        layers="enc",
    ),
    ZooEntry(
        "loss_reads_values_inside_layers",
        seeded(lambda: InnerLossNet(layers_of(3, Inner))),
        "the loss reads a slice of a hidden value inside every layer.",
        num_layers=3,
    ),
    # 3. tuple / dict layers, shared side inputs
    ZooEntry(
        "tuple_outputs_with_shared_mask_and_positions",
        seeded(MaskPosNet),
        "tuple-returning attention layers sharing one mask and one position table, "
        "their attention weights read by the loss.",
        num_layers=3,
    ),
    ZooEntry(
        "dict_in_dict_out_sequential",
        seeded(DictNet),
        "an nn.Sequential stack whose layers take and return dicts.",
        num_layers=3,
    ),
    ZooEntry(
        "integer_side_tensors",
        seeded(lambda: IdNet(layers_of(3, IdBlock)), lambda: (x(), ids(1, 10))),
        "an int64 id tensor passed to every layer and changed between layers.",
        num_layers=3,
    ),
    # 4. in-place ops, views crossing layer boundaries, parametrizations
    ZooEntry(
        "inplace_ops_inside_layers",
        stack_of(InPlace),
        "in-place relu_, add_ and masked_fill_ inside layers.",
        num_layers=3,
    ),
    ZooEntry(
        "layer_mutates_its_input_in_place",
        seeded(MutNet),
        "each layer multiplies its input (the previous layer's output) in place.",
        num_layers=3,
    ),
    ZooEntry(
        "transposed_views_cross_layer_boundaries",
        seeded(lambda: TransposedNet(layers_of(3, Transposed))),
        "transposed views as layer inputs and outputs, a strided slice in the loss.",
        num_layers=3,
    ),
    ZooEntry(
        "layer_returns_slice_of_larger_tensor",
        stack_of(Slice),
        "each layer returns a slice (a view) of a three-times wider tensor.",
        num_layers=3,
    ),
    ZooEntry(
        "view_chains_and_alias_returning_layer",
        seeded(lambda: Stack([Views(), Alias(), Views()])),
        "chains of views, and a parameter-free layer that returns a view of its input.",
        num_layers=3,
        layers="blocks",
    ),
    ZooEntry(
        "python_scalar_ops_at_the_peak",
        seeded(
            lambda: Stack(layers_of(3), return_hidden=True),
            loss_fn=lambda y: (y.repeat(1, 1, 8) * 0.5).sum(),
        ),
        "the loss's largest temporaries meet at mul.Scalar, the peak step (bug fixed in "
        "30d755d: the 12 B wrapped-scalar scratch was not modelled).",
        num_layers=3,
    ),
    ZooEntry(
        "prenorm_layernorm_blocks",
        stack_of(PreNorm),
        "pre-norm LayerNorm residual blocks.",
        num_layers=3,
    ),
    ZooEntry(
        "user_hooks_on_layers",
        seeded(hooked_stack),
        "forward pre-hooks and forward hooks registered on every layer.",
        num_layers=3,
    ),
    ZooEntry(
        "weight_norm_parametrization",
        seeded(parametrized_stack(3, parametrizations.weight_norm, "fc1")),
        "weight_norm parametrization of a Linear in every layer.",
        num_layers=3,
    ),
    ZooEntry(
        "orthogonal_parametrization",
        seeded(parametrized_stack(2, parametrizations.orthogonal, "fc2")),
        "orthogonal parametrization (matrix_exp) of a Linear in every layer.",
        num_layers=2,
    ),
    ZooEntry(
        "spectral_norm_power_iteration_is_refused",
        seeded(parametrized_stack(2, parametrizations.spectral_norm, "fc1")),
        "spectral_norm updates its u/v buffers in train mode: refused as UnsupportedGraph.",
        refusal=refused(UnsupportedGraph),
    ),
    # 5. buffers
    ZooEntry(
        "buffers_read_inside_layers",
        stack_of(Scaled),
        "float and int64 buffers owned by every layer, one read in forward.",
        num_layers=3,
    ),
    ZooEntry(
        "batchnorm_train_mode_is_refused",
        stack_of(BNBlock, 2, loss_fn=sq),
        "BatchNorm in train mode updates running stats: refused as UnsupportedGraph "
        "naming BatchNorm or the mutation.",
        refusal=refused(UnsupportedGraph, "BatchNorm|mutat"),
    ),
    ZooEntry(
        "buffer_written_in_place_is_refused",
        stack_of(Counter, 2, loss_fn=sq),
        "a layer accumulating into its own buffer in place: refused as UnsupportedGraph.",
        refusal=refused(UnsupportedGraph),
    ),
    ZooEntry(
        "batchnorm_eval_mode",
        seeded(in_eval(lambda: stack(2, BNBlock))),
        "BatchNorm in eval mode reads its running stats as buffers.",
        num_layers=2,
    ),
    # 6. dtypes
    ZooEntry(
        "float64",
        seeded(lambda: stack(3).double(), lambda: (x(dtype=torch.float64),)),
        "float64 weights and activations.",
        num_layers=3,
    ),
    ZooEntry(
        "bfloat16",
        seeded(lambda: stack(3).to(torch.bfloat16), lambda: (x(dtype=torch.bfloat16),), sq_float),
        "bfloat16 weights and activations, a float32 loss.",
        num_layers=3,
        eager_grad_tolerance=1e-1,
    ),
    ZooEntry(
        "bfloat16_layer_upcasts_to_float32",
        seeded(
            lambda: stack(3, Upcast).to(torch.bfloat16),
            lambda: (x(dtype=torch.bfloat16),),
            sq_float,
        ),
        "bfloat16 layers that compute a softmax in float32 and cast back.",
        num_layers=3,
        eager_grad_tolerance=1e-1,
    ),
    ZooEntry(
        "float16_matmuls",
        seeded(lambda: stack(2).to(torch.float16), lambda: (x(dtype=torch.float16),), sq_float),
        "float16 matmuls: on CPUs with AVX512-FP16 or AMX they allocate oneDNN scratch, "
        "elsewhere none (calibrated either way).",
        num_layers=2,
        eager_grad_tolerance=1e-1,
    ),
    # 7. random ops
    ZooEntry(
        "random_ops_in_layers_and_outer_region",
        seeded(lambda: RandomNet(layers_of(3, Random))),
        "dropout, rand_like, randn, bernoulli and randperm in layers and in the outer "
        "region, replayed exactly under recompute.",
        num_layers=3,
        check=check_rng_replayed,
    ),
    ZooEntry(
        "random_mask_passed_to_next_layer_and_loss",
        seeded(lambda: MaskedNet(layers_of(3, Masked))),
        "a random mask drawn in one layer, read by the next layer and by the loss.",
        num_layers=3,
    ),
    ZooEntry(
        "dropout_module_only",
        stack_of(Drop),
        "nn.Dropout as the only random op.",
        num_layers=3,
    ),
    ZooEntry(
        "dropout_in_eval_mode",
        seeded(in_eval(lambda: stack(2, linear_dropout))),
        "nn.Dropout in eval mode, which draws nothing.",
        num_layers=2,
    ),
    # 8. tied, frozen, input gradients
    ZooEntry(
        "tied_embedding_and_head",
        seeded(TiedLM, lambda: (ids(1), ids(2))),
        "an embedding and LM head sharing one weight, cross-entropy loss.",
        num_layers=3,
    ),
    ZooEntry(
        "frozen_layer",
        seeded(frozen_middle_tied_lm, lambda: (ids(1), ids(2))),
        "a frozen middle layer, whose parameters must get no gradient.",
        num_layers=3,
        check=check_frozen_layer_has_no_grads,
    ),
    ZooEntry(
        "all_parameters_frozen_input_requires_grad",
        seeded(frozen_stack(2), lambda: (x().requires_grad_(),)),
        "every parameter frozen, the only gradient is the input's.",
        num_layers=2,
        check=check_input_grad_matches_autograd,
    ),
    ZooEntry(
        "input_requires_grad",
        seeded(lambda: stack(3), lambda: (x().requires_grad_(),)),
        "an input that requires grad next to the parameters.",
        num_layers=3,
        check=check_input_grad_matches_autograd,
    ),
    ZooEntry(
        "same_tensor_passed_twice",
        seeded(lambda: Two(layers_of(2)), same_tensor_twice),
        "one tensor passed as two inputs.",
        num_layers=2,
    ),
    ZooEntry(
        "tensor_and_its_view_as_inputs",
        seeded(lambda: Two(layers_of(2)), tensor_and_its_view),
        "a tensor and a view of it passed as two inputs.",
        num_layers=2,
    ),
    ZooEntry(
        "nested_list_and_dict_inputs",
        seeded(lambda: Nested(layers_of(2)), lambda: ({"x": [x(), x(seed=5)]},)),
        "a dict holding a list of tensors as the input.",
        num_layers=2,
    ),
    ZooEntry(
        "no_grad_region_and_detach_in_layer",
        stack_of(Gate),
        "a no_grad region and a detached residual inside every layer.",
        num_layers=3,
    ),
    # 9. torch's own attention / transformer / recurrent modules
    ZooEntry(
        "multihead_attention_layers",
        seeded(lambda: MHANet(layers_of(2, MHA))),
        "nn.MultiheadAttention with a causal mask and need_weights=True.",
        num_layers=2,
    ),
    ZooEntry(
        "transformer_encoder_stack",
        seeded(lambda: Enc(0.0)),
        "nn.TransformerEncoder (its fast path off) without dropout: stack 'enc.layers'.",
        num_layers=2,
        expect_stack_path="enc.layers",
    ),
    ZooEntry(
        "transformer_encoder_stack_with_dropout",
        seeded(lambda: Enc(0.1)),
        "nn.TransformerEncoder with dropout 0.1: stack 'enc.layers', dropout replayed.",
        num_layers=2,
        expect_stack_path="enc.layers",
    ),
    ZooEntry(
        "gru_inside_layers",
        stack_of(GRUBlock, 2, make_inputs=lambda: (x(B, 3, D),)),
        "nn.GRU inside every layer.",
        num_layers=2,
    ),
    ZooEntry(
        "conv_groupnorm_layers",
        stack_of(Conv, 2, make_inputs=lambda: (x(2, 8, 8, 8),), loss_fn=sq),
        "Conv2d + GroupNorm + GELU residual layers on a 4-d input.",
        num_layers=2,
    ),
    # 10. stack shapes
    ZooEntry(
        "stack_of_one_layer_is_not_found_automatically",
        stack_of(Block, 1),
        "a one-layer ModuleList is not taken for a stack without layers=.",
        refusal=refused(LayerStackNotFound),
    ),
    ZooEntry(
        "stack_of_one_layer_named",
        stack_of(Block, 1),
        "a one-layer stack named with layers='blocks'.",
        num_layers=1,
        layers="blocks",
    ),
    ZooEntry(
        "layer_never_called",
        seeded(lambda: Skips(layers_of(3))),
        "layer 1 of the stack is never called, so it must hold no node.",
        num_layers=3,
        empty_layers=(1,),
    ),
    ZooEntry(
        "heterogeneous_widths_named",
        seeded(heterogeneous_widths),
        "layers of one class with different widths (16->24->8->16), named with layers=.",
        num_layers=3,
        layers="blocks",
    ),
    ZooEntry(
        "heterogeneous_widths_found_automatically",
        seeded(heterogeneous_widths),
        "layers of one class with different widths, the stack found automatically.",
        num_layers=3,
    ),
    ZooEntry(
        "heterogeneous_classes_named_explicitly",
        seeded(heterogeneous_classes),
        "a stack mixing Block and nn.Sequential layers, named with layers=.",
        num_layers=3,
        layers="blocks",
    ),
    ZooEntry(
        "model_is_the_stack_itself",
        seeded(lambda: nn.Sequential(*layers_of(3)), loss_fn=sq),
        "the model itself is the nn.Sequential stack: path ''.",
        num_layers=3,
        expect_stack_path="",
    ),
    ZooEntry(
        "module_dict_stack_is_refused_clearly",
        seeded(DictStack),
        "layers in a ModuleDict: refused as LayerStackNotFound naming ModuleList.",
        refusal=refused(LayerStackNotFound, "ModuleList"),
    ),
    ZooEntry(
        "missing_stack_path_is_refused",
        seeded(lambda: stack(2)),
        "layers= naming a path that does not exist: LayerStackNotFound naming it.",
        layers="nope",
        refusal=refused(LayerStackNotFound, "nope"),
    ),
    ZooEntry(
        "stack_of_identities_is_refused",
        seeded(Identities),
        "the only ModuleList holds parameter-free Identity layers: LayerStackNotFound.",
        refusal=refused(LayerStackNotFound),
    ),
    # 11. losses and odd ops
    ZooEntry(
        "loss_closure_over_target_tensor",
        closure_loss_build,
        "a loss_fn closure over a target tensor that is not an input.",
        num_layers=3,
    ),
    ZooEntry(
        "model_returns_object_with_loss_and_kwargs",
        seeded(lambda: OutputNet(layers_of(3)), lambda: {"x": x(), "labels": x(seed=3)}),
        "keyword inputs (a dict) and an output object carrying .loss.",
        num_layers=3,
    ),
    ZooEntry(
        "zero_size_intermediates",
        stack_of(Empty),
        "zero-size tensors concatenated into the layer output.",
        num_layers=3,
    ),
    ZooEntry(
        "complex_intermediates",
        stack_of(Spectral, 2),
        "complex intermediates from rfft / irfft inside every layer.",
        num_layers=2,
    ),
    ZooEntry(
        "parallel_branches_not_a_chain",
        seeded(lambda: Parallel(layers_of(3))),
        "the layers run in parallel on one input, not as a chain.",
        num_layers=3,
    ),
    ZooEntry(
        "moe_layers_with_stack_named",
        stack_of(MoE, 2),
        "MoE layers each holding a ModuleList of 4 experts, the stack named.",
        num_layers=2,
        layers="blocks",
    ),
    ZooEntry(
        "moe_layers_stack_found_automatically",
        stack_of(MoE, 2),
        "MoE layers each holding a longer ModuleList of experts: the outer 'blocks' is found.",
        num_layers=2,
        expect_stack_path="blocks",
    ),
    ZooEntry(
        "sdpa_without_dropout",
        stack_of(SDPA, 2),
        "scaled_dot_product_attention with dropout_p=0 (CPU flash attention).",
        num_layers=2,
    ),
    ZooEntry(
        "sdpa_with_dropout",
        stack_of(lambda: SDPA(0.1), 2),
        "scaled_dot_product_attention with dropout_p=0.1, its RNG replayed.",
        num_layers=2,
    ),
    ZooEntry(
        "multi_output_ops_with_integer_results",
        stack_of(TopK),
        "multi-output ops with integer results (topk, sort, max) and scatter.",
        num_layers=3,
    ),
    ZooEntry(
        "data_dependent_item_is_refused",
        stack_of(Item, 2),
        ".item() on an activation: refused as UnsupportedGraph.",
        refusal=refused(UnsupportedGraph),
    ),
    ZooEntry(
        "data_dependent_branch_is_refused",
        stack_of(Branch, 2),
        "Python control flow on a tensor's value: refused as UnsupportedGraph.",
        refusal=refused(UnsupportedGraph),
    ),
    ZooEntry(
        "data_dependent_mask_index_is_refused",
        stack_of(MaskIndex, 2),
        "boolean-mask indexing (data-dependent shape): refused as UnsupportedGraph.",
        refusal=refused(UnsupportedGraph),
    ),
    ZooEntry(
        "non_scalar_loss_is_refused",
        seeded(hidden_stack, loss_fn=lambda y: y.sum(-1)),
        "a loss_fn returning a non-scalar: RematError naming 'scalar'.",
        refusal=refused(RematError, "scalar"),
    ),
    ZooEntry(
        "non_scalar_output_without_loss_fn_is_refused",
        seeded(hidden_stack),
        "a model returning hidden states and no loss_fn: RematError naming 'scalar'.",
        refusal=refused(RematError, "scalar"),
    ),
    ZooEntry(
        "integer_loss_is_refused",
        seeded(hidden_stack, loss_fn=lambda y: (y > 0).sum()),
        "a loss that is an integer count, not differentiable: RematError.",
        refusal=refused(RematError),
    ),
    ZooEntry(
        "nothing_requires_grad_is_refused",
        seeded(frozen_stack(2)),
        "every parameter frozen and no input requiring grad: RematError naming 'requires grad'.",
        refusal=refused(RematError, "requires grad"),
    ),
    # 12. the user's own activation checkpointing
    ZooEntry(
        "torch_checkpoint_non_reentrant_in_model",
        seeded(lambda: Ckpt(layers_of(3), use_reentrant=False)),
        "the user's own non-reentrant torch.utils.checkpoint around every layer.",
        num_layers=3,
    ),
    ZooEntry(
        "torch_checkpoint_reentrant_in_model",
        seeded(lambda: Ckpt(layers_of(3), use_reentrant=True), lambda: (x().requires_grad_(),)),
        "the user's own reentrant torch.utils.checkpoint around every layer: swept or "
        "refused clearly.",
        num_layers=3,
        refusal=allowed(UnsupportedGraph),
    ),
    ZooEntry(
        "hf_gpt2_gradient_checkpointing_non_reentrant",
        hf_gpt2_checkpointed(reentrant=False),
        "HF GPT-2 with gradient_checkpointing_enable (non-reentrant); its packed-sequence "
        "check branches on tensor values when not compiling, so a clear UnsupportedGraph "
        "is as good as a correct sweep.",
        num_layers=2,
        refusal=allowed(UnsupportedGraph),
        requires=("transformers",),
    ),
    ZooEntry(
        "hf_gpt2_gradient_checkpointing_reentrant",
        hf_gpt2_checkpointed(reentrant=True),
        "HF GPT-2 with gradient_checkpointing_enable (reentrant): swept or refused clearly.",
        num_layers=2,
        refusal=allowed(UnsupportedGraph),
        requires=("transformers",),
    ),
)
