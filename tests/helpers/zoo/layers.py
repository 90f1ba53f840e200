"""Zoo models of torch's own modules as layers, and of stack shapes to find or refuse."""

from __future__ import annotations

import torch
from torch import nn

from remat_pass.errors import LayerStackNotFound

from .common import (
    B, T, D, Block, Stack, ZooEntry, layers_of, refused, seeded, sq, stack, stack_of, x,
)


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


# ---- the entries ---------------------------------------------------------------------


ENTRIES: tuple[ZooEntry, ...] = (
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
)
