"""Megatron-LM's own memory estimate of a launch command, to print beside this project's
figures: ``report_theoretical_memory`` of Megatron-LM (``megatron/training/
theoretical_memory_usage.py``, core_r0.16), itself after Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (Table 2), for the
commands ``remat-pass megatron`` reads (tensor-parallel size t, pipeline and context
parallel size 1, no sequence parallelism, dense layers, LayerNorm, no distributed
optimizer), per GPU.

With those sizes Megatron's estimate is, in bytes, for ``s`` = ``--seq-length``, ``b`` =
``--micro-batch-size``, ``h`` = ``--hidden-size``, ``f`` = ``--ffn-hidden-size``
(default ``4h``), ``V`` the padded vocabulary, ``L`` = ``--num-layers``:

- weights and optimizer: 18 bytes per parameter (fp16 weight and gradient, fp32 master
  weight and two Adam moments), the parameters counted as ``L * (4h^2 + 2h(f + 2)) + 2h
  + hV`` (attention and MLP weight matrices, two LayerNorms per layer and the final one,
  the word embedding, twice with ``--untie-embeddings-and-output-weights``), divided by
  t (Megatron's "most loaded model shard");
- activations (its ``compute_activation_memory_without_sp``): ``((10 + 24 / t) sbh L +
  8 sb + sbh + 2 (sbV / t + sbh)) * 1.05``: 34 bytes per layer and token-hidden at t = 1
  (16-bit values, 1-byte dropout masks), of which 24 are sharded by tensor parallelism
  and 10 (the LayerNorms' inputs, the dropout masks after attention and MLP, the
  attention and MLP inputs) are not (Korthikanti et al. Table 2, "tensor parallel"
  row, without the attention-score term), the embedding's input and dropout mask, the
  logits (vocab-parallel: V / t per GPU) and the final LayerNorm's output in 16 bits,
  and a flat 5 % for temporaries.

The estimate has no term for ``--recompute-method`` / ``--recompute-num-layers``: Megatron
prints the same activation figure at every full-recompute setting.
"""

from __future__ import annotations

import dataclasses

from .megatron_args import MegatronCommand

BYTES_PER_PARAMETER = 18
"""Megatron-LM's bytes per parameter without ``--use-distributed-optimizer``."""
TEMPORARIES = 1.05
"""Megatron-LM's factor for "optimizer and miscellaneous temporaries" on activations."""


@dataclasses.dataclass(frozen=True)
class MegatronEstimate:
    """What Megatron-LM's ``report_theoretical_memory`` gives for a command (bytes).

    Attributes:
        parameters: the parameters it counts on one GPU (its shard at tensor-parallel size t).
        weight_and_optimizer_bytes: ``BYTES_PER_PARAMETER`` per parameter.
        activation_bytes: its activation estimate (the same at every recompute setting).
        total_bytes: their sum.
        leaves_out: one sentence per difference from this project's figures: what the
            formula does not count or counts otherwise.
    """

    parameters: int
    weight_and_optimizer_bytes: int
    activation_bytes: int
    total_bytes: int
    leaves_out: tuple[str, ...]

    def to_dict(self) -> dict:
        """The estimate as JSON (``megatron_formula`` of ``remat-pass megatron --json``)."""
        return {"source": "Megatron-LM report_theoretical_memory (Korthikanti et al. 2022)",
                **{k: v for k, v in dataclasses.asdict(self).items() if k != "leaves_out"},
                "leaves_out": list(self.leaves_out)}


def megatron_estimate(command: MegatronCommand) -> MegatronEstimate:
    """Megatron-LM's ``report_theoretical_memory`` for ``command`` (a command
    ``read_megatron_command`` accepted: pipeline and context parallel size 1), per GPU
at its tensor-parallel size, rounded down to bytes
    as Megatron's MB figure times 2**20 would be.

    >>> from remat_pass.models.megatron_args import read_megatron_command
    >>> e = megatron_estimate(read_megatron_command("--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    ...     "--seq-length 32 --vocab-size 128 --micro-batch-size 2".split()))
    >>> e.parameters, e.activation_bytes
    (107136, 323097)
    """
    k = command.factory_kwargs
    s, b, h, L, V = command.seq, command.batch, k["hidden"], k["layers"], k["vocab"]
    f = k.get("ffn_hidden") or 4 * h
    t = k.get("tensor_parallel", 1)
    per_layer = 4 * h * h + 2 * h * (f + 2)  # QKV + projection (2h^2 (1 + 1)), MLP, two LayerNorms
    parameters = (L * per_layer + 2 * h + h * V * (1 if k.get("tied_embeddings", True) else 2)) // t
    tokens = s * b
    activations = ((10 + 24 / t) * tokens * h * L + 8 * tokens + tokens * h
                   + 2 * (tokens * V / t + tokens * h)) * TEMPORARIES
    weights = BYTES_PER_PARAMETER * parameters
    leaves_out = (
        "it has no term for the recompute setting: every row gets the same activation estimate, where "
        "recompute changes what is saved",
        f"it counts 16-bit activations and 18 B per parameter (mixed-precision Adam); this sweep runs "
        f"fp32 with the static memory it prints",
        f"it leaves out the attention scores (softmax output, its dropout mask, the dropout's output: "
        f"about 5 * heads / t * s^2 * b = {5 * k['heads'] // t * s * s * b:,} B per layer in 16 bits), which the "
        "local layer spec's unfused attention saves",
        "it leaves out biases and the position embedding among the parameters, and counts the logits at "
        "2 B per value where Megatron's cross entropy keeps an fp32 softmax of them (4 B per value)",
    )
    act = int(activations)
    return MegatronEstimate(parameters, weights, act, weights + act, leaves_out)
