"""Models as their users write them, with no attribute of this project: the per-rank
paths must find their layer stack and split them (``parallel.stages``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlainBlock(nn.Module):
    """A pre-LayerNorm block: causal attention and a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln_2(x))))


class PlainGPT(nn.Module):
    """Embedding, an ``nn.ModuleList`` of blocks, a final norm and a head;
    ``forward(ids, targets)`` returns the fp32 cross entropy (nanoGPT's shape of code)."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.h = nn.ModuleList(PlainBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def plain_gpt(batch: int = 4, seq: int = 16, layers: int = 4, hidden: int = 32, heads: int = 4, vocab: int = 64,
              seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Any]:
    """Factory: ``(PlainGPT, (ids, targets), None)``, ids ``[batch, seq]`` int64."""
    torch.manual_seed(seed)
    model = PlainGPT(vocab, hidden, heads, layers).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, (ids, torch.roll(ids, -1, dims=1)), None
