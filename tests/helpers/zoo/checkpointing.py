"""Zoo models with the user's own activation checkpointing (torch and HF GPT-2)."""

from __future__ import annotations

from typing import Callable

from torch.utils.checkpoint import checkpoint

from remat_pass.errors import UnsupportedGraph
from remat_pass.models import gpt2

from .common import Built, Stack, ZooEntry, refused, layers_of, seeded, sq, x


# ---- 12. the user's own activation checkpointing ---------------------------------------


class Ckpt(Stack):
    """Every layer under torch.utils.checkpoint."""

    def __init__(self, blocks, use_reentrant: bool):
        super().__init__(blocks)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.use_reentrant)
        return sq(x)


def hf_gpt2_checkpointed(reentrant: bool) -> Callable[[], Built]:
    def build() -> Built:
        model, inputs, loss_fn = gpt2(
            batch=2, seq=8, layers=2, hidden=16, heads=2, vocab=64, dropout=0.0
        )
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        return model, inputs, loss_fn

    return build


# ---- the entries ---------------------------------------------------------------------


ENTRIES: tuple[ZooEntry, ...] = (
    # 12. the user's own activation checkpointing
    ZooEntry(
        "torch_checkpoint_non_reentrant_in_model",
        seeded(lambda: Ckpt(layers_of(3), use_reentrant=False)),
        "the user's own non-reentrant torch.utils.checkpoint around every layer.",
        num_layers=3,
    ),
    ZooEntry(
        "torch_checkpoint_reentrant_in_model",
        seeded(lambda: Ckpt(layers_of(3), use_reentrant=True), lambda: (x().requires_grad_(),)),
        "the user's own reentrant torch.utils.checkpoint around every layer: refused, "
        "naming PyTorch's own reason (reentrant checkpoint cannot run under .grad()).",
        num_layers=3,
        refusal=refused(UnsupportedGraph, "use_reentrant=True, torch.utils.checkpoint is incompatible"),
    ),
    ZooEntry(
        "hf_gpt2_gradient_checkpointing_non_reentrant",
        hf_gpt2_checkpointed(reentrant=False),
        "HF GPT-2 with gradient_checkpointing_enable (non-reentrant); its packed-sequence "
        "check branches on tensor values when not compiling: traced specialized to the "
        "batch's value (JointGraph.specialized), the user's checkpoints inlined.",
        num_layers=2,
        requires=("transformers",),
    ),
    ZooEntry(
        "hf_gpt2_gradient_checkpointing_reentrant",
        hf_gpt2_checkpointed(reentrant=True),
        "HF GPT-2 with gradient_checkpointing_enable (reentrant): its packed-sequence check "
        "specialized to the batch, then refused naming PyTorch's own reason (reentrant "
        "checkpoint cannot run under .grad()).",
        num_layers=2,
        refusal=refused(UnsupportedGraph, "use_reentrant=True, torch.utils.checkpoint is incompatible"),
        requires=("transformers",),
    ),
)
