"""A heterogeneous layer stack for the optimized-schedule benchmark and tests.

``hetero_gpt`` builds a small GPT whose ``blocks`` hold one class, ``MixedBlock``, with
different MLP widths and with or without attention, so the layers' costs differ.

It is a module (``benchmarks/optimized_schedule.py`` imports it); run alone it prints the
stack it builds, one line per layer (attention or not, MLP ratio, parameters) and the
loss of one forward:

    python benchmarks/hetero.py [--layers 6] [--batch 4] [--seq 32]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# (attention?, MLP ratio) per layer
DEFAULT_KINDS = ((True, 1), (True, 8), (False, 4), (True, 2), (True, 16), (False, 1))


class MixedBlock(nn.Module):
    """Pre-LayerNorm block: optional causal attention, then a GELU MLP of
    ``mlp_ratio * hidden`` units."""

    def __init__(self, hidden: int, heads: int, attention: bool, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.attention = attention
        if attention:
            self.ln_1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc_out = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class HeteroGPT(nn.Module):
    """Embedding, ``blocks`` (MixedBlock of varying kinds), final LayerNorm, head, and
    the fp32 cross-entropy loss against ``targets`` (an input, so its shape is symbolic)."""

    def __init__(self, vocab: int, hidden: int, heads: int, kinds, max_seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(MixedBlock(hidden, heads, a, r) for a, r in kinds)
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hetero_gpt(batch: int = 4, seq: int = 32, layers: int | None = None, hidden: int = 64,
               heads: int = 2, vocab: int = 128, seed: int = 0):
    """Factory ``(model, (ids, targets), None)``; ``layers`` takes the first kinds of
    ``DEFAULT_KINDS`` repeated as needed (default 6 layers)."""
    n = layers or len(DEFAULT_KINDS)
    kinds = [DEFAULT_KINDS[i % len(DEFAULT_KINDS)] for i in range(n)]
    torch.manual_seed(seed)
    model = HeteroGPT(vocab, hidden, heads, kinds, max_seq=max(seq, 512)).train()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return model, (ids, torch.roll(ids, -1, dims=1)), None


SYMBOLS = {"batch": [(0, 0), (1, 0)], "seq": [(0, 1), (1, 1)]}


def main(argv: list[str] | None = None) -> int:
    """Print the stack ``hetero_gpt`` builds (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=len(DEFAULT_KINDS), help="default: %(default)s")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args(argv)
    if min(args.layers, args.batch, args.seq) < 1 or args.seq > 512:
        ap.error("--layers, --batch and --seq must be at least 1, --seq at most 512 (the position table)")
    model, (ids, targets), _ = hetero_gpt(batch=args.batch, seq=args.seq, layers=args.layers)
    for i, block in enumerate(model.blocks):
        n = sum(p.numel() for p in block.parameters())
        print(f"layer {i}: attention {'yes' if block.attention else 'no '}, "
              f"MLP {block.fc.out_features // block.fc.in_features}x, {n} parameters")
    with torch.no_grad():
        print(f"loss of one forward (batch {args.batch}, seq {args.seq}): {model(ids, targets).item():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
