"""A GPT whose layers sit in an ``nn.ModuleDict`` keyed "0".."L-1" (torchtitan's Llama 3
layout: ``self.layers = nn.ModuleDict()``, ``for layer in self.layers.values()``).
``dict_gpt`` is a ``--model module:factory`` factory."""

from __future__ import annotations

import torch
import torch.nn as nn

from remat_pass.models import tiny_gpt
from remat_pass.models.shipped import TinyGPT


class DictGPT(TinyGPT):
    """TinyGPT with its blocks moved into ``self.layers``, an ``nn.ModuleDict``."""

    def __init__(self, model: TinyGPT):
        nn.Module.__init__(self)
        self.tok, self.pos, self.ln_f, self.head = model.tok, model.pos, model.ln_f, model.head
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(model.blocks)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.ln_f(x))


def dict_gpt(layers: int = 3, batch: int = 2, seq: int = 16):
    """A DictGPT (hidden 32, 2 heads, vocab 64), its token ids and next-token loss."""
    model, inputs, loss_fn = tiny_gpt(batch=batch, seq=seq, layers=layers, hidden=32, heads=2, vocab=64)
    return DictGPT(model).train(), inputs, loss_fn
