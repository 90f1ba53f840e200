"""Layers whose step asks for a tensor's value (``.item()``: ``aten._local_scalar_dense``,
issue 23): one picks a path by it, one a count, one a boolean mask's shape; and a layer
that calls flex attention."""

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
