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

Pipeline stages come from the class's ``base_model_pp_plan`` (its base model's modules
in order: those before the layer stack, the stack, those after it): a stage is a copy
keeping its share of the stack (Megatron's even split); on the stages after the first
the modules before the stack become ``nn.Identity`` and the stage is called with
``inputs_embeds`` (the activation received), on the stages before the last the modules
after it become ``nn.Identity`` and the base model's ``last_hidden_state`` is returned.
Each stage makes its own rotary table and causal mask from the activation's shape (as
torchtitan's and Megatron's stages do), so one activation crosses each boundary. The
stages run one after another must give the model's loss (checked on the microbatch
when the split is made), and tied input / output embeddings are refused.
"""

from __future__ import annotations

import copy
import contextlib
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from ..errors import InvalidOption

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "rowwise_split_input")


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (by its config attribute
    and ``_tp_plan``; transformers is not imported)."""
    return hasattr(model, "config") and hasattr(model.config, "to_dict") and hasattr(model, "_tp_plan")


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """While active, transformers' ``masking_utils.find_packed_sequence_indices``
    returns None (no packed sequences), as it does on the position ids a model makes
    itself (``arange``, the same in every row); for a step that passes no position ids."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    saved = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = saved


class RankStep(nn.Module):
    """``forward(*tensors) -> loss`` of a model taking keyword inputs and returning an
    object with ``.loss`` (a transformers model); its parameters are those of ``lm``.

    Attributes:
        lm: the wrapped model; keys: the keyword of each positional input.
        options: keywords every call passes: ``use_cache=False`` where the config has
            ``use_cache`` (a training step keeps no KV cache: with one, the eager step
            holds each layer's keys and values to the end of the forward, which the
            traced step, where they are dead, does not). Without a cache transformers
            looks for packed sequences in the position ids, a branch on their values
            (``masking_utils.find_packed_sequence_indices``); the positions here are
            the model's own ``arange``, one sequence per row, for which it returns
            None, so it is called as returning None (``one_sequence_per_row``) and a
            step with fake tensors traces as the real one does.
        shape: the sizes tensor parallelism divides (``ranks.validate``): heads,
            kv_heads, ffn (intermediate size), vocab, read from the model's config.
    """

    def __init__(self, lm: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.lm, self.keys = lm, keys
        self.first = self.last = True  # a pipeline stage's position (split_stage)
        c = lm.config
        self.options = {"use_cache": False} if getattr(c, "use_cache", None) is not None else {}
        sizes = {"heads": getattr(c, "num_attention_heads", None), "kv_heads": getattr(c, "num_key_value_heads", None),
                 "ffn": getattr(c, "intermediate_size", None), "vocab": getattr(c, "vocab_size", None)}
        self.shape = {k: v for k, v in sizes.items() if isinstance(v, int)}

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        if self.options:
            with one_sequence_per_row():
                return self._forward(*tensors)
        return self._forward(*tensors)

    def _forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        if self.first and self.last:
            out = self.lm(**dict(zip(self.keys, tensors)), **self.options)
            return out.loss if hasattr(out, "loss") else out
        head = {"input_ids" if self.first else "inputs_embeds": tensors[0], **self.options}
        if self.last:
            return self.lm(**head, **dict(zip(self.keys[1:], tensors[1:]))).loss
        return self.lm.get_submodule(self.lm.base_model_prefix)(**head).last_hidden_state

    def pipeline_modules(self) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """``(stack, before, after)``: module paths (in this module) of the layer stack
        and of the base model's modules before / after it, from ``base_model_pp_plan``
        (after: also the head, every module outside the base model).

        Raises:
            InvalidOption: the class has no ``base_model_pp_plan``, no stack in it,
                inputs other than ``(input_ids, labels)``, or tied embeddings.
        """
        name = type(self.lm).__name__
        plan = list(getattr(self.lm.config, "base_model_pp_plan", None) or {})
        base_path = f"lm.{self.lm.base_model_prefix}"
        base = self.get_submodule(base_path)
        stacks = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
        if len(stacks) != 1:
            raise InvalidOption(f"--pp: {name} declares no pipeline plan with one layer stack (transformers' "
                                f"base_model_pp_plan: {plan or 'none'})")
        if self.keys != ("input_ids", "labels"):
            raise InvalidOption(f"--pp: {name}'s stages take (input_ids, labels); the factory gives {list(self.keys)}")
        if getattr(self.lm.config, "tie_word_embeddings", False):
            raise InvalidOption(f"--pp: {name} ties its input and output embeddings (tie_word_embeddings), which "
                                "sit on the first and last stage; untie them (tie_word_embeddings=False)")
        i = plan.index(stacks[0])
        heads = tuple(f"lm.{n}" for n, _ in self.lm.named_children() if n != self.lm.base_model_prefix)
        return (f"{base_path}.{stacks[0]}", tuple(f"{base_path}.{n}" for n in plan[:i]),
                tuple(f"{base_path}.{n}" for n in plan[i + 1:]) + heads)

    def split_stage(self, stage: int, layers: range, num_stages: int) -> tuple["RankStep", dict[str, str]]:
        """A copy of this module that runs stage ``stage`` (module docstring), and its
        parameter names -> this module's."""
        stack, before, after = self.pipeline_modules()
        piece = copy.deepcopy(self)
        piece.first, piece.last = stage == 0, stage == num_stages - 1
        parent_path, _, attr = stack.rpartition(".")
        parent = piece.get_submodule(parent_path)
        setattr(parent, attr, nn.ModuleList(getattr(parent, attr)[i] for i in layers))
        for path in (before if stage > 0 else ()) + (after if stage < num_stages - 1 else ()):
            owner, _, leaf = path.rpartition(".")
            setattr(piece.get_submodule(owner), leaf, nn.Identity())
        prefix = stack + "."
        names = {}
        for name, _ in piece.named_parameters():
            if name.startswith(prefix):
                index, rest = name[len(prefix):].split(".", 1)
                names[name] = f"{prefix}{int(index) + layers.start}.{rest}"
            else:
                names[name] = name
        return piece, names

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
        return {f"lm.{path}": _style(path, style) for path, style in plan.items()
                if "*" in path or _present(self.lm, path)}, {}


def _present(module: nn.Module, path: str) -> bool:
    """Whether ``path`` names a module of ``module`` with parameters (a pipeline stage
    replaces the other stages' outer modules with parameterless ``nn.Identity``)."""
    try:
        return any(True for _ in module.get_submodule(path).parameters())
    except AttributeError:
        return False


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
