"""Layers whose step asks for a tensor's value (``.item()``: ``aten._local_scalar_dense``,
issue 23): one picks a path by it, one a count, one a boolean mask's shape, a
mixture-of-experts layer its tokens per expert (``nonzero``), one a shape that is refused
(``masked_select``); and a layer that calls flex attention."""

from __future__ import annotations

import torch
import torch.nn as nn

D = 8


class BranchOnMean(nn.Module):
    """A Python ``if`` on ``.item()`` picks ReLU or tanh; ``.item()`` also scales the output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y = torch.relu(y) if y.mean().item() > 0 else torch.tanh(y)
        k = int((x > 0).sum().item())  # a count for this batch
        return y * (k % 3 + 1) + x


class MaskSelect(nn.Module):
    """Boolean-mask indexing: the output's shape depends on the data."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return x + y[y > 0].sum()


class MaskedSelect(nn.Module):
    """``torch.masked_select``: a data-dependent shape that is not specialized."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return x + torch.masked_select(y, y > 0).sum()


class MoE(nn.Module):
    """Top-2 routing over ``experts`` experts, run as transformers' eager experts loop: for
    each expert hit, the tokens routed to it (``torch.where`` over a one-hot mask: a
    nonzero whose rows are that expert's token count) through its MLP, added back with
    ``index_add_``; a residual around it."""

    def __init__(self, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.router = nn.Linear(D, experts, bias=False)
        self.up = nn.ModuleList([nn.Linear(D, 2 * D) for _ in range(experts)])
        self.down = nn.ModuleList([nn.Linear(2 * D, D) for _ in range(experts)])
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        weights, chosen = torch.topk(torch.softmax(self.router(h), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = nn.functional.one_hot(chosen, num_classes=self.experts).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        for e in hit:
            e = int(e[0])
            slot, token = torch.where(mask[e])
            y = self.down[e](torch.relu(self.up[e](h[token]))) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return x + out.reshape(x.shape)


def moe(layers: int = 3, batch: int = 2, seq: int = 8, seed: int = 1):
    """A stack of MoE layers, one (B, T, D) input (``seed`` picks the batch, so the routing)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[MoE() for _ in range(layers)])
    x = torch.randn(batch, seq, D, generator=torch.Generator().manual_seed(seed))
    return model, (x,), lambda y: (y * y).mean()


def branchy(layers: int = 3, batch: int = 2, seq: int = 4):
    """A stack of BranchOnMean layers, one (B, T, D) input, a squared loss."""
    torch.manual_seed(0)
    model = nn.Sequential(*[BranchOnMean() for _ in range(layers)])
    x = torch.randn(batch, seq, D, generator=torch.Generator().manual_seed(1))
    return model, (x,), lambda y: (y * y).mean()


class FlexAttention(nn.Module):
    """Self-attention through ``torch.nn.attention.flex_attention`` (torchtitan's flex variant)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return x + flex_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
