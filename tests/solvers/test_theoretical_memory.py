"""Korthikanti et al. 2022's activation formula (solvers.theoretical_memory) against the
paper's Table 2 terms, written out here from their definitions."""

from __future__ import annotations

import math

import pytest

from solvers.errors import InvalidSchedule
from solvers.theoretical_memory import (
    TransformerShape,
    layer_activation_bytes,
    megatron_activation_bytes,
    outer_activation_bytes,
)

# GPT-3 175B's shape (Korthikanti et al. 2022, Table 3), micro-batch 2
GPT3 = TransformerShape(seq=2048, micro_batch=2, hidden=12288, ffn_hidden=4 * 12288, num_heads=96,
                        num_layers=96, vocab=51200)


def test_table_2_per_layer_terms():
    s, b, h, a = GPT3.seq, GPT3.micro_batch, GPT3.hidden, GPT3.num_heads
    # no parallelism row: sbh(34 + 5as/h); selective: 34sbh; full: 2sbh (the layer input, 16-bit)
    assert layer_activation_bytes(GPT3, "none") == s * b * h * 34 + 5 * a * s * s * b
    assert layer_activation_bytes(GPT3, "selective") == 34 * s * b * h
    assert layer_activation_bytes(GPT3, "full") == 2 * s * b * h


def test_megatron_generalises_the_mlp_term():
    """18 + 4·ffn/h: an FFN of 8/3·h (Llama's SwiGLU width) counts 18 + 32/3."""
    shape = TransformerShape(seq=8, micro_batch=3, hidden=12, ffn_hidden=32, num_heads=2, num_layers=4, vocab=10)
    sbh = 8 * 3 * 12
    assert layer_activation_bytes(shape, "selective") == 18 * sbh + 4 * sbh * 32 // 12


@pytest.mark.parametrize("k", [1, 2, 5, 96])
def test_uniform_saves_a_checkpoint_per_group_and_rebuilds_one_group(k):
    got = megatron_activation_bytes(GPT3, "uniform", k)
    sbh = GPT3.seq * GPT3.micro_batch * GPT3.hidden
    assert got == math.ceil(96 / k) * 2 * sbh + k * 34 * sbh + outer_activation_bytes(GPT3)


def test_block_limits():
    none = megatron_activation_bytes(GPT3, "none")
    assert megatron_activation_bytes(GPT3, "block", 0) == none
    assert none == 96 * layer_activation_bytes(GPT3, "selective") + outer_activation_bytes(GPT3)
    # block(N=L) is uniform(K=1): L checkpoints and one rebuilt layer
    assert megatron_activation_bytes(GPT3, "block", 96) == megatron_activation_bytes(GPT3, "uniform", 1)
    full_attention = megatron_activation_bytes(GPT3, "none", attention="none")
    assert full_attention - none == 96 * 5 * 96 * 2048 * 2048 * GPT3.micro_batch


def test_outer_terms():
    s, b, h, v = GPT3.seq, GPT3.micro_batch, GPT3.hidden, GPT3.vocab
    assert outer_activation_bytes(GPT3) == 8 * s * b + s * b * h + 4 * s * b * h * (1 + v // h) + 4 * s * b * (v % h)


@pytest.mark.parametrize("call", [
    lambda: layer_activation_bytes(GPT3, "partial"),
    lambda: megatron_activation_bytes(GPT3, "uniform", 0),
    lambda: megatron_activation_bytes(GPT3, "uniform", 97),
    lambda: megatron_activation_bytes(GPT3, "block", -1),
    lambda: megatron_activation_bytes(GPT3, "selective"),
    lambda: megatron_activation_bytes(GPT3, attention="flash"),
])
def test_bad_arguments_are_refused(call):
    with pytest.raises(InvalidSchedule):
        call()
