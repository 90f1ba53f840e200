"""Megatron-LM's theoretical activation memory (Korthikanti et al. 2022), for comparison
with the graph's liveness.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), Table 2, counts the bytes one transformer layer saves for
backward with 16-bit activations and 1-byte dropout masks, sequence length ``s``,
micro-batch ``b``, hidden ``h``, ``a`` attention heads (tensor parallel size 1):

- no recompute: ``s·b·h·(34 + 5·a·s/h)`` (the ``5·a·s/h`` term is the s x s attention
  scores, softmax output and its dropout mask);
- selective recompute (the attention core recomputed; what a flash-attention kernel
  saves too): ``34·s·b·h``; Megatron-LM's ``compute_activation_memory``
  (``megatron/training/theoretical_memory_usage.py``, the formula behind
  ``--report-theoretical-memory`` / ``report_theoretical_memory``) writes it for any
  FFN size as ``s·b·h·(18 + 4·ffn/h)``;
- full recompute (``--recompute-granularity full``): each checkpointed layer saves
  only its input, ``2·s·b·h``, and one layer's activations are rebuilt at a time.

Megatron adds, for the first pipeline stage with PP = 1: the embedding's input
(``8·s·b``, int64 token ids), its dropout mask (``s·b·h``) and the inputs of the output
layer and the cross entropy (``4·s·b·h·(1 + V/h)``).

The extension to Megatron's ``uniform`` / ``block`` methods (not in the paper's table):
uniform(K) saves ``ceil(L/K)`` checkpoints and rebuilds one group of K layers;
block(N) saves N checkpoints and ``L − N`` whole layers, and rebuilds one layer.
These are the paper's terms, not a liveness analysis: no gradients, no backward working
set, no optimizer, no allocator; the formula assumes GPT's MLP (two matrices, GELU,
dropout) and LayerNorm.

Example:
    >>> shape = TransformerShape(seq=4096, micro_batch=1, hidden=4096, ffn_hidden=16384,
    ...                          num_heads=32, num_layers=32, vocab=32000)
    >>> layer_activation_bytes(shape, "selective") == 34 * 4096 * 4096
    True
    >>> layer_activation_bytes(shape, "full") == 2 * 4096 * 4096
    True
"""

from __future__ import annotations

import dataclasses
import math

from .errors import InvalidSchedule

GRANULARITIES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """The shapes Korthikanti et al.'s formula reads (Megatron-LM's argument names).

    Attributes:
        seq: ``--seq-length`` s, tokens per sample.
        micro_batch: ``--micro-batch-size`` b.
        hidden: ``--hidden-size`` h.
        ffn_hidden: ``--ffn-hidden-size`` (4·h for GPT).
        num_heads: ``--num-attention-heads`` a.
        num_layers: ``--num-layers`` L.
        vocab: ``--padded-vocab-size`` V.
    """

    seq: int
    micro_batch: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_layers: int
    vocab: int

    @property
    def sbh(self) -> int:
        """s·b·h, the elements of one hidden-state tensor."""
        return self.seq * self.micro_batch * self.hidden


def layer_activation_bytes(shape: TransformerShape, granularity: str) -> int:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, Table 2,
    tensor parallel size 1), rounded down to a whole byte.

    Args:
        shape: the model and batch shapes.
        granularity: ``"none"`` (everything saved, s x s attention included),
            ``"selective"`` (Megatron's ``18 + 4·ffn/h`` form) or ``"full"`` (only the
            layer's input).

    Raises:
        InvalidSchedule: an unknown granularity.
    """
    sbh = shape.sbh
    if granularity == "none":
        return layer_activation_bytes(shape, "selective") + 5 * shape.num_heads * shape.seq * shape.seq * shape.micro_batch
    if granularity == "selective":
        return 18 * sbh + 4 * sbh * shape.ffn_hidden // shape.hidden
    if granularity == "full":
        return 2 * sbh
    raise InvalidSchedule(f"granularity {granularity!r}: expected one of {', '.join(GRANULARITIES)}")


def outer_activation_bytes(shape: TransformerShape) -> int:
    """Megatron's activations outside the layers for PP = 1: token ids (8·s·b), the
    embedding's dropout mask (s·b·h) and the inputs of the output layer and the loss
    (4·s·b·h·(1 + V/h)), in bytes."""
    sb = shape.seq * shape.micro_batch
    return 8 * sb + shape.sbh + 4 * sb * (shape.hidden + shape.vocab)


def megatron_activation_bytes(shape: TransformerShape, method: str = "none",
                              recompute_num_layers: int | None = None,
                              attention: str = "selective") -> int:
    """Theoretical activation bytes of a training step in Korthikanti et al.'s terms.

    Args:
        shape: the model and batch shapes.
        method: ``"none"`` (no full recompute: every layer saves what ``attention``
            says; with the default that is Megatron's ``report_theoretical_memory``
            figure), ``"uniform"`` or ``"block"`` (``--recompute-method`` under
            ``--recompute-granularity full``).
        recompute_num_layers: K for uniform (1..L), N for block (0..L).
        attention: what a layer that is not recomputed saves: ``"selective"``
            (flash / memory-efficient attention: no s x s tensors) or ``"none"``
            (the s x s scores and probabilities saved).

    Returns:
        bytes: the layers' saved activations plus one rebuilt working set under
        recompute, plus :func:`outer_activation_bytes`.

    Raises:
        InvalidSchedule: an unknown method, or K / N outside its range.
    """
    L = shape.num_layers
    if attention not in ("selective", "none"):
        raise InvalidSchedule(f"attention {attention!r}: expected selective or none")
    stored = layer_activation_bytes(shape, attention)
    checkpoint = layer_activation_bytes(shape, "full")
    if method == "none":
        layers = L * stored
    elif method == "uniform":
        if recompute_num_layers is None or not 1 <= recompute_num_layers <= L:
            raise InvalidSchedule(f"uniform needs recompute_num_layers K in 1..{L}, got {recompute_num_layers}")
        k = recompute_num_layers
        layers = math.ceil(L / k) * checkpoint + k * stored
    elif method == "block":
        if recompute_num_layers is None or not 0 <= recompute_num_layers <= L:
            raise InvalidSchedule(f"block needs recompute_num_layers N in 0..{L}, got {recompute_num_layers}")
        n = recompute_num_layers
        layers = n * checkpoint + (L - n) * stored + (stored if n else 0)
    else:
        raise InvalidSchedule(f"method {method!r}: expected none, uniform or block")
    return layers + outer_activation_bytes(shape)
