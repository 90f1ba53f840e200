"""models.megatron_args: a Megatron-LM launch command read with Megatron's names and
defaults; options not modelled yet and unknown options refused naming them."""

from __future__ import annotations

import pytest

from remat_pass.models.megatron_args import padded_vocab_size, read_megatron_command

BASE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
        "--vocab-size", "50257", "--micro-batch-size", "8"]


def test_shape_defaults_and_recompute_as_megatron_reads_them():
    c = read_megatron_command([*BASE, "--global-batch-size", "32", "--recompute-granularity", "full",
                               "--recompute-method", "uniform", "--recompute-num-layers", "2", "--lr", "1e-4"])
    assert c.factory_kwargs == dict(layers=8, hidden=256, heads=4, ffn_hidden=None, vocab=50304, max_positions=128,
                                    seed=1234, dropout=0.1, tied_embeddings=True)
    untied = read_megatron_command([*BASE, "--untie-embeddings-and-output-weights"])
    assert untied.factory_kwargs["tied_embeddings"] is False
    assert (c.batch, c.seq, c.microbatches, c.recompute, c.ignored) == (8, 128, 4, ("uniform", 2), ("--lr",))
    assert read_megatron_command(BASE).recompute == ("none", None)
    assert padded_vocab_size(32000, 128, 8) == 32768


@pytest.mark.parametrize("extra,says", [
    (["--swiglu"], "--swiglu is not modelled"),
    (["--foo", "1"], "unknown Megatron-LM option --foo"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0"),
    (["--recompute-method", "uniform"], "needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "needs --recompute-num-layers"),
    (["--recompute-granularity", "selective"], "--recompute-granularity selective"),
    (["--global-batch-size", "12"], "multiple of --micro-batch-size"),
    (["--normalization", "RMSNorm"], "--normalization RMSNorm"),
    (["--seq-length", "x"], "invalid int value"),
])
def test_what_is_not_modelled_or_wrong_is_refused_by_name(extra, says):
    with pytest.raises(ValueError, match=None) as e:
        read_megatron_command([*BASE, *extra])
    assert says in str(e.value), str(e.value)


def test_tensor_parallel_size_is_read_and_pads_the_vocabulary_by_it():
    """Megatron-LM pads the vocabulary to a multiple of make-vocab-size-divisible-by x t."""
    c = read_megatron_command([*BASE, "--tensor-model-parallel-size", "8", "--vocab-size", "32000"])
    assert c.factory_kwargs["tensor_parallel"] == 8 and c.factory_kwargs["vocab"] == 32768
    assert read_megatron_command([*BASE, "--vocab-size", "32000"]).factory_kwargs["vocab"] == 32000


def test_a_missing_required_option_is_named():
    with pytest.raises(ValueError, match="needs --num-layers"):
        read_megatron_command(BASE[2:])
