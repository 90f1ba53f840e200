"""Megatron-LM's own estimate of a launch command (``models.megatron_formula``, after
``report_theoretical_memory``): its parameter count against the Megatron-Core model the
command builds (every parameter but the linear biases and the position embedding, which
the formula leaves out), and its terms against Korthikanti et al. 2022's Table 2 at two
sizes."""

from __future__ import annotations

import pytest

from remat_pass.models.megatron_args import read_megatron_command
from remat_pass.models.megatron_formula import megatron_estimate

COMMAND = ("--num-layers 3 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --seq-length 32 "
           "--vocab-size 200 --micro-batch-size 2").split()


@pytest.mark.usefixtures("megatron_torn_down")
def test_the_parameters_counted_are_the_model_s_less_biases_and_position_embedding():
    """Tied (Megatron-LM's default: the output layer reads the word embedding) and
    untied."""
    pytest.importorskip("megatron.core")
    from remat_pass.models.megatron import megatron_gpt

    command = read_megatron_command(COMMAND)
    model, _, _ = megatron_gpt(batch=command.batch, seq=command.seq, **command.factory_kwargs)
    left_out = sum(p.numel() for n, p in model.named_parameters()
                   if "position_embeddings" in n or (n.endswith(".bias") and ".linear_" in n))
    assert left_out > 0
    assert megatron_estimate(command).parameters == sum(p.numel() for p in model.parameters()) - left_out
    untied = read_megatron_command([*COMMAND, "--untie-embeddings-and-output-weights"])
    assert untied.factory_kwargs["tied_embeddings"] is False and command.factory_kwargs["tied_embeddings"] is True
    model, _, _ = megatron_gpt(batch=untied.batch, seq=untied.seq, **untied.factory_kwargs)
    assert model.output_layer.weight is not None
    assert megatron_estimate(untied).parameters == sum(p.numel() for p in model.parameters()) - left_out


def test_activations_grow_by_34_sbh_per_layer_and_2_sb_per_vocabulary_entry():
    """Table 2 (no recompute, no parallelism, without the attention-score term) per
    layer: 34 s b h bytes; the logits: 2 bytes per (token, vocabulary entry); times 1.05."""
    one = megatron_estimate(read_megatron_command(COMMAND))
    more_layers = megatron_estimate(read_megatron_command([a if a != "3" else "5" for a in COMMAND]))
    s, b, h = 32, 2, 64
    assert more_layers.activation_bytes - one.activation_bytes == pytest.approx(2 * 34 * s * b * h * 1.05, abs=1)
    wider = megatron_estimate(read_megatron_command([a if a != "200" else "328" for a in COMMAND]))  # 256 -> 384
    assert wider.activation_bytes - one.activation_bytes == pytest.approx(2 * s * b * 128 * 1.05, abs=1)
    assert one.weight_and_optimizer_bytes == 18 * one.parameters
    assert one.total_bytes == one.weight_and_optimizer_bytes + one.activation_bytes
    assert any("no term for the recompute setting" in d for d in one.leaves_out)
