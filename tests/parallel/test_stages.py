"""Pipeline stages of models without this project's attributes (``parallel.stages``):
split where Megatron-LM splits them, by torch.distributed.pipelining, without processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from user_models import plain_gpt
from remat_pass.errors import InvalidOption
from remat_pass.models import tiny_llama
from remat_pass.parallel.ranks import microbatches
from remat_pass.parallel.stages import split_stages, stack_of


def test_a_plain_gpt_splits_at_megatrons_even_split_with_the_full_models_names():
    """4 layers over 2 stages: the embedding and h.0-1 on stage 0, h.2-3, the final norm
    and the head on stage 1; every parameter on exactly one stage, under its own name;
    the stages run one after the other give the full model's loss, bitwise."""
    model, inputs, _ = plain_gpt(batch=4, layers=4)
    mb = microbatches(inputs, 2)[0]
    assert stack_of(model) == ("h", 4)
    first, last = split_stages(model, mb, [0, 1], 2)
    names = [set(dict(s.module.named_parameters())) for s in (first, last)]
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("h.") else "") for n in names[0]} == {
        "wte", "h.0", "h.1"}
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("h.") else "") for n in names[1]} == {
        "h.2", "h.3", "ln_f", "lm_head"}
    assert names[0] | names[1] == set(dict(model.named_parameters())) and not names[0] & names[1]
    assert all(s.param_names == {n: n for n in ns} for s, ns in zip((first, last), names))
    assert (first.stack, last.stack) == ("h", "h") and first.boundary_shape == ()
    assert last.boundary_shape == (2, 16, 32) and last.boundary_dtype == torch.float32
    with torch.no_grad():
        x = first.module(mb[0])
        assert torch.equal(last.module(x, mb[1]), model(*mb))


def test_the_project_layout_still_splits_by_its_pipeline_layout():
    model, inputs, _ = tiny_llama(batch=4, seq=16, layers=4, hidden=32, ffn=64, vocab=64)
    stages = split_stages(model, microbatches(inputs, 2)[0], [0, 1], 2)
    assert stages[1].param_names["layers.0.attention.wq.weight"] == "layers.2.attention.wq.weight"
    assert stages[0].module.output is None and stages[1].module.tok_embeddings is None
    assert stages[1].boundary_shape == (2, 16, 32)


class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) * mask


class MaskedModel(nn.Module):
    """Makes a mask before its stack and passes it to every layer: two values cross
    each stage boundary."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(MaskedBlock() for _ in range(2))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        mask = (ids > 3).unsqueeze(-1).float()
        for layer in self.layers:
            x = layer(x, mask)
        return (x.sum(-1) - targets).pow(2).mean()


def test_a_split_whose_stages_pass_more_than_one_value_is_refused_naming_them():
    ids = torch.randint(0, 16, (2, 4))
    with pytest.raises(InvalidOption, match=r"stage 1 of the split at layers takes \[.*'targets'\].*more between its "
                                            r"layers.*pipeline_layout"):
        split_stages(MaskedModel(), (ids, ids.float()), [1], 2)


def test_a_model_without_a_layer_stack_cannot_be_split():
    with pytest.raises(InvalidOption, match="--pp splits the model's layer stack into stages, but .* no layer stack"):
        stack_of(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
