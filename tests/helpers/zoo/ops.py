"""Zoo models of losses and odd ops, and of the data-dependent ops that are refused."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from remat_pass.errors import RematError, UnsupportedGraph

from .common import (
    B, T, D, Block, Built, Stack, ZooEntry, frozen_stack, layers_of, refused, seeded, sq,
    stack_of, x,
)


# ---- 11. losses and odd ops --------------------------------------------------------------


def closure_loss_build() -> Built:
    torch.manual_seed(0)
    target = x(seed=3)
    return Stack(layers_of(3), return_hidden=True), (x(),), lambda y: sq(y - target)


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class OutputNet(Stack):
    """Keyword inputs; returns an object with ``.loss``."""

    def forward(self, x, labels=None):
        for b in self.blocks:
            x = b(x)
        return Output(loss=sq(x - labels), logits=x)


class Empty(nn.Module):
    """Zero-size intermediates."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.cat([torch.tanh(self.fc(x)), x[:, :0] * x[:, :0]], 1) + x


class Spectral(nn.Module):
    """Complex intermediates (rfft / irfft)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        f = torch.fft.rfft(self.fc(x), dim=-1)
        return torch.fft.irfft(f * f.conj(), n=D, dim=-1) + x


class Parallel(Stack):
    """Every layer reads the input; the outputs are summed."""

    def forward(self, x):
        return sq(sum(b(x) for b in self.blocks))


class MoE(nn.Module):
    """A layer holding a ModuleList of 4 experts (longer than the 2-layer stack)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 4)
        self.experts = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])

    def forward(self, x):
        g = torch.softmax(self.gate(x), -1)
        return x + sum(g[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class SDPA(nn.Module):
    """scaled_dot_product_attention over a fused qkv projection."""

    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.dropout_p = dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)
        return y.transpose(1, 2).reshape(B, T, D) + x


class TopK(nn.Module):
    """topk, sort and max (values and integer indices), and scatter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        v, i = h.topk(4, -1)
        ordered, _ = h.sort(-1)
        top, _ = h.max(-1, keepdim=True)
        return torch.tanh(h) * top + ordered + x.scatter(-1, i, v)


class Item(Block):
    def forward(self, x):
        return self.fc1(x) * float(x.abs().max().item())


class Branch(Block):
    def forward(self, x):
        return self.fc1(x) if x.sum() > 0 else -self.fc1(x)


class MaskIndex(Block):
    def forward(self, x):
        h = self.fc1(x)
        return h[h > 0].sum() + x


class MaskedSelect(Block):
    def forward(self, x):
        h = self.fc1(x)
        return torch.masked_select(h, h > 0).sum() + x


def hidden_stack() -> Stack:
    return Stack(layers_of(2), return_hidden=True)


# ---- the entries ---------------------------------------------------------------------


ENTRIES: tuple[ZooEntry, ...] = (
    # 11. losses and odd ops
    ZooEntry(
        "loss_closure_over_target_tensor",
        closure_loss_build,
        "a loss_fn closure over a target tensor that is not an input.",
        num_layers=3,
    ),
    ZooEntry(
        "model_returns_object_with_loss_and_kwargs",
        seeded(lambda: OutputNet(layers_of(3)), lambda: {"x": x(), "labels": x(seed=3)}),
        "keyword inputs (a dict) and an output object carrying .loss.",
        num_layers=3,
    ),
    ZooEntry(
        "zero_size_intermediates",
        stack_of(Empty),
        "zero-size tensors concatenated into the layer output.",
        num_layers=3,
    ),
    ZooEntry(
        "complex_intermediates",
        stack_of(Spectral, 2),
        "complex intermediates from rfft / irfft inside every layer.",
        num_layers=2,
    ),
    ZooEntry(
        "parallel_branches_not_a_chain",
        seeded(lambda: Parallel(layers_of(3))),
        "the layers run in parallel on one input, not as a chain.",
        num_layers=3,
    ),
    ZooEntry(
        "moe_layers_with_stack_named",
        stack_of(MoE, 2),
        "MoE layers each holding a ModuleList of 4 experts, the stack named.",
        num_layers=2,
        layers="blocks",
    ),
    ZooEntry(
        "moe_layers_stack_found_automatically",
        stack_of(MoE, 2),
        "MoE layers each holding a longer ModuleList of experts: the outer 'blocks' is found.",
        num_layers=2,
        expect_stack_path="blocks",
    ),
    ZooEntry(
        "sdpa_without_dropout",
        stack_of(SDPA, 2),
        "scaled_dot_product_attention with dropout_p=0 (CPU flash attention).",
        num_layers=2,
    ),
    ZooEntry(
        "sdpa_with_dropout",
        stack_of(lambda: SDPA(0.1), 2),
        "scaled_dot_product_attention with dropout_p=0.1, its RNG replayed.",
        num_layers=2,
    ),
    ZooEntry(
        "multi_output_ops_with_integer_results",
        stack_of(TopK),
        "multi-output ops with integer results (topk, sort, max) and scatter.",
        num_layers=3,
    ),
    ZooEntry(
        "data_dependent_item_specialized",
        stack_of(Item, 2),
        ".item() on an activation: traced specialized to the batch's value (JointGraph.specialized).",
        num_layers=2,
    ),
    ZooEntry(
        "data_dependent_branch_specialized",
        stack_of(Branch, 2),
        "Python control flow on a tensor's value: traced specialized to the batch's path.",
        num_layers=2,
    ),
    ZooEntry(
        "data_dependent_mask_index_specialized",
        stack_of(MaskIndex, 2),
        "boolean-mask indexing (data-dependent shape): traced specialized to the rows it selects in this batch.",
        num_layers=2,
    ),
    ZooEntry(
        "data_dependent_masked_select_is_refused",
        stack_of(MaskedSelect, 2),
        "masked_select (a data-dependent shape not specialized): refused as UnsupportedGraph naming it.",
        refusal=refused(UnsupportedGraph, "masked_select"),
    ),
    ZooEntry(
        "non_scalar_loss_is_refused",
        seeded(hidden_stack, loss_fn=lambda y: y.sum(-1)),
        "a loss_fn returning a non-scalar: RematError naming 'scalar'.",
        refusal=refused(RematError, "scalar"),
    ),
    ZooEntry(
        "non_scalar_output_without_loss_fn_is_refused",
        seeded(hidden_stack),
        "a model returning hidden states and no loss_fn: RematError naming 'scalar'.",
        refusal=refused(RematError, "scalar"),
    ),
    ZooEntry(
        "integer_loss_is_refused",
        seeded(hidden_stack, loss_fn=lambda y: (y > 0).sum()),
        "a loss that is an integer count, not differentiable: RematError.",
        refusal=refused(RematError),
    ),
    ZooEntry(
        "nothing_requires_grad_is_refused",
        seeded(frozen_stack(2)),
        "every parameter frozen and no input requiring grad: RematError naming 'requires grad'.",
        refusal=refused(RematError, "requires grad"),
    ),
)
