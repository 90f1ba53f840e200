"""Random layer stacks for the property tests: a spec (plain data) and the model it builds.

A ``StackSpec`` names the layer's blocks (each a tuple ``(kind, *params)``, applied in
order to a ``(batch, seq, hidden)`` activation), the input and output of the model, the
loss, and whether layers return tuples or read an extra input shared by every layer.
``build(spec)`` returns ``(model, example_inputs, loss_fn)`` seeded 0, every layer of
one class under ``model.layers`` (and the decoder's under ``model.dec_layers``). ``stack_specs()`` is the hypothesis strategy.

Families (the issue's, and more): Linear, MLPs, LayerNorm / RMSNorm / GroupNorm /
BatchNorm (eval), activations, in-place ops, views, slicing and cat, softmax /
log-softmax on either dim, scaled-dot-product attention (causal, masked, with dropout)
and eager attention with a mask buffer, dropout, masked_fill, a Linear shared by every
layer, buffers, bf16 / fp16 casts, gather / scatter / index_select / index_add,
einsum, cumsum, conv1d, max / average pooling, reductions (amax, mean, logsumexp),
BatchNorm in training mode (buffers written in place), a data-dependent scalar
(``.item()`` picking a path and a count), an embedding with a padding index, a head tied
to the embedding, layers returning tuples, an extra input (bias or attention mask)
shared by every layer, losses closing over targets, layers in an ``nn.ModuleDict``
keyed "0".."L-1", and an encoder-decoder (a second stack of decoder layers with
cross-attention to the encoder's output).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import assume
from hypothesis import strategies as st
from torch import nn

VOCAB = 11
ACTIVATIONS = ("gelu", "gelu_tanh", "tanh", "relu", "silu", "sigmoid", "softplus", "leaky_relu")


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """One generated model. Sizes are odd on purpose; ``blocks`` is one layer's body."""

    batch: int
    seq: int
    hidden: int
    heads: int
    num_layers: int
    blocks: tuple[tuple, ...]
    input: str = "dense"  # dense | embedding | embedding_padding
    head: str = "none"  # none | linear | tied
    loss: str = "sum_sq"  # sum_sq | sum | mean | mse_target | cross_entropy | amax
    tuple_layers: bool = False
    extra: str = "none"  # none | bias | mask
    container: str = "list"  # list (nn.ModuleList) | dict (nn.ModuleDict keyed "0".."L-1")
    decoder_layers: int = 0  # > 0: a second stack (decoder layers with cross-attention)

    def describe(self) -> str:
        """A one-line description for logs and failure messages."""
        blocks = " ".join("/".join(str(p) for p in b) for b in self.blocks)
        text = (f"B={self.batch} T={self.seq} D={self.hidden} H={self.heads} L={self.num_layers} "
                f"in={self.input} head={self.head} loss={self.loss} tuple={self.tuple_layers} "
                f"extra={self.extra} blocks=[{blocks}]")
        if self.container != "list":
            text += f" container={self.container}"
        if self.decoder_layers:
            text += f" decoder={self.decoder_layers}"
        return text

    @property
    def stack_paths(self) -> list[str]:
        """The module paths of the layer stacks, in the order they run."""
        return ["layers"] + (["dec_layers"] if self.decoder_layers else [])

    @property
    def writes_buffers(self) -> bool:
        """Whether the step writes buffers in place (BatchNorm's running statistics)."""
        return any(b == ("norm", "batchnorm_train") for b in self.blocks)


def _act(name: str, h: torch.Tensor) -> torch.Tensor:
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "leaky_relu":
        return F.leaky_relu(h, 0.1)
    return getattr(F, name)(h)


class Block(nn.Module):
    """One block ``(kind, *params)`` of a layer: ``(B, T, D) -> (B, T, D)``."""

    def __init__(self, spec: StackSpec, block: tuple, shared: nn.Linear | None):
        super().__init__()
        self.kind, self.params = block[0], block[1:]
        b, t, d, h = spec.batch, spec.seq, spec.hidden, spec.heads
        self.heads, self.extra = h, spec.extra
        kind, p = self.kind, self.params
        g = torch.Generator().manual_seed(len(self.params) + d)
        if kind == "linear":
            self.lin = nn.Linear(d, d, bias=p[0])
        elif kind == "mlp":
            self.fc1, self.fc2 = nn.Linear(d, p[0] * d), nn.Linear(p[0] * d, d)
        elif kind == "norm":
            self.norm = {"layernorm": lambda: nn.LayerNorm(d), "rmsnorm": lambda: nn.RMSNorm(d),
                         "groupnorm": lambda: nn.GroupNorm(p[1], d),
                         "batchnorm_eval": lambda: nn.BatchNorm1d(d).eval(),
                         "batchnorm_train": lambda: nn.BatchNorm1d(d)}[p[0]]()
        elif kind in ("sdpa", "eager_attention"):
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            if kind == "eager_attention":
                self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).triu(1))
        elif kind == "mask_fill":
            self.register_buffer("mask", torch.rand(t, d, generator=g) < 0.3)
        elif kind == "shared":
            self.shared = shared
        elif kind == "buffer_scale":
            self.register_buffer("scale", torch.rand(d, generator=g) + 0.5)
        elif kind == "cast":
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[p[0]]
            self.lin = nn.Linear(d, d).to(dtype)
            self.dtype = dtype
        elif kind in ("gather", "scatter"):
            self.register_buffer("index", torch.randint(0, d, (b, t, d), generator=g))
        elif kind in ("index_select", "index_add"):
            self.register_buffer("perm", torch.randperm(d, generator=g))
        elif kind == "einsum":
            self.w = nn.Parameter(torch.randn(d, d, generator=g) / math.sqrt(d))
        elif kind == "conv1d":
            self.conv = nn.Conv1d(d, d, p[0], padding=p[0] // 2, groups=p[1])

    def forward(self, h: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:  # noqa: C901 - a table
        kind, p = self.kind, self.params
        if kind == "linear":
            return self.lin(h)
        if kind == "mlp":
            return h + self.fc2(_act(p[1], self.fc1(h)))
        if kind == "norm":
            if p[0] == "groupnorm":
                return self.norm(h.transpose(1, 2)).transpose(1, 2)
            if p[0] in ("batchnorm_eval", "batchnorm_train"):
                return self.norm(h.reshape(-1, h.shape[-1])).view(h.shape)
            return self.norm(h)
        if kind == "act":
            return _act(p[0], h)
        if kind == "inplace":
            y = h * 1.5
            {"relu_": y.relu_, "tanh_": y.tanh_, "mul_": lambda: y.mul_(0.5), "add_": lambda: y.add_(h)}[p[0]]()
            return y
        if kind == "views":
            bsz, t, d = h.shape
            if p[0] == 0:
                return h.reshape(bsz * t, d).t().contiguous().t().reshape(bsz, t, d) * 2
            if p[0] == 1:
                return h.unsqueeze(2).expand(bsz, t, 2, d).sum(2)
            return h.view(bsz, t, self.heads, d // self.heads).transpose(1, 2).flip(-1).transpose(1, 2).reshape(bsz, t, d)
        if kind == "slice_cat":
            k = max(1, min(p[0], h.shape[-1] - 1)) if h.shape[-1] > 1 else 1
            return torch.cat([torch.tanh(h[..., :k]), h[..., k:] * 2], dim=-1)
        if kind == "softmax":
            fn = torch.log_softmax if p[1] else torch.softmax
            return h * fn(h, dim=p[0])
        if kind in ("sdpa", "eager_attention"):
            return h + self.proj(self._attention(h, extra))
        if kind == "dropout":
            return F.dropout(h, p[0], training=True)
        if kind == "mask_fill":
            return h.masked_fill(self.mask, 0.0)
        if kind == "shared":
            return h + self.shared(h)
        if kind == "buffer_scale":
            return h * self.scale
        if kind == "cast":
            return self.lin(h.to(self.dtype)).float()
        if kind == "gather":
            return torch.gather(h, -1, self.index[: h.shape[0]])
        if kind == "scatter":
            return torch.scatter_add(h, -1, self.index[: h.shape[0]], h * 0.5)
        if kind == "index_select":
            return torch.index_select(h, -1, self.perm)
        if kind == "index_add":
            return torch.index_add(h, -1, self.perm, torch.tanh(h))
        if kind == "einsum":
            return torch.einsum("btd,de->bte", h, self.w)
        if kind == "cumsum":
            return torch.cumsum(h, dim=p[0]) * 0.5
        if kind == "conv1d":
            return self.conv(h.transpose(1, 2)).transpose(1, 2)
        if kind == "pool":
            pool = F.max_pool1d if p[0] == "max" else F.avg_pool1d
            return pool(h.transpose(1, 2), p[1], stride=1, padding=p[1] // 2).transpose(1, 2)
        if kind == "item_branch":
            # a data-dependent scalar (.item()): the value picks a path and a count for
            # this batch (traced specialized to it)
            y = torch.relu(h) if h.mean().item() > 0 else torch.tanh(h)
            return y * (int((h > 0).sum().item()) % 3 + 1)
        if kind == "reduce":
            r = {"amax": lambda: torch.amax(h, -1, keepdim=True), "mean": lambda: h.mean(-1, keepdim=True),
                 "logsumexp": lambda: torch.logsumexp(h, -1, keepdim=True)}[p[0]]()
            return h - r
        if kind == "extra":
            return h + extra if self.extra == "bias" else h
        raise ValueError(f"unknown block {kind}")

    def _attention(self, h: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        bsz, t, d = h.shape
        q, k, v = self.qkv(h).view(bsz, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        causal, dropout_p = self.params[0], self.params[1] if len(self.params) > 1 else 0.0
        mask = extra if self.extra == "mask" else None
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=causal and mask is None)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            if causal:
                scores = scores.masked_fill(self.causal, float("-inf"))
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.softmax(scores, -1) @ v
        return out.transpose(1, 2).reshape(bsz, t, d)


class Layer(nn.Module):
    """One layer: the blocks in order; returns ``(h, aux)`` when ``tuple_layers``."""

    def __init__(self, spec: StackSpec, shared: nn.Linear | None):
        super().__init__()
        self.tuple_layers = spec.tuple_layers
        for i, b in enumerate(spec.blocks):
            self.add_module(f"b{i}", Block(spec, b, shared))
        self.num_blocks = len(spec.blocks)

    def forward(self, h: torch.Tensor, aux: torch.Tensor | None, extra: torch.Tensor | None) -> Any:
        for i in range(self.num_blocks):
            h = getattr(self, f"b{i}")(h, extra)
        if self.tuple_layers:
            return h, (h[:, :1] if aux is None else aux + h[:, :1])
        return h


class DecoderLayer(nn.Module):
    """One decoder layer (a second stack, of another class): the blocks in order, then
    cross-attention from the layer's activation to the encoder's output (T5's, Whisper's
    decoder)."""

    def __init__(self, spec: StackSpec, shared: nn.Linear | None):
        super().__init__()
        d, self.heads = spec.hidden, spec.heads
        for i, b in enumerate(spec.blocks):
            self.add_module(f"b{i}", Block(spec, b, shared))
        self.num_blocks = len(spec.blocks)
        self.q, self.kv, self.proj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, memory: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        for i in range(self.num_blocks):
            h = getattr(self, f"b{i}")(h, extra)
        bsz, t, d = h.shape
        q = self.q(h).view(bsz, t, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(memory).view(bsz, memory.shape[1], 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return h + self.proj(out.transpose(1, 2).reshape(bsz, t, d))


def _stack(spec: StackSpec, layers: list[nn.Module]) -> nn.Module:
    """The layers in the spec's container: a ModuleList, or a ModuleDict keyed "0".."L-1"
    (torchtitan's layout)."""
    if spec.container == "dict":
        return nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
    return nn.ModuleList(layers)


def _in_order(stack: nn.Module) -> list[nn.Module]:
    return list(stack.values()) if isinstance(stack, nn.ModuleDict) else list(stack)


class GenStack(nn.Module):
    """Input (dense or embedding), ``layers`` (one Layer class, in a list or a dict),
    optionally ``dec_layers`` (decoder layers reading the encoder's output), head (none,
    linear, tied to the embedding)."""

    def __init__(self, spec: StackSpec):
        super().__init__()
        d = spec.hidden
        self.spec = spec
        shared = nn.Linear(d, d) if any(b[0] == "shared" for b in spec.blocks) else None
        self.inp = self._input(spec)
        self.layers = _stack(spec, [Layer(spec, shared) for _ in range(spec.num_layers)])
        if spec.decoder_layers:
            self.dec_inp = self._input(spec)
            self.dec_layers = _stack(spec, [DecoderLayer(spec, shared) for _ in range(spec.decoder_layers)])
        if spec.head == "linear":
            self.out = nn.Linear(d, VOCAB)
        elif spec.head == "tied":
            self.out = nn.Linear(d, VOCAB, bias=False)
            self.out.weight = self.inp.weight  # weight tying

    @staticmethod
    def _input(spec: StackSpec) -> nn.Module:
        if spec.input == "dense":
            return nn.Linear(spec.hidden, spec.hidden)
        return nn.Embedding(VOCAB, spec.hidden, padding_idx=0 if spec.input == "embedding_padding" else None)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> Any:
        h, aux = self.inp(x), None
        for layer in _in_order(self.layers):
            out = layer(h, aux, extra)
            h, aux = out if isinstance(out, tuple) else (out, None)
        if self.spec.decoder_layers:
            memory, h = h, self.dec_inp(x)
            for layer in _in_order(self.dec_layers):
                h = layer(h, memory, extra)
        y = self.out(h) if self.spec.head != "none" else h
        return y if aux is None else (y, aux)


def _loss(spec: StackSpec, width: int):
    """The loss closure: over targets where the spec says so."""
    g = torch.Generator().manual_seed(7)
    target = torch.randn(spec.batch, spec.seq, width, generator=g)
    ids = torch.randint(0, width, (spec.batch * spec.seq,), generator=g)

    def loss_fn(out: Any) -> torch.Tensor:
        y, aux = out if isinstance(out, tuple) else (out, None)
        if spec.loss == "sum_sq":
            loss = (y * y).sum()
        elif spec.loss == "sum":
            loss = y.sum()
        elif spec.loss == "mean":
            loss = y.mean()
        elif spec.loss == "mse_target":
            loss = F.mse_loss(y, target)
        elif spec.loss == "cross_entropy":
            loss = F.cross_entropy(y.reshape(-1, width), ids)
        else:
            loss = torch.amax(y, dim=-1).sum()
        return loss if aux is None else loss + aux.sum()

    return loss_fn


def build(spec: StackSpec) -> tuple[nn.Module, tuple, Any]:
    """``(model, example_inputs, loss_fn)`` of ``spec``, weights and inputs seeded 0."""
    torch.manual_seed(0)
    model = GenStack(spec)
    g = torch.Generator().manual_seed(1)
    if spec.input == "dense":
        x = torch.randn(spec.batch, spec.seq, spec.hidden, generator=g)
    else:
        x = torch.randint(0, VOCAB, (spec.batch, spec.seq), generator=g)
        x[0, 0] = 0  # the padding index occurs
    inputs: tuple = (x,)
    if spec.extra == "bias":
        inputs = (x, torch.randn(spec.seq, spec.hidden, generator=g))
    elif spec.extra == "mask":
        mask = torch.rand(spec.seq, spec.seq, generator=g) < 0.7
        mask |= torch.eye(spec.seq, dtype=torch.bool)  # every query sees a key
        inputs = (x, mask)
    width = VOCAB if spec.head != "none" else spec.hidden
    return model, inputs, _loss(spec, width)


# --------------------------------------------------------------------------- strategies


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def block_strategy(hidden: int, heads: int, seq: int, batch: int = 1) -> st.SearchStrategy[tuple]:
    """One block of a layer (see ``Block``)."""
    odd_kernels = [k for k in (1, 3, 5) if k <= max(1, 2 * seq + 1)]
    return st.one_of(
        st.tuples(st.just("linear"), st.booleans()),
        st.tuples(st.just("mlp"), st.sampled_from([1, 2, 3]), st.sampled_from(ACTIVATIONS)),
        st.tuples(st.just("norm"), st.sampled_from(["layernorm", "rmsnorm", "batchnorm_eval"])),
        # GroupNorm in training needs more than one value per group: (hidden / groups) * seq > 1
        st.tuples(st.just("norm"), st.just("groupnorm"),
                  st.sampled_from([g for g in _divisors(hidden) if (hidden // g) * seq > 1])),
        st.tuples(st.just("act"), st.sampled_from(ACTIVATIONS)),
        st.tuples(st.just("inplace"), st.sampled_from(["relu_", "tanh_", "mul_", "add_"])),
        st.tuples(st.just("views"), st.integers(0, 2)),
        st.tuples(st.just("slice_cat"), st.integers(1, hidden)),
        st.tuples(st.just("softmax"), st.sampled_from([-1, 1]), st.booleans()),
        st.tuples(st.just("sdpa"), st.booleans(), st.sampled_from([0.0, 0.0, 0.1])),
        st.tuples(st.just("eager_attention"), st.booleans()),
        st.tuples(st.just("dropout"), st.sampled_from([0.1, 0.5])),
        st.tuples(st.just("mask_fill")),
        st.tuples(st.just("shared")),
        st.tuples(st.just("buffer_scale")),
        st.tuples(st.just("cast"), st.sampled_from(["bf16", "fp16"])),
        st.tuples(st.sampled_from(["gather", "scatter", "index_select", "index_add", "einsum", "extra"])),
        st.tuples(st.just("cumsum"), st.sampled_from([1, -1])),
        st.tuples(st.just("conv1d"), st.sampled_from(odd_kernels), st.sampled_from(_divisors(hidden))),
        st.tuples(st.just("reduce"), st.sampled_from(["amax", "mean", "logsumexp"])),
        st.tuples(st.just("pool"), st.sampled_from(["max", "avg"]), st.sampled_from([1, 3])),
        st.tuples(st.just("item_branch")),
    ) | (
        # BatchNorm in training needs more than one value per channel: batch * seq > 1
        st.tuples(st.just("norm"), st.just("batchnorm_train")) if batch * seq > 1 else st.nothing()
    )


@st.composite
def stack_specs(draw: Any, max_blocks: int = 4) -> StackSpec:
    """A random StackSpec: odd small sizes, 1 to 4 layers, 1 to ``max_blocks`` blocks."""
    heads = draw(st.sampled_from([1, 2]))
    hidden = heads * draw(st.sampled_from([2, 3, 4, 5, 8]))
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(1, 9))
    blocks = tuple(draw(st.lists(block_strategy(hidden, heads, seq, batch), min_size=1, max_size=max_blocks)))
    inp = draw(st.sampled_from(["dense", "dense", "embedding", "embedding_padding"]))
    head = draw(st.sampled_from(["none", "linear"] + (["tied"] if inp != "dense" else [])))
    losses = ["sum_sq", "sum", "mean", "mse_target", "amax"] + (["cross_entropy"] if head != "none" else [])
    extra = draw(st.sampled_from(["none", "none", "bias", "mask"]))
    # an "extra" block adds the extra input only when it is a bias: layers of only such
    # blocks otherwise run no op at all, and nothing of the traced step lies in the stack
    # (refused with LayerStackNotFound): not a stack
    assume(extra == "bias" or any(b != ("extra",) for b in blocks))
    return StackSpec(
        batch=batch, seq=seq, hidden=hidden, heads=heads,
        num_layers=draw(st.integers(1, 4)),
        blocks=blocks, input=inp, head=head,
        loss=draw(st.sampled_from(losses)),
        tuple_layers=draw(st.booleans()),
        extra=extra,
        container=draw(st.sampled_from(["list", "list", "dict"])),
        decoder_layers=draw(st.sampled_from([0, 0, 1, 2, 3])),
    )
