"""Zoo models that mutate or alias: in-place ops, views, hooks, parametrizations, buffers."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils import parametrizations

from remat_pass.errors import UnsupportedGraph

from .common import (
    B, T, D, Block, Stack, ZooEntry, in_eval, layers_of, refused, seeded, sq, stack, stack_of,
)


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


# ---- the entries ---------------------------------------------------------------------


ENTRIES: tuple[ZooEntry, ...] = (
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
        "spectral_norm_power_iteration",
        seeded(parametrized_stack(2, parametrizations.spectral_norm, "fc1")),
        "spectral_norm updates its u/v buffers in train mode: buffer writes traced "
        "functionally (their new values are forward outputs).",
        num_layers=2,
    ),
    # 5. buffers
    ZooEntry(
        "buffers_read_inside_layers",
        stack_of(Scaled),
        "float and int64 buffers owned by every layer, one read in forward.",
        num_layers=3,
    ),
    ZooEntry(
        "batchnorm_train_mode",
        stack_of(BNBlock, 2, loss_fn=sq),
        "BatchNorm in train mode updates running stats and num_batches_tracked: buffer "
        "writes traced functionally (their new values are forward outputs).",
        num_layers=2,
    ),
    ZooEntry(
        "buffer_written_in_place",
        stack_of(Counter, 2, loss_fn=sq),
        "a layer accumulating into its own buffer in place: traced functionally.",
        num_layers=2,
    ),
    ZooEntry(
        "batchnorm_eval_mode",
        seeded(in_eval(lambda: stack(2, BNBlock))),
        "BatchNorm in eval mode reads its running stats as buffers.",
        num_layers=2,
    ),
)
