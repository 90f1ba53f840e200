"""Zoo models whose layers connect oddly: reuse, skips, per-layer losses, structured layer I/O.

One module instance used several times, skips across layers, per-layer losses, tuple /
dict layers and shared side inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from remat_pass.recompute import schedule as schedules
from remat_pass.errors import LayerStackNotFound
from remat_pass.evaluate.session import Session

from .common import T, D, Block, Stack, ZooEntry, refused, ids, layers_of, seeded, sq, stack_of, x


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


# ---- the entries ---------------------------------------------------------------------


ENTRIES: tuple[ZooEntry, ...] = (
    ZooEntry(
        "plain_stack", stack_of(Block), "the baseline: three Linear-tanh-Linear residual blocks.",
        num_layers=3,
    ),
    # 1. one module instance used several times
    ZooEntry(
        "same_instance_twice_in_modulelist",
        seeded(shared_instance_stack),
        "one Block instance at two positions of the ModuleList: refused (one module "
        "cannot have two layer indices), and tracing never replaces the model's own "
        "parameters (bug fixed in 1785695: a FunctionalTensor was left in the shared block).",
        num_layers=3,
        refusal=refused(LayerStackNotFound, "is the same module instance as blocks.0"),
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
)
