"""Zoo models by their tensors: dtypes, random ops, tied and frozen parameters, inputs."""

from __future__ import annotations

import torch
from torch import nn

from remat_pass.recompute import schedule as schedules
from remat_pass.evaluate.session import Session

from .common import (
    D, VOCAB, Block, Stack, ZooEntry, frozen_stack, ids, in_eval, layers_of, seeded, sq, stack,
    stack_of, x,
)


# ---- 6. dtypes ------------------------------------------------------------------------


class Upcast(nn.Module):
    """A float32 softmax inside a bfloat16 layer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return torch.softmax(h.float(), -1).to(x.dtype) * h + x


def sq_float(y: torch.Tensor) -> torch.Tensor:
    """``sq`` in float32."""
    return sq(y.float())


# ---- 7. random ops --------------------------------------------------------------------


class Random(Block):
    """Dropout, rand_like, randn, bernoulli and randperm in one layer."""

    def forward(self, x):
        h = nn.functional.dropout(torch.tanh(self.fc1(x)), 0.3, True)
        h = h * torch.rand_like(h) + torch.randn(h.shape)
        h = h * torch.bernoulli(torch.full_like(h, 0.7))
        perm = torch.randperm(h.shape[1])
        return self.fc2(h[:, perm]) + x


class RandomNet(Stack):
    def forward(self, x):
        x = nn.functional.dropout(x + torch.randn_like(x), 0.2, True)
        return super().forward(x)


def check_rng_replayed(session: Session) -> None:
    """uniform(K=1) replays the RNG of at least the 4 random ops of each of 3 layers."""
    step, _, _ = session.prepare(schedules.uniform(1, 3))
    assert sum(len(seg.rng_replayed) for seg in step.segments) >= 3 * 4


class Masked(Block):
    """Draws a random mask that the next layer and the loss read."""

    def forward(self, x, mask):
        h = torch.tanh(self.fc1(x))
        if mask is not None:
            h = h * mask
        return self.fc2(h) + x, torch.bernoulli(torch.full_like(h, 0.8)) * h


class MaskedNet(Stack):
    def forward(self, x):
        mask = None
        for b in self.blocks:
            x, mask = b(x, mask)
        return sq(x) + sq(mask)


class Drop(Block):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc1(x))) + x


def linear_dropout() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5))


# ---- 8. tied, frozen, input gradients --------------------------------------------------


class TiedLM(nn.Module):
    """Embedding and LM head share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(layers_of(3))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, target):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def frozen_middle_tied_lm() -> TiedLM:
    model = TiedLM()
    model.blocks[1].requires_grad_(False)
    return model


def check_frozen_layer_has_no_grads(session: Session) -> None:
    """The frozen layer's parameters get no gradient (None), not a zero one."""
    labels, grads = session.joint.primal_labels, session.reference_grads
    frozen = [g for label, g in zip(labels, grads) if label.startswith("blocks.1.")]
    assert frozen and all(g is None for g in frozen)
def check_input_grad_matches_autograd(session: Session) -> None:
    """The gradient of ``input[0]`` matches ``torch.autograd.grad`` to 1e-5."""
    model, (inp,) = session.joint.model, session.example_inputs
    (ref,) = torch.autograd.grad(model(inp), [inp])
    got = session.reference_grads[session.joint.primal_labels.index("input[0]")]
    assert (got - ref).abs().max() <= 1e-5


class Two(Stack):
    """Two inputs, added."""

    def forward(self, a, b):
        return super().forward(a + b)


def same_tensor_twice() -> tuple[torch.Tensor, torch.Tensor]:
    t = x()
    return t, t


def tensor_and_its_view() -> tuple[torch.Tensor, torch.Tensor]:
    t = x()
    return t, t[:, :, :]


class Nested(Stack):
    """A dict of a list of tensors as the input."""

    def forward(self, batch):
        return super().forward(batch["x"][0] + batch["x"][1])


class Gate(Block):
    """A gate computed under no_grad, and a detached residual."""

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.fc2(x))
        return torch.tanh(self.fc1(x)) * g + x.detach() + x


# ---- the entries ---------------------------------------------------------------------


ENTRIES: tuple[ZooEntry, ...] = (
    # 6. dtypes
    ZooEntry(
        "float64",
        seeded(lambda: stack(3).double(), lambda: (x(dtype=torch.float64),)),
        "float64 weights and activations.",
        num_layers=3,
    ),
    ZooEntry(
        "bfloat16",
        seeded(lambda: stack(3).to(torch.bfloat16), lambda: (x(dtype=torch.bfloat16),), sq_float),
        "bfloat16 weights and activations, a float32 loss.",
        num_layers=3,
        eager_grad_tolerance=1e-1,
    ),
    ZooEntry(
        "bfloat16_layer_upcasts_to_float32",
        seeded(
            lambda: stack(3, Upcast).to(torch.bfloat16),
            lambda: (x(dtype=torch.bfloat16),),
            sq_float,
        ),
        "bfloat16 layers that compute a softmax in float32 and cast back.",
        num_layers=3,
        eager_grad_tolerance=1e-1,
    ),
    ZooEntry(
        "float16_matmuls",
        seeded(lambda: stack(2).to(torch.float16), lambda: (x(dtype=torch.float16),), sq_float),
        "float16 matmuls: on CPUs with AVX512-FP16 or AMX they allocate oneDNN scratch, "
        "elsewhere none (calibrated either way).",
        num_layers=2,
        eager_grad_tolerance=1e-1,
    ),
    # 7. random ops
    ZooEntry(
        "random_ops_in_layers_and_outer_region",
        seeded(lambda: RandomNet(layers_of(3, Random))),
        "dropout, rand_like, randn, bernoulli and randperm in layers and in the outer "
        "region, replayed exactly under recompute.",
        num_layers=3,
        check=check_rng_replayed,
    ),
    ZooEntry(
        "random_mask_passed_to_next_layer_and_loss",
        seeded(lambda: MaskedNet(layers_of(3, Masked))),
        "a random mask drawn in one layer, read by the next layer and by the loss.",
        num_layers=3,
    ),
    ZooEntry(
        "dropout_module_only",
        stack_of(Drop),
        "nn.Dropout as the only random op.",
        num_layers=3,
    ),
    ZooEntry(
        "dropout_in_eval_mode",
        seeded(in_eval(lambda: stack(2, linear_dropout))),
        "nn.Dropout in eval mode, which draws nothing.",
        num_layers=2,
    ),
    # 8. tied, frozen, input gradients
    ZooEntry(
        "tied_embedding_and_head",
        seeded(TiedLM, lambda: (ids(1), ids(2))),
        "an embedding and LM head sharing one weight, cross-entropy loss.",
        num_layers=3,
    ),
    ZooEntry(
        "frozen_layer",
        seeded(frozen_middle_tied_lm, lambda: (ids(1), ids(2))),
        "a frozen middle layer, whose parameters must get no gradient.",
        num_layers=3,
        check=check_frozen_layer_has_no_grads,
    ),
    ZooEntry(
        "all_parameters_frozen_input_requires_grad",
        seeded(frozen_stack(2), lambda: (x().requires_grad_(),)),
        "every parameter frozen, the only gradient is the input's.",
        num_layers=2,
        check=check_input_grad_matches_autograd,
    ),
    ZooEntry(
        "input_requires_grad",
        seeded(lambda: stack(3), lambda: (x().requires_grad_(),)),
        "an input that requires grad next to the parameters.",
        num_layers=3,
        check=check_input_grad_matches_autograd,
    ),
    ZooEntry(
        "same_tensor_passed_twice",
        seeded(lambda: Two(layers_of(2)), same_tensor_twice),
        "one tensor passed as two inputs.",
        num_layers=2,
    ),
    ZooEntry(
        "tensor_and_its_view_as_inputs",
        seeded(lambda: Two(layers_of(2)), tensor_and_its_view),
        "a tensor and a view of it passed as two inputs.",
        num_layers=2,
    ),
    ZooEntry(
        "nested_list_and_dict_inputs",
        seeded(lambda: Nested(layers_of(2)), lambda: ({"x": [x(), x(seed=5)]},)),
        "a dict holding a list of tensors as the input.",
        num_layers=2,
    ),
    ZooEntry(
        "no_grad_region_and_detach_in_layer",
        stack_of(Gate),
        "a no_grad region and a detached residual inside every layer.",
        num_layers=3,
    ),
)
