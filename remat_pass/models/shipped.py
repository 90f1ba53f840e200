"""Models that ship with the project: the default GPT-2 and a small hand-written GPT.

A model factory returns ``(model, example_inputs, loss_fn)``; ``loss_fn(output) ->
scalar`` may be None when the output is the loss or carries ``.loss``. The command
line's ``--model module:factory`` takes any such callable; ``--batch``, ``--seq`` and
``--layers`` are passed to it as keyword arguments when given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_BATCH = 4
DEFAULT_SEQ = 256
DEFAULT_LAYERS = 12


def gpt2(
    batch: int = DEFAULT_BATCH,
    seq: int = DEFAULT_SEQ,
    layers: int = DEFAULT_LAYERS,
    hidden: int = 256,
    heads: int = 4,
    vocab: int = 4096,
    dropout: float = 0.1,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor], None]:
    """The default model: Hugging Face ``GPT2LMHeadModel`` from a ``GPT2Config`` with
    random weights (no download), in train mode, fp32 on CPU.

    Args:
        batch, seq: input shape (token ids ``[batch, seq]``, int64); labels = ids.
        layers: number of transformer layers (``n_layer``).
        hidden, heads, vocab: ``n_embd``, ``n_head``, ``vocab_size``.
        dropout: GPT-2's residual, embedding and attention dropout (replayed exactly
            under recompute).
        seed: seeds the weights and the token ids.

    Returns:
        ``(model, {"input_ids": ids, "labels": ids}, None)``: the model returns
        ``.loss`` (shifted next-token cross entropy).

    Raises:
        ImportError: ``transformers`` is not installed (``pip install transformers``).
    """
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=max(seq, 8),
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, {"input_ids": ids, "labels": ids}, None


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal SDPA attention and a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class TinyGPT(nn.Module):
    """A small hand-written GPT (case C1): embedding, ``layers`` pre-LN blocks in
    ``self.blocks``, final LayerNorm, vocabulary head; returns logits ``[B, T, vocab]``.
    """

    def __init__(self, vocab: int = 512, hidden: int = 256, heads: int = 4, layers: int = 8,
                 seq: int = 128, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt(
    batch: int = 8,
    seq: int = 128,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 4,
    vocab: int = 512,
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor], Any]:
    """Factory for TinyGPT with an fp32 next-token cross-entropy loss.

    Returns:
        ``(model, (ids,), loss_fn)`` with ids ``[batch, seq]`` int64.
    """
    torch.manual_seed(seed)
    model = TinyGPT(vocab, hidden, heads, layers, seq, dropout).train()
    # the batch is made on the CPU even under ``torch.device("meta")`` (--meta): the loss
    # closes over the targets, and a closure must hold real values
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed), device="cpu")
    targets = torch.roll(ids, -1, dims=1)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return model, (ids,), loss_fn


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """How a model splits into pipeline stages (torchtitan's convention): every stage
    is a copy of the model that keeps its share of the layer stack; modules of
    ``first`` stay only on the first stage and modules of ``last`` only on the last,
    the others are set to None and the model's forward skips them (so a middle stage
    maps an activation ``[batch, seq, hidden]`` to one of the same shape, and the last
    stage returns the loss when given the targets).

    Attributes:
        stack: module path of the layer stack (an ``nn.ModuleList``).
        first, last: attribute names of the outer modules of the first / last stage.
        hidden: the hidden size (the last dimension of the activation between stages).
    """

    stack: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    hidden: int


class Attention(nn.Module):
    """Causal self-attention with separate q / k / v / o projections (Llama's layout;
    grouped-query when ``kv_heads < heads``). Head counts are read off the projected
    shapes, so a tensor-parallel shard runs its local heads (torchtitan's Llama)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, bias: bool = False):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU (``w2(silu(w1 x) * w3 x)``, Llama) or GELU (``w2(gelu(w1 x))``, GPT-3)."""

    def __init__(self, dim: int, ffn: int, mlp: str = "swiglu", bias: bool = False):
        super().__init__()
        self.mlp = mlp
        self.w1 = nn.Linear(dim, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, dim, bias=bias)
        self.w3 = nn.Linear(dim, ffn, bias=bias) if mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); h + feed_forward(norm(h))``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, norm: str, mlp: str, bias: bool):
        super().__init__()
        make_norm = (lambda: nn.RMSNorm(dim)) if norm == "rms" else (lambda: nn.LayerNorm(dim))
        self.attention_norm = make_norm()
        self.attention = Attention(dim, heads, kv_heads, bias)
        self.ffn_norm = make_norm()
        self.feed_forward = FeedForward(dim, ffn, mlp, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TransformerLM(nn.Module):
    """A decoder-only LM in torchtitan's Llama layout (``tok_embeddings``, ``layers``,
    ``norm``, ``output``), RMSNorm + SwiGLU (Llama) or LayerNorm + GELU (GPT-3), no
    position embedding (rotary or learned: neither changes what a layer saves much). ``forward(tokens, targets=None)``: logits,
    or the fp32 next-token cross entropy when ``targets`` are given. Pipeline stages
    and tensor parallelism: ``pipeline_layout`` and ``tensor_parallel_plan``.
    """

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, ffn: int,
                 kv_heads: int | None = None, norm: str = "rms", mlp: str = "swiglu", bias: bool = False):
        super().__init__()
        kv = kv_heads or heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, kv, ffn, norm, mlp, bias) for _ in range(layers))
        self.norm = nn.RMSNorm(dim) if norm == "rms" else nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.pipeline_layout = PipelineLayout("layers", ("tok_embeddings",), ("norm", "output"), dim)
        self.shape = {"vocab": vocab, "dim": dim, "heads": heads, "kv_heads": kv, "ffn": ffn, "seq": seq}

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def tensor_parallel_plan(self, sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """torchtitan's ``apply_tp`` for Llama (loss_parallel off: the head's logits are
        all-gathered): ``(plan of the outer modules, plan of each layer)`` for
        ``torch.distributed.tensor.parallel.parallelize_module``. With sequence
        parallelism (Korthikanti et al. 2022) norms and residuals are sharded on the
        sequence dimension (``Shard(1)``) and the row-parallel outputs reduce-scatter;
        without it they are replicated and the row-parallel outputs all-reduce.
        Modules set to None (other pipeline stages') are left out."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        between = Shard(1) if sequence_parallel else Replicate()
        top: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate(), use_local_output=True),
        }
        if sequence_parallel:
            top["norm"] = SequenceParallel()
        layer = {
            "attention": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if self.layers and self.layers[0].feed_forward.w3 is not None:
            layer["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            layer["attention_norm"] = SequenceParallel()
            layer["ffn_norm"] = SequenceParallel()
        top = {k: v for k, v in top.items() if getattr(self, k) is not None}
        return top, layer


def tiny_llama(
    batch: int = 4,
    seq: int = 32,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    ffn: int = 128,
    vocab: int = 128,
    norm: str = "rms",
    mlp: str = "swiglu",
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], None]:
    """Factory for a small ``TransformerLM`` (the model of the distributed runs: it
    splits into pipeline stages and has torchtitan's tensor-parallel plan).

    Returns:
        ``(model, (ids, targets), None)``: ids and targets ``[batch, seq]`` int64; the
        model returns the loss when given the targets, so microbatches split both.
    """
    torch.manual_seed(seed)
    model = TransformerLM(vocab, hidden, heads, layers, seq, ffn, kv_heads, norm, mlp).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, (ids, torch.roll(ids, -1, dims=1)), None


def linear_chain(
    batch: int = 137, width: int = 256, layers: int = 8, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor], Any]:
    """``layers`` Linear(width, width) layers in an nn.Sequential; loss = sum of output.

    Case C4: each layer saves only its input, which is also its group's checkpoint.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))
    return model, (x,), lambda y: y.sum()


def load_factory(spec: str) -> Any:
    """Import ``module:factory`` and return the callable.

    Raises:
        ValueError: ``spec`` is not ``module:attribute``, or the attribute is missing or
            not callable.
        ImportError: the module cannot be imported.
    """
    import importlib

    if ":" not in spec:
        raise ValueError(f"--model must be module:factory (e.g. remat_pass.models:gpt2), got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    module = importlib.import_module(mod_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{attr!r} in module {mod_name!r} is missing or not callable")
    return factory


def build(spec: str = "remat_pass.models:gpt2", **kwargs: Any) -> tuple[nn.Module, Any, Any]:
    """Call the factory ``spec`` with the keyword arguments it accepts among ``kwargs``
    (those that are None are dropped).

    Raises:
        ValueError: the factory rejects an argument the user gave, raises, or returns
            something other than ``(model, example_inputs, loss_fn)`` with inputs a
            Tensor, a tuple / list or a dict and ``loss_fn`` None or callable (the
            message names the factory).
    """
    import inspect

    factory = load_factory(spec)
    given = {k: v for k, v in kwargs.items() if v is not None}
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in given if k not in params and not takes_any]
    if unknown:
        raise ValueError(f"factory {spec} takes no argument {', '.join(unknown)}")
    try:
        result = factory(**given)
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported, named
        raise ValueError(f"factory {spec} raised {type(e).__name__}: {e}") from e
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], nn.Module)):
        got = type(result).__name__ + (f" of {len(result)}" if isinstance(result, tuple) else "")
        raise ValueError(f"factory {spec} must return (model, example_inputs, loss_fn); it returned a {got}")
    _, inputs, loss_fn = result
    if not isinstance(inputs, (torch.Tensor, tuple, list, dict)):
        raise ValueError(
            f"factory {spec} returned example inputs of type {type(inputs).__name__}; they must be a "
            "Tensor, a tuple / list of positional arguments or a dict of keyword arguments"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"factory {spec} returned a loss_fn of type {type(loss_fn).__name__}: "
                         "it must be None or a callable output -> scalar loss")
    return result

