"""The user's eager program under a recompute setting: predicted (``graph/eager_trace``
recorded on fake tensors, ``liveness/eager_program``) and measured (the real step under
the allocator profiler), without the rewrite.

A setting is applied as users apply it without this project: for a ``transformers``
model, its own ``gradient_checkpointing_enable`` (each layer a
``GradientCheckpointingLayer``, switched on for the recomputed layers only); otherwise
``torch.utils.checkpoint`` around each recomputed layer of the stack. Non-reentrant by
default, as PyTorch recommends; ``use_reentrant=True`` as older code and Megatron-LM's
``CheckpointFunction`` run. Megatron-LM's ``uniform`` K = 1 and ``block`` N recompute single layers, so they
are supported; groups of several layers are refused: they need the model's own loop
(Megatron-Core's ``_checkpointed_forward``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..errors import RematError
from ..graph.eager_trace import record_eager_step
from ..graph.flat_step import LossFn, extract_loss, split_inputs
from ..graph.regions import find_layer_stacks
from ..liveness.eager_program import EagerPeak, eager_peak
from ..measure.run import profiled_peak_cpu
from ..memory.calibration import Calibrator
from ..recompute.schedule import Schedule


class CheckpointedLayer(nn.Module):
    """One layer run under ``torch.utils.checkpoint.checkpoint`` (its arguments passed
    through; ``use_reentrant`` as the PyTorch API)."""

    def __init__(self, layer: nn.Module, use_reentrant: bool = False):
        super().__init__()
        self.layer = layer
        self.use_reentrant = use_reentrant

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.layer, *args, use_reentrant=self.use_reentrant, **kwargs)


def with_checkpoints(model: nn.Module, schedule: Schedule, layers: str | None = None,
                     use_reentrant: bool = False) -> nn.Module:
    """A copy of ``model`` whose recomputed layers (``schedule.groups``) each run under
    ``torch.utils.checkpoint``.

    Raises:
        RematError: a group of more than one layer, or a schedule for another number
            of layers than the stack has.
    """
    path, children = find_layer_stacks(model, layers)[0]
    if schedule.num_layers != len(children):
        raise RematError(f"schedule {schedule.provenance} is for {schedule.num_layers} layers; "
                         f"{path} has {len(children)}")
    wide = [g for g in schedule.groups if len(g) > 1]
    if wide:
        raise RematError(f"schedule {schedule.provenance} recomputes groups of {len(wide[0])} layers: "
                         "torch.utils.checkpoint around a group needs the model's own loop; the eager "
                         "program supports single-layer groups (uniform K=1, block N)")
    copied = copy.deepcopy(model)
    stack = copied.get_submodule(path)
    if getattr(copied, "supports_gradient_checkpointing", False):
        # transformers' own per-layer checkpointing (GradientCheckpointingLayer), which
        # also turns the KV cache off while training, as users enable it
        kwargs = {"use_reentrant": use_reentrant}
        if hasattr(copied, "activation_checkpointing_enable"):  # transformers 5 (the old name is deprecated)
            copied.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        recomputed = {children[g[0]] for g in schedule.groups}
        for name in children:
            layer = stack.get_submodule(name)
            if not hasattr(layer, "gradient_checkpointing"):
                raise RematError(f"{path}.{name} ({type(layer).__name__}) is not a transformers "
                                 "GradientCheckpointingLayer: its checkpointing cannot be set per layer")
            layer.gradient_checkpointing = name in recomputed
        return copied
    for (i,) in schedule.groups:
        name = children[i]
        stack.register_module(name, CheckpointedLayer(stack.get_submodule(name), use_reentrant))
    return copied


@dataclasses.dataclass(frozen=True)
class EagerResult:
    """One setting of the eager program.

    Attributes:
        schedule: the setting (``provenance``).
        predicted: the EagerPeak recorded on fake tensors.
        measured_peak_bytes: the real step's peak above its start (None: not run).
    """

    schedule: str
    predicted: EagerPeak
    measured_peak_bytes: int | None


def eager_program(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
                  schedule: Schedule, *, layers: str | None = None, use_reentrant: bool = False,
                  measure: bool = True, calibrator: Calibrator | None = None) -> EagerResult:
    """The eager step ``loss_fn(model(*inputs)).backward()`` (inputs and loss as
    ``eager_trace.record_eager_step``) under ``schedule``
    (``with_checkpoints``): predicted from fake tensors, and, with ``measure``, measured
    on the real model (two warm-up steps, ``.grad`` None before each; CPU).

    Raises:
        RematError: as ``with_checkpoints`` and ``eager_trace.record_eager_step``.
    """
    m = with_checkpoints(model, schedule, layers, use_reentrant) if schedule.groups else model
    trace = record_eager_step(m, inputs, loss_fn)
    memory = (calibrator or Calibrator()).memory_model_of(trace.op_nodes)
    predicted = eager_peak(trace, memory)
    measured = None
    if measure:
        params = list(m.parameters())
        args, kwargs = split_inputs(inputs)

        def step() -> None:
            extract_loss(m(*args, **kwargs), loss_fn).backward()

        for _ in range(2):
            for p in params:
                p.grad = None
            step()
        for p in params:
            p.grad = None
        measured = profiled_peak_cpu(step)[0]
        for p in params:
            p.grad = None
    return EagerResult(schedule.provenance, predicted, measured)
