"""Pipeline stages of a model: which module runs on which stage, for any model.

Three sources, in this order:

- the model's own ``pipeline_layout`` (``models.PipelineLayout``, torchtitan's
  convention): every stage is a copy of the model that keeps its share of the layer
  stack, the outer modules of the first / last stage set to None on the others (the
  model's forward skips them);
- a Hugging Face model's ``base_model_pp_plan`` (``hf_plans.RankStep.split_stage``:
  the modules before and after its stack on the first and last stage, each stage
  making its own rotary table and mask), checked: the stages run one after another
  give the model's loss on the microbatch;
- any other model with a layer stack (``graph.regions.find_layer_stack``): the model is
  split where Megatron-LM splits it, by ``torch.distributed.pipelining.pipeline``
  (``torch.export`` of the step's forward, cut at ``SplitPoint.BEGINNING`` of the
  first layer of every stage but the first). What comes before the stack (embeddings)
  runs on the first stage with its layers, what comes after it (final norm, head,
  loss) on the last (Megatron's ``pre_process`` / ``post_process``). The stage modules
  keep the full model's parameter names (``blocks.2.ln.weight``) and its layers as
  submodules, so each is traced and its layers found as the whole model's are.

Either way the split is Megatron-LM's even one (``pipeline_schedule.stage_layers``),
a stage takes the token ids (first stage) or the one activation the stage before it
sends, plus the targets on the last stage, and returns that activation or the loss.
A split whose stages pass more than one value (an attention mask or rotary table made
before the stack and read by every layer) is refused with the values named.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch
import torch.nn as nn

from ..errors import InvalidOption, LayerStackNotFound
from ..graph.layer_alike import alike_key, module_evidence, numbering
from ..graph.regions import find_layer_stack
from .pipeline_schedule import stage_layers


@dataclasses.dataclass(frozen=True)
class StageModule:
    """One pipeline stage's module, before tensor parallelism.

    Attributes:
        stage: global stage index.
        module: ``forward(ids or activation, [targets])`` -> activation or loss.
        param_names: the stage's parameter names -> the full model's.
        stack: module path of the stage's layer stack in ``module``.
        boundary_shape: shape of the activation the stage receives (``()`` on the first
            stage), unsharded: sequence parallelism divides its sequence dimension.
        boundary_dtype: its dtype (None on the first stage).
    """

    stage: int
    module: nn.Module
    param_names: dict[str, str]
    stack: str
    boundary_shape: tuple[int, ...]
    boundary_dtype: torch.dtype | None


def stack_of(model: nn.Module) -> tuple[str, int]:
    """``(module path, number of layers)`` of the layer stack that pipeline stages
    split: the model's ``pipeline_layout.stack``, else the stack ``find_layer_stack``
    finds.

    Raises:
        InvalidOption: the model has neither (the message says what is looked for).
    """
    layout = getattr(model, "pipeline_layout", None)
    if layout is not None:
        return layout.stack, len(model.get_submodule(layout.stack))
    if hasattr(model, "pipeline_modules"):
        path = model.pipeline_modules()[0]
        return path, len(model.get_submodule(path))
    try:
        path, children = find_layer_stack(model)
    except LayerStackNotFound as e:
        raise InvalidOption(f"--pp splits the model's layer stack into stages, but {e}") from e
    return path, len(children)


def split_stages(model: nn.Module, microbatch: Sequence[torch.Tensor], stages: Sequence[int],
                 num_stages: int) -> list[StageModule]:
    """The StageModules of ``stages`` (module docstring); the model is copied, not changed.

    Args:
        model: the full model, whose ``forward(ids, targets)`` returns the loss.
        microbatch: one microbatch ``(ids, targets)`` (traced by ``torch.export`` in
            the split of a model without ``pipeline_layout``).
        stages: the global stage indices wanted; num_stages: p x v.

    Raises:
        InvalidOption: the layers do not split evenly into ``num_stages``
            (``stage_layers``), the model has no layer stack, ``torch.export`` cannot
            trace its forward, or its stages pass other than one activation (named).
    """
    path, num_layers = stack_of(model)
    ranges = stage_layers(num_layers, num_stages)
    layout = getattr(model, "pipeline_layout", None)
    if layout is not None:
        return [_layout_stage(model, s, ranges[s], num_stages, layout, tuple(microbatch[0].shape)) for s in stages]
    if hasattr(model, "split_stage"):
        return _checked_stages(model, tuple(microbatch), stages, ranges, path)
    return _pipelining_stages(model, tuple(microbatch), stages, ranges, path)


def _layout_stage(model: nn.Module, stage: int, layers: range, num_stages: int, layout: Any,
                  ids_shape: tuple[int, ...]) -> StageModule:
    """A copy of ``model`` that keeps only stage ``stage``'s layers (and the first /
    last stage's outer modules), with its parameter names -> the full model's."""
    piece = copy.deepcopy(model)
    parent_path, _, attr = layout.stack.rpartition(".")
    parent = piece.get_submodule(parent_path) if parent_path else piece
    setattr(parent, attr, nn.ModuleList(getattr(parent, attr)[i] for i in layers))
    if stage > 0:
        for name in layout.first:
            setattr(piece, name, None)
    if stage < num_stages - 1:
        for name in layout.last:
            setattr(piece, name, None)
    prefix = layout.stack + "."
    names = {}
    for name, _ in piece.named_parameters():
        if name.startswith(prefix):
            index, rest = name[len(prefix):].split(".", 1)
            names[name] = f"{prefix}{int(index) + layers.start}.{rest}"
        else:
            names[name] = name
    dtype = next(model.parameters()).dtype
    return StageModule(stage, piece, names, layout.stack, () if stage == 0 else (*ids_shape[:2], layout.hidden),
                       None if stage == 0 else dtype)


def _checked_stages(model: nn.Module, microbatch: tuple[torch.Tensor, ...], stages: Sequence[int],
                    ranges: Sequence[range], path: str) -> list[StageModule]:
    """Every stage of ``model.split_stage``, run one after another on the microbatch
    against the whole model: each layer's output and the loss must agree (a forward
    that treats its stage's input otherwise than the model does, as Granite's
    ``embedding_multiplier`` applied to ``inputs_embeds``, is refused; a model on
    the meta device is not run: its class's split is the one checked with weights);
    the StageModules of ``stages``."""
    meta = next(model.parameters()).device.type == "meta"
    # without weights only the stages wanted are split: the class's split is the one checked with weights
    wanted = stages if meta else range(len(ranges))
    pieces = {s: model.split_stage(s, ranges[s], len(ranges)) for s in wanted}
    if not meta:
        _check_chained(model, [pieces[s] for s in wanted], microbatch, ranges, path)
    hidden = getattr(getattr(model, "lm", model), "config").hidden_size
    dtype = next(model.parameters()).dtype
    shape = (*microbatch[0].shape[:2], hidden)
    return [StageModule(s, pieces[s][0], pieces[s][1], path, () if s == 0 else shape, None if s == 0 else dtype)
            for s in stages]


def _check_chained(model: nn.Module, pieces: Sequence[tuple[nn.Module, Any]], microbatch: tuple[torch.Tensor, ...],
                   ranges: Sequence[range], path: str) -> None:
    """Refuse a split whose stages run one after another give another layer output or
    loss than the whole model (``_checked_stages``)."""
    want_layers: dict[int, torch.Tensor] = {}
    got_layers: dict[int, torch.Tensor] = {}
    stack = model.get_submodule(path)
    handles = _keep_outputs(stack, range(len(stack)), want_layers)
    for (piece, _), r in zip(pieces, ranges):
        handles += _keep_outputs(piece.get_submodule(path), r, got_layers)
    try:
        with torch.no_grad():
            want = model(*microbatch)
            x = microbatch[0]
            for s, (piece, _) in enumerate(pieces):
                x = piece(x, *microbatch[1:]) if s == len(ranges) - 1 else piece(x)
    finally:
        for h in handles:
            h.remove()
    differ = [i for i, t in want_layers.items() if not torch.allclose(got_layers[i], t, rtol=1e-5, atol=1e-6)]
    if differ or not torch.allclose(x, want, rtol=1e-5, atol=0):
        raise InvalidOption(f"{type(getattr(model, 'lm', model)).__name__}'s pipeline stages run one after another "
                            f"give layers "
                            f"{differ} other outputs than the whole model (loss {float(x):.6g} against "
                            f"{float(want):.6g}): its forward treats a stage's input otherwise than the model "
                            "does (e.g. scales inputs_embeds); not split")


def _keep_outputs(stack: nn.Module, indices: Sequence[int], out: dict[int, torch.Tensor]) -> list[Any]:
    """Forward hooks that put the output of the stack's j-th layer (the first tensor of
    a tuple) at ``out[indices[j]]``; returns their handles."""
    def keep(i: int) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            out[i] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    return [layer.register_forward_hook(keep(i)) for i, layer in zip(indices, stack)]


def _pipelining_stages(model: nn.Module, microbatch: tuple[torch.Tensor, ...], stages: Sequence[int],
                       ranges: Sequence[range], path: str) -> list[StageModule]:
    """Split ``model`` with ``torch.distributed.pipelining.pipeline`` at the first
    layer of every stage but the first (module docstring)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    if next(model.parameters()).device.type == "meta":
        raise InvalidOption(f"{type(model).__name__} has no pipeline_layout nor a transformers pipeline plan, so its "
                            "stages are split by torch.export of its forward, which needs weights: leave out --meta "
                            "(or give the model a pipeline_layout, remat_pass.models.PipelineLayout)")
    _, children = find_layer_stack(model, path)
    split_spec = {f"{path}.{children[r.start]}": SplitPoint.BEGINNING for r in ranges[1:]}
    try:
        pipe = pipeline(copy.deepcopy(model), mb_args=microbatch, split_spec=split_spec)
    except Exception as e:  # noqa: BLE001 - torch.export's many failures, reported with their cause
        raise InvalidOption(f"{type(model).__name__} has no pipeline_layout, and splitting it into stages with "
                            f"torch.distributed.pipelining.pipeline (torch.export of its forward) failed: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if pipe.num_stages != len(ranges):
        raise InvalidOption(f"splitting {type(model).__name__} at the first layers of {len(ranges)} stages gave "
                            f"{pipe.num_stages} stages: its forward does not call the layers of {path} in order")
    inputs = [n.target for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    return [_pipelining_stage(pipe.get_stage_module(s), s, len(ranges), inputs, path) for s in stages]


def _pipelining_stage(gm: Any, stage: int, num_stages: int, model_inputs: list[str], path: str) -> StageModule:
    """One stage of a ``pipeline`` split, its placeholders put in ``stage_inputs``'
    order: the activation received (or the ids), then the targets on the last stage."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    received = [n for n in placeholders if n.target not in model_inputs]
    own = [n for n in placeholders if n.target in model_inputs]
    expected = (0 if stage == 0 else 1, [model_inputs[0]] if stage == 0 else [])
    if stage == num_stages - 1 and len(model_inputs) > 1:
        expected = (expected[0], expected[1] + [model_inputs[1]])
    if len(received) != expected[0] or [n.target for n in own] != expected[1]:
        got = [n.target for n in placeholders]
        raise InvalidOption(f"stage {stage} of the split at {path} takes {got}: a stage may take the token ids "
                            f"(stage 0) or the one activation the stage before sends, and the targets on the last "
                            f"stage; this model passes more between its layers (give it a pipeline_layout, "
                            f"remat_pass.models.PipelineLayout)")
    first_other = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    for node in received + own:  # received first, then the model's inputs in its order
        first_other.prepend(node)
    gm.graph.lint()
    gm.recompile()
    shape, dtype = (), None
    if received:
        val = received[0].meta.get("val")
        shape, dtype = tuple(val.shape), val.dtype
    return StageModule(stage, gm, {n: n for n, _ in gm.named_parameters()}, path, shape, dtype)


def numbered_facts(model: nn.Module) -> set[Any]:
    """The facts of ``module_evidence`` that number the layers of the model's stack
    (``layer_alike.numbering`` over all of them: a ``layer_idx``), left out when stages
    are compared (``middle_stage_key``)."""
    path, _ = stack_of(model)
    return numbering([module_evidence(layer) for layer in model.get_submodule(path)])


def middle_stage_key(piece: StageModule, numbered: set[Any]) -> Any:
    """What decides a middle stage's traced graph (neither first nor last: no
    embedding, no head): the activation it receives (shape, dtype) and, layer by layer,
    ``module_evidence`` of its stack without the ``numbered`` facts (``layer_alike``'s
    rule). Two middle stages with equal keys trace to the same graph up to parameter
    names, so one trace serves both (``ranks.trace_rank``'s ``alike_stages``)."""
    layers = piece.module.get_submodule(piece.stack)
    evidence = tuple(alike_key({k: v for k, v in module_evidence(layer).items() if k not in numbered})
                     for layer in layers)
    return piece.boundary_shape, piece.boundary_dtype, evidence
