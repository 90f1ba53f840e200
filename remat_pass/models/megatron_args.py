"""A Megatron-LM launch command read as Megatron reads it: the arguments a user passes to
``pretrain_gpt.py``, with Megatron's names and defaults
(``megatron/training/arguments.py`` of Megatron-LM core_r0.16), turned into the
Megatron-Core model ``models.megatron.megatron_gpt`` builds and the recompute setting the
command asks for.

Megatron's own parser cannot run here: it needs ``torch.distributed`` initialised, a
tokenizer and its training package. So this parser declares the same option names and
defaults, in three sets:

- ``SUPPORTED`` and ``SUPPORTED_FLAGS``: read and applied (model shape, batch, dropouts,
  seed, recompute; the word embedding tied to the output layer, as ``pretrain_gpt.py``
  builds it, unless ``--untie-embeddings-and-output-weights``);
- ``NOT_YET``: memory-relevant options this version does not model yet (pipeline,
  context and sequence parallelism above 1, grouped-query attention, SwiGLU,
  RMSNorm, rotary positions, bf16 / fp16): an error naming the
  option, never a silently different model;
- ``NO_MEMORY_EFFECT``: training options that change nothing in one step's memory
  (learning rate, iterations, data paths, logging, checkpoints): accepted, listed as
  ignored.

Any other option is an error naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

# name -> (type, Megatron's default); a type of bool: a flag
SUPPORTED: dict[str, tuple[Any, Any]] = {
    "--num-layers": (int, None), "--hidden-size": (int, None), "--ffn-hidden-size": (int, None),
    "--num-attention-heads": (int, None), "--seq-length": (int, None),
    "--max-position-embeddings": (int, None), "--vocab-size": (int, None),
    "--make-vocab-size-divisible-by": (int, 128), "--micro-batch-size": (int, None),
    "--global-batch-size": (int, None), "--attention-dropout": (float, 0.1), "--hidden-dropout": (float, 0.1),
    "--seed": (int, 1234), "--recompute-granularity": (str, None), "--recompute-method": (str, None),
    "--recompute-num-layers": (int, None), "--tensor-model-parallel-size": (int, 1),
    "--pipeline-model-parallel-size": (int, 1), "--context-parallel-size": (int, 1),
    "--normalization": (str, "LayerNorm"), "--position-embedding-type": (str, "learned_absolute"),
}
SUPPORTED_FLAGS = ("--untie-embeddings-and-output-weights",)
NOT_YET = ("--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", "--group-query-attention",
           "--num-query-groups", "--kv-channels", "--swiglu", "--bf16",
           "--fp16", "--recompute-modules", "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32")
NO_MEMORY_EFFECT = ("--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-fraction", "--lr-warmup-iters",
                    "--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--train-iters",
                    "--train-samples", "--eval-iters", "--eval-interval", "--log-interval", "--save-interval",
                    "--save", "--load", "--data-path", "--split", "--tokenizer-type", "--vocab-file", "--merge-file",
                    "--tensorboard-dir", "--init-method-std", "--distributed-backend", "--no-masked-softmax-fusion",
                    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--use-mcore-models", "--exit-interval")
FLAGS_WITHOUT_VALUE = {"--sequence-parallel", "--group-query-attention", "--swiglu",
                       "--untie-embeddings-and-output-weights", "--bf16", "--fp16", "--use-distributed-optimizer",
                       "--accumulate-allreduce-grads-in-fp32", "--no-masked-softmax-fusion",
                       "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--use-mcore-models"}
REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size",
            "--micro-batch-size")


@dataclasses.dataclass(frozen=True)
class MegatronCommand:
    """What a Megatron-LM command asks for, in ``megatron_gpt``'s terms.

    Attributes:
        factory_kwargs: ``megatron_gpt``'s keyword arguments (layers, hidden, heads,
            ffn_hidden, vocab: the padded vocabulary, max_positions, dropout, seed,
            tied_embeddings: ``pretrain_gpt.py``'s ``share_embeddings_and_output_weights``,
            tensor_parallel: ``--tensor-model-parallel-size``, present when above 1).
        batch, seq: ``--micro-batch-size``, ``--seq-length``.
        microbatches: ``--global-batch-size / --micro-batch-size`` (data-parallel size 1):
            run one after another, each microbatch's step peaks alike.
        recompute: ``(method, recompute_num_layers)`` the command sets (``("none",
            None)`` without ``--recompute-granularity full``).
        ignored: the options accepted without effect on memory.
    """

    factory_kwargs: dict[str, Any]
    batch: int
    seq: int
    microbatches: int
    recompute: tuple[str, int | None]
    ignored: tuple[str, ...]


def padded_vocab_size(vocab: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's padded vocabulary (``_vocab_size_with_padding``): ``vocab`` rounded
    up to a multiple of ``divisible_by * tp``.

    >>> padded_vocab_size(50257), padded_vocab_size(32000, 128, 8)
    (50304, 32768)
    """
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def read_megatron_command(argv: Sequence[str]) -> MegatronCommand:
    """The MegatronCommand of ``argv`` (the arguments after ``--``).

    Raises:
        ValueError: an unknown option, an option this version does not model
            (``NOT_YET``, or a parallel size above 1), a required option missing, a
            value of the wrong type, or a recompute setting Megatron-LM itself rejects
            (``--recompute-method`` without ``--recompute-granularity full``, uniform
            without ``--recompute-num-layers``); each message names the option and what
            is allowed.
    """
    argv = list(argv)
    for a in argv:
        name = a.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        if name in NOT_YET:
            raise ValueError(f"Megatron-LM option {name} is not modelled by remat-pass megatron yet (supported: "
                             "the model shape, batch, dropouts, seed and full recompute at tensor, pipeline and "
                             "context parallel size 1, fp32); leave it out or use `remat-pass sweep --tp/--pp`")
        if name not in SUPPORTED and name not in SUPPORTED_FLAGS and name not in NO_MEMORY_EFFECT:
            raise ValueError(f"unknown Megatron-LM option {name}: remat-pass megatron reads "
                             f"{', '.join(sorted(SUPPORTED))} (and ignores training options such as --lr)")
    p = argparse.ArgumentParser(prog="Megatron-LM arguments", add_help=False, allow_abbrev=False,
                                exit_on_error=False)
    for name, (typ, default) in SUPPORTED.items():
        p.add_argument(name, type=typ, default=default)
    for name in SUPPORTED_FLAGS:
        p.add_argument(name, action="store_true")
    for name in NO_MEMORY_EFFECT:
        p.add_argument(name, action="store_true" if name in FLAGS_WITHOUT_VALUE else "store")
    try:
        ns, rest = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"Megatron-LM arguments: {e}") from None
    if rest:
        raise ValueError(f"Megatron-LM arguments: cannot read {' '.join(rest)} (write --option value)")
    return _command(ns, [a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in NO_MEMORY_EFFECT])


def _command(ns: argparse.Namespace, ignored: list[str]) -> MegatronCommand:
    """The MegatronCommand of parsed arguments (see ``read_megatron_command``)."""
    missing = [n for n in REQUIRED if getattr(ns, n[2:].replace("-", "_")) is None]
    if missing:
        raise ValueError(f"the Megatron-LM command needs {', '.join(missing)}")
    for name in ("--pipeline-model-parallel-size", "--context-parallel-size"):
        if getattr(ns, name[2:].replace("-", "_")) != 1:
            raise ValueError(f"{name} {getattr(ns, name[2:].replace('-', '_'))}: remat-pass megatron models "
                             "tensor parallelism only so far (pipeline and context parallel size 1)")
    tp = ns.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp}: must be 1 or more")
    for name, allowed in (("--normalization", "LayerNorm"), ("--position-embedding-type", "learned_absolute")):
        if getattr(ns, name[2:].replace("-", "_")) != allowed:
            raise ValueError(f"{name} {getattr(ns, name[2:].replace('-', '_'))} is not modelled yet (only {allowed})")
    granularity, method, k = ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers
    if granularity not in (None, "full"):
        raise ValueError(f"--recompute-granularity {granularity}: remat-pass megatron models full (or none) so "
                         "far; for selective use `remat-pass sweep --selective`")
    if method is not None and granularity != "full":
        raise ValueError("--recompute-method needs --recompute-granularity full (Megatron-LM's own check)")
    if granularity == "full" and method not in ("uniform", "block"):
        raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
    if granularity == "full" and (k is None or k < (1 if method == "uniform" else 0)):
        raise ValueError(f"--recompute-method {method} needs --recompute-num-layers (1 or more for uniform, "
                         "0 or more for block)")
    gbs = ns.global_batch_size or ns.micro_batch_size
    if gbs % ns.micro_batch_size:
        raise ValueError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
                         f"{ns.micro_batch_size} (data-parallel size 1)")
    kwargs = dict(layers=ns.num_layers, hidden=ns.hidden_size, heads=ns.num_attention_heads,
                  ffn_hidden=ns.ffn_hidden_size, vocab=padded_vocab_size(ns.vocab_size, ns.make_vocab_size_divisible_by, tp),
                  max_positions=ns.max_position_embeddings or ns.seq_length, seed=ns.seed,
                  tied_embeddings=not ns.untie_embeddings_and_output_weights)
    if tp > 1:
        kwargs["tensor_parallel"] = tp
    if ns.attention_dropout != ns.hidden_dropout:
        raise ValueError(f"--attention-dropout {ns.attention_dropout} and --hidden-dropout {ns.hidden_dropout}: "
                         "different dropouts are not modelled yet (give them equal)")
    kwargs["dropout"] = ns.attention_dropout
    recompute = (method, k) if granularity == "full" else ("none", None)
    return MegatronCommand(kwargs, ns.micro_batch_size, ns.seq_length, gbs // ns.micro_batch_size, recompute,
                           tuple(ignored))
