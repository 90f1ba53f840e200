"""The user's eager program under a recompute setting: predicted (``graph/eager_trace``
recorded on fake tensors, ``liveness/eager_program``) and measured (the real step under
the allocator profiler), without the rewrite.

A setting is applied as users apply it without this project: for a ``transformers``
model, its own ``gradient_checkpointing_enable`` (each layer a
``GradientCheckpointingLayer``, switched on for the recomputed layers only); otherwise
``torch.utils.checkpoint`` around each recomputed layer of the stack. Non-reentrant by
default, as PyTorch recommends; ``use_reentrant=True`` as older code and Megatron-LM's
``CheckpointFunction`` run. A group of K > 1 layers (Megatron-LM's ``uniform`` K) runs
under one ``torch.utils.checkpoint`` call, as Megatron-LM's ``_checkpointed_forward``
does (``custom(l, l + K)``): the group's first layer becomes a ``CheckpointedGroup``
that runs all K layers, the others pass their input through (``GroupedLayer``), which
holds for a stack whose loop passes each layer's output to the next as its first
argument and the same other arguments to every layer; any other loop is refused when
it runs. Megatron-Core runs every setting with its own recompute (``megatron_recompute``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..errors import RematError
from ..graph.eager_branches import eager_scalar_values
from ..graph.eager_trace import record_eager_step, without_weights
from ..graph.flat_step import LossFn, extract_loss, split_inputs
from ..graph.regions import find_layer_stacks
from ..liveness.eager_program import (PEAK_CAUSES, EagerPeak, eager_peak, is_copy, is_dropout_mask, op_name,
                                      peak_cause)
from ..liveness.intervals import memory_intervals
from ..liveness.timeline import MemoryReport
from ..measure.allocator_events import profiled_peak_cpu
from ..models.megatron import is_megatron_core, megatron_crashes_on
from ..memory.calibration import Calibrator
from ..memory.cuda_target import GpuSpec, eager_kernels_on_cuda
from ..memory.memory_model import MemoryModel
from ..recompute.rewrite import RewrittenStep
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


class CheckpointedGroup(nn.Module):
    """Consecutive layers run under one ``torch.utils.checkpoint.checkpoint`` call
    (Megatron-LM's ``_checkpointed_forward`` around ``custom(l, l + K)``): the first
    positional argument goes through the layers in order, the other arguments are
    given to every layer.

    Raises:
        RematError: (when called) a layer returns something other than a tensor of its
            input's shape: the stack's loop does not chain the layers that way.
    """

    def __init__(self, layers: list[nn.Module], use_reentrant: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.use_reentrant = use_reentrant

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self._chain, hidden, *args, use_reentrant=self.use_reentrant, **kwargs)

    def _chain(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        for layer in self.layers:
            out = layer(hidden, *args, **kwargs)
            if not (isinstance(out, torch.Tensor) and isinstance(hidden, torch.Tensor) and out.shape == hidden.shape):
                raise RematError(f"{type(layer).__name__} returns {type(out).__name__}, not a tensor of its first "
                                 "argument's shape: one torch.utils.checkpoint around a group of layers needs a "
                                 "stack whose layers each take the previous layer's output (use K=1 or block N)")
            hidden = out
        return hidden


class GroupedLayer(nn.Module):
    """A layer that a ``CheckpointedGroup`` before it already ran: its input passes
    through (the module is kept, so its parameters stay in the model)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


def with_checkpoints(model: nn.Module, schedule: Schedule, layers: str | None = None,
                     use_reentrant: bool = False) -> nn.Module:
    """A copy of ``model`` whose recomputed groups (``schedule.groups``) each run under
    one ``torch.utils.checkpoint``: a single layer as the model's own per-layer
    checkpointing runs it (transformers' ``activation_checkpointing_enable``), else
    ``CheckpointedLayer``; a group of several layers as a ``CheckpointedGroup``.

    Raises:
        RematError: a schedule for another number of layers than the stack has; a
            transformers layer that cannot be set per layer; a group of several layers
            of a transformers model.
    """
    path, children = find_layer_stacks(model, layers)[0]
    if schedule.num_layers != len(children):
        raise RematError(f"schedule {schedule.provenance} is for {schedule.num_layers} layers; "
                         f"{path} has {len(children)}")
    if getattr(model, "supports_gradient_checkpointing", False) and any(len(g) > 1 for g in schedule.groups):
        raise RematError(f"schedule {schedule.provenance} recomputes groups of several layers: a transformers model "
                         "checkpoints one layer at a time (activation_checkpointing_enable; one checkpoint around "
                         "several layers would recompute through their KV cache): uniform K=1 and block N")
    copied = copy.deepcopy(model)
    stack = copied.get_submodule(path)
    if getattr(copied, "supports_gradient_checkpointing", False):
        _transformers_per_layer(copied, path, stack, children, schedule, use_reentrant)
        return copied
    for group in schedule.groups:
        names = [children[i] for i in group]
        if len(group) == 1:
            stack.register_module(names[0], CheckpointedLayer(stack.get_submodule(names[0]), use_reentrant))
            continue
        members = [stack.get_submodule(n) for n in names]
        stack.register_module(names[0], CheckpointedGroup(members, use_reentrant))
        for name, layer in zip(names[1:], members[1:]):
            stack.register_module(name, GroupedLayer(layer))
    return copied


def _transformers_per_layer(copied: nn.Module, path: str, stack: nn.Module, children: list[str],
                            schedule: Schedule, use_reentrant: bool) -> None:
    """transformers' own per-layer checkpointing (GradientCheckpointingLayer), which also
    turns the KV cache off while training, as users enable it; on for the stack's
    recomputed layers only, off for every other layer of the model (the layers of another
    stack, such as a T5's decoder blocks, which the enable call also switches on)."""
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
    # the enable call switched on every GradientCheckpointingLayer of the model (a T5's
    # decoder blocks too): only the stack's recomputed layers stay on
    from transformers.modeling_layers import GradientCheckpointingLayer

    ours = {id(stack.get_submodule(name)) for name in recomputed}
    for module in copied.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = id(module) in ours


@contextlib.contextmanager
def megatron_recompute(model: nn.Module, schedule: Schedule) -> Iterator[nn.Module]:
    """Megatron-Core's own full recompute set to ``schedule`` on ``model``'s
    ``TransformerConfig`` (``recompute_granularity="full"``, ``recompute_method``,
    ``recompute_num_layers``: ``TransformerBlock._checkpointed_forward`` runs it, with
    Megatron's reentrant ``CheckpointFunction``) while the block is entered, restored after.

    Raises:
        RematError: a schedule that is not none / uniform / block; uniform K that does
            not divide the stack's layers, which Megatron-Core itself cannot run
            (``models.megatron.megatron_crashes_on``: its last chunk indexes past the
            last layer).
    """
    if schedule.method not in ("none", "uniform", "block"):
        raise RematError(f"Megatron-Core runs --recompute-method uniform or block, not {schedule.provenance}")
    if megatron_crashes_on([schedule]):
        raise RematError(f"Megatron-Core cannot run {schedule.provenance} on {schedule.num_layers} layers: "
                         "TransformerBlock._checkpointed_forward's last chunk goes past the last layer (IndexError); "
                         "a uniform K must divide the layers per stage")
    configs = {id(m.config): m.config for m in model.modules() if type(m).__name__ == "TransformerBlock"}
    fields = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    saved = {k: tuple(getattr(c, f) for f in fields) for k, c in configs.items()}
    value = ((None, None, None) if schedule.method == "none" or not schedule.groups
             else ("full", schedule.method, schedule.recompute_num_layers))
    try:
        for c in configs.values():
            for f, v in zip(fields, value):
                setattr(c, f, v)
        yield model
    finally:
        for k, c in configs.items():
            for f, v in zip(fields, saved[k]):
                setattr(c, f, v)


@contextlib.contextmanager
def _collectives_released(timeout_s: float = 1.0) -> Iterator[None]:
    """While measuring: after each ``torch.distributed.all_reduce`` on CPU tensors, wait
    until gloo's worker thread has dropped its reference to the tensor (its use count is
    back to what it was), as ``measure.collective_release`` does for a graph's collectives:
    otherwise a storage whose last reference the worker drops is freed on a thread the
    profiler does not record, and the measured peak is now and then too high by it. An
    asynchronous call (``async_op=True``) waits so in its handle's ``wait()``. Waiting
    changes no value and allocates nothing."""
    import time

    import torch.distributed as dist

    original = dist.all_reduce

    def released(tensor: torch.Tensor, before: int) -> None:
        deadline = time.monotonic() + timeout_s
        while tensor._use_count() > before and time.monotonic() < deadline:
            time.sleep(0)

    class Released:
        """An ``async_op=True`` handle (Megatron-Core's column-parallel backward) whose
        ``wait()`` also waits for the worker's reference to go."""

        def __init__(self, work: Any, tensor: torch.Tensor, before: int):
            self.work, self.tensor, self.before = work, tensor, before

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            out = self.work.wait(*args, **kwargs)
            released(self.tensor, self.before)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self.work, name)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        before = tensor._use_count()
        out = original(tensor, *args, **kwargs)
        if kwargs.get("async_op") is True:
            return Released(out, tensor, before + 1)  # + this wrapper's own reference
        released(tensor, before)
        return out

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


NO_WEIGHTS = ("recorded without weights (meta tensors, as if on the CPU): op scratch from the formula table "
              "only, not calibrated on this machine; not measured")
"""The note of an eager step recorded without weights."""

ON_CUDA = ("predicted for the CUDA target, not run: recorded on CPU fakes with the GPU's attention backend and "
           "fused dropout (cuda_target.eager_kernels_on_cuda), storages in the caching allocator's 512-byte blocks, op scratch "
           "from the CUDA formula table; Python code that branches on the device is not seen")
"""The note of an eager step predicted for a CUDA GPU."""


@dataclasses.dataclass(frozen=True)
class EagerResult:
    """One setting of the eager program.

    Attributes:
        schedule: the setting (``provenance``).
        predicted: the EagerPeak recorded on fake tensors.
        measured_peak_bytes: the real step's peak above its start (None: not run; a
            model without weights is never run).
    """

    schedule: str
    predicted: EagerPeak
    measured_peak_bytes: int | None


def eager_program(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
                  schedule: Schedule, *, layers: str | None = None, use_reentrant: bool = False,
                  measure: bool = True, calibrator: Calibrator | None = None,
                  gpu: GpuSpec | None = None) -> EagerResult:
    """The eager step ``loss_fn(model(*inputs)).backward()`` (inputs and loss as
    ``eager_trace.record_eager_step``) under ``schedule`` (a Megatron-Core model: its own
    recompute, ``megatron_recompute``; uniform K > 1 included)
    (``with_checkpoints``): predicted from fake tensors, and, with ``measure``, measured
    on the real model (two warm-up steps, ``.grad`` None before each; CPU). A model or
    inputs without weights (the meta device: ``eager_trace.without_weights``) are recorded
    as on the CPU with the formula table's op scratch, not measured, and say so in
    ``predicted.notes`` (``NO_WEIGHTS``). With ``gpu``, the program as it runs on that
    CUDA GPU: recorded under ``cuda_target.eager_kernels_on_cuda(gpu)`` (its attention
    backend, ATen's fused dropout), counted in the caching allocator's blocks with the
    formula table's CUDA scratch (``liveness.eager_program``: the host's memory left
    out), never measured, and said so in ``predicted.notes`` (``ON_CUDA``).

    Raises:
        RematError: as ``with_checkpoints`` and ``eager_trace.record_eager_step``.
    """
    if is_megatron_core(model):
        with megatron_recompute(model, schedule):
            return _run(model, inputs, loss_fn, schedule, measure, calibrator, gpu)
    m = with_checkpoints(model, schedule, layers, use_reentrant) if schedule.groups else model
    return _run(m, inputs, loss_fn, schedule, measure, calibrator, gpu)


def _run(m: nn.Module, inputs: Any, loss_fn: LossFn | None, schedule: Schedule, measure: bool,
         calibrator: Calibrator | None, gpu: GpuSpec | None) -> EagerResult:
    scalars = None
    if not without_weights(m, inputs):  # the branches the real step takes on its values
        with _collectives_released():
            scalars = eager_scalar_values(m, inputs, loss_fn)
    if gpu is not None:
        trace = record_eager_step(m, inputs, loss_fn, kernels=lambda: eager_kernels_on_cuda(gpu), scalars=scalars)
        predicted = eager_peak(trace, MemoryModel.table_only("cuda"))
        return EagerResult(schedule.provenance, dataclasses.replace(predicted, notes=(*predicted.notes, ON_CUDA)),
                           None)
    trace = record_eager_step(m, inputs, loss_fn, scalars=scalars)
    if without_weights(m, inputs):  # predicted only, as a fake step of the rewrite (session.Session)
        predicted = eager_peak(trace, MemoryModel.table_only("cpu"))
        return EagerResult(schedule.provenance, dataclasses.replace(predicted, notes=(*predicted.notes, NO_WEIGHTS)),
                           None)
    memory = (calibrator or Calibrator()).memory_model_of(trace.op_nodes)
    predicted = eager_peak(trace, memory)
    measured = None
    if measure:
        params = list(m.parameters())
        args, kwargs = split_inputs(inputs)

        def step() -> None:
            extract_loss(m(*args, **kwargs), loss_fn).backward()

        with _collectives_released():
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


def rewrite_live_by_op(step: RewrittenStep, report: MemoryReport) -> dict[str, int]:
    """The bytes live at the rewritten step's peak (``report.live_at_peak``) by the op
    that allocated them, named as ``EagerPeak.live_at_peak_ops`` names the eager
    program's (``op_name``; an output of a multi-output op by that op, a recomputed
    value by its op); what no op made by its kind (``"(gradient)"``), the peak op's
    scratch as ``"(scratch)"``. Sums to ``report.peak_bytes`` (bytes)."""
    nodes: dict[str, Any] = {}
    for gm in (step.backward, step.forward):  # a saved value is a forward op and a backward input of one name
        nodes.update({n.name: n for n in gm.graph.nodes if n.op == "call_function"})
    out: dict[str, int] = {}
    for t in report.live_at_peak:
        node = nodes.get(t.name)
        while node is not None and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        if node is not None and node.target is torch.ops.higher_order.run_with_rng_state:
            target = node.args[1]  # a random op replayed on a recompute: the op itself
        else:
            target = None if node is None else node.target
        name = op_name(target) if target is not None else f"({t.kind})"
        out[name] = out.get(name, 0) + t.nbytes
    rest = report.peak_bytes - sum(t.nbytes for t in report.live_at_peak)
    if rest:
        out["(scratch)"] = out.get("(scratch)", 0) + rest
    return out


def rewrite_live_by_cause(step: RewrittenStep, report: MemoryReport) -> dict[str, int]:
    """The bytes live at the rewritten step's peak by ``liveness.eager_program.peak_cause``
    (each of ``PEAK_CAUSES``), from the liveness intervals ``report`` was computed from;
    the peak op's scratch under ``"the rest"``. Sums to ``report.peak_bytes`` (bytes).
    Its ``"held outputs"`` are 0: liveness frees every storage after its last read."""
    iv, _ = memory_intervals(step, report.memory)
    nodes: dict[str, Any] = {}
    for gm in (step.backward, step.forward):
        nodes.update({n.name: n for n in gm.graph.nodes if n.op == "call_function"})
    p = report.peak_step
    ordinal, count = [], {}  # which output of its node each storage is (they are made in output order)
    for s in iv.storages:
        count[s.name, s.first] = count.get((s.name, s.first), -1) + 1
        ordinal.append(count[s.name, s.first])
    live = [(s, k) for s, k in zip(iv.storages, ordinal)
            if not s.static and s.kind != "scratch" and s.nbytes and s.first <= p <= s.last]
    made = {s.nbytes for s, _ in live if s.first == p}
    out = dict.fromkeys(PEAK_CAUSES, 0)
    for s, k in live:
        node = nodes.get(s.name)
        cause = peak_cause(s.first == p, s.last == p, s.last > p, s.kind not in ("gradient", "output"),
                           s.nbytes in made, node is not None and is_copy(node),
                           node is not None and is_dropout_mask(node, k))
        out[cause] += s.nbytes
    out["the rest"] += report.peak_bytes - sum(s.nbytes for s, _ in live)
    return out


def peak_difference_by_cause(eager: EagerPeak, rewrite_by_cause: dict[str, int]) -> list[tuple[str, int]]:
    """``rewrite - eager`` bytes at each program's own peak by cause (``PEAK_CAUSES``
    order: ``rewrite_live_by_cause`` against ``EagerPeak.live_at_peak_causes``); the
    terms sum to the rewrite's peak minus the eager program's (bytes). Empty when the
    eager recording has no reads."""
    if not eager.live_at_peak_causes:
        return []
    eager_by_cause = dict(eager.live_at_peak_causes)
    return [(c, rewrite_by_cause.get(c, 0) - eager_by_cause.get(c, 0)) for c in PEAK_CAUSES]


def peak_difference_by_op(eager: EagerPeak, rewrite_by_op: dict[str, int]) -> list[tuple[str, int]]:
    """``rewrite - eager`` bytes at each program's own peak, by the op that allocated
    them (``rewrite_live_by_op`` against ``EagerPeak.live_at_peak_ops``), the largest
    differences first, zeros left out: the terms sum to the rewrite's peak minus the
    eager program's (bytes). It names where the two programs' peaks differ (an op the
    rewrite functionalized, a copy, a mask's dtype, what the eager program still holds);
    it is a comparison of the two peaks, not of two timelines."""
    eager_by_op = dict(eager.live_at_peak_ops)
    diff = {op: rewrite_by_op.get(op, 0) - eager_by_op.get(op, 0) for op in {*eager_by_op, *rewrite_by_op}}
    return sorted(((op, d) for op, d in diff.items() if d), key=lambda x: (-abs(x[1]), x[0]))
