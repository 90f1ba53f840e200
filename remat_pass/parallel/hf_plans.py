"""Models from Hugging Face ``transformers`` on the per-rank paths: their own
tensor-parallel plan applied with ``torch.distributed.tensor.parallel``.

A ``transformers`` model declares how it shards (``PreTrainedModel._tp_plan``: the
class's ``base_model_tp_plan`` under its base model's prefix, plus the head's entry,
``{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head":
"colwise_gather_output"}``). ``RankStep`` wraps such a model so the per-rank code sees
what it sees in every model: ``forward(input_ids, labels) -> loss`` on a tuple of
batch-first tensors, a ``tensor_parallel_plan`` and the sizes tensor parallelism must
divide (``shape``). The plan's styles map to PyTorch's (the same semantics as
transformers' own integration and torchtitan's Llama):

- ``colwise``: ``ColwiseParallel()`` (output features sharded, local output);
- ``rowwise``: ``RowwiseParallel()`` (input features sharded, output all-reduced);
- ``colwise_gather_output``: ``ColwiseParallel(output_layouts=Replicate())`` (the
  head's logits all-gathered);
- ``embedding_rowwise``: ``RowwiseParallel(input_layouts=Replicate())`` on an
  ``nn.Embedding`` (vocabulary rows sharded, output all-reduced);
- ``rowwise_split_input``: ``RowwiseParallel(input_layouts=Replicate())``.

Any other style (expert parallelism, grouped GEMMs, packed projections, replicated
parameters whose gradients are all-reduced after the step) is refused with its name, as
is ``--sp``: the classes declare no sequence-parallel layouts for their norms.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from ..errors import InvalidOption

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "rowwise_split_input")


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (by its config attribute
    and ``_tp_plan``; transformers is not imported)."""
    return hasattr(model, "config") and hasattr(model.config, "to_dict") and hasattr(model, "_tp_plan")


class RankStep(nn.Module):
    """``forward(*tensors) -> loss`` of a model taking keyword inputs and returning an
    object with ``.loss`` (a transformers model); its parameters are those of ``lm``.

    Attributes:
        lm: the wrapped model; keys: the keyword of each positional input.
        shape: the sizes tensor parallelism divides (``ranks.validate``): heads,
            kv_heads, ffn (intermediate size), vocab, read from the model's config.
    """

    def __init__(self, lm: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.lm, self.keys = lm, keys
        c = lm.config
        sizes = {"heads": getattr(c, "num_attention_heads", None), "kv_heads": getattr(c, "num_key_value_heads", None),
                 "ffn": getattr(c, "intermediate_size", None), "vocab": getattr(c, "vocab_size", None)}
        self.shape = {k: v for k, v in sizes.items() if isinstance(v, int)}

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.lm(**dict(zip(self.keys, tensors)))
        return out.loss if hasattr(out, "loss") else out

    def tensor_parallel_plan(self, sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's ``_tp_plan`` as ``(plan of the whole module, {})`` for
        ``parallelize_module`` (module docstring).

        Raises:
            InvalidOption: ``sequence_parallel``, an empty plan, or a style not in
                ``STYLES`` (named, with the module it shards).
        """
        if sequence_parallel:
            raise InvalidOption(f"--sp: {type(self.lm).__name__}'s tensor-parallel plan (transformers' _tp_plan) "
                                "declares no sequence-parallel layouts for its norms and residuals; leave out --sp")
        plan = dict(getattr(self.lm, "_tp_plan", None) or {})
        if not plan:
            raise InvalidOption(f"--tp: {type(self.lm).__name__} declares no tensor-parallel plan "
                                "(transformers' base_model_tp_plan is empty for this class)")
        return {f"lm.{path}": _style(path, style) for path, style in plan.items()}, {}


def _style(path: str, style: str) -> Any:
    """PyTorch's ParallelStyle of one transformers plan entry (module docstring)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("embedding_rowwise", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate())
    raise InvalidOption(f"--tp: the tensor-parallel plan shards {path} as {style!r}, which remat-pass does not "
                        f"apply yet (supported: {', '.join(STYLES)})")


def rank_step_model(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """``(model, inputs)`` as the per-rank code takes them: a transformers model with
    keyword inputs becomes a ``RankStep`` over the inputs' values in order; any other
    model is returned as it is.

    Raises:
        InvalidOption: keyword inputs that are not all tensors, or on a model that is
            not a transformers model (the per-rank code passes positional tensors).
    """
    if not isinstance(inputs, Mapping):
        return model, inputs
    if not is_transformers_model(model) or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
        raise InvalidOption(f"the per-rank commands pass the batch as positional tensors (ids, targets); "
                            f"{type(model).__name__}'s inputs are keyword arguments {list(inputs)}, which only a "
                            "transformers model with tensor inputs is adapted from")
    return RankStep(model, tuple(inputs)), tuple(inputs.values())
