"""Run a rewritten step, measure its real peak memory, compare its gradients.

Execution: ``run_graph`` runs a GraphModule node by node and drops every value right
after its last use, arguments included (the caller's list is emptied, as AOTAutograd's
boxed calling convention does), which is the schedule ``liveness.analyze`` models.

Measurement (DESIGN.md, Measurement):

- CPU: the PyTorch profiler's allocator events (``profile_memory=True``); the ``[memory]``
  events ordered by ``start_ns()``, running sum of ``nbytes()``; the peak of the running
  sum above the start of the step. Only what the step allocates counts: a free is counted
  for a block allocated inside the window (matched by address, ``step_allocator_events``);
  one warm-up step runs first.
- CUDA: ``torch.cuda.reset_peak_memory_stats()``, then ``max_memory_allocated()`` minus
  the ``memory_allocated()`` at the start of the step.
- Gradients: the rewritten step against the un-rewritten joint graph run by the same
  executor with the same RNG seed (must be bitwise equal), and the largest absolute
  difference from plain eager autograd on the model.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..errors import UnsupportedGraph
from .collective_release import released_by_collective_thread
from ..graph.buffer_updates import updated_buffers
from .allocator_events import (AllocatorEvent, profile_memory_events, profiled_peak_cpu, running_bytes,  # noqa: F401
                               step_allocator_events)
from .quiet import collector_paused as _collector_paused
from ..graph.flat_step import split_inputs, extract_loss
from ..graph.op_signature import RealLayout, op_call, value_arguments
from ..recompute.rewrite import RewrittenStep
from ..graph.trace import JointGraph, RealLayouts


def run_graph(gm: fx.GraphModule, args: list[Any]) -> list[Any]:
    """Run ``gm`` node by node under ``no_grad``, freeing each value after its last use.

    Args:
        gm: a graph of placeholders, call_function / get_attr nodes and one output.
        args: one value per placeholder; the list is emptied so that the graph, not the
            caller, decides when an argument dies. Keep no other reference to the values
            if their memory should be released.

    Returns:
        The output node's values as a flat list.

    Raises:
        UnsupportedGraph: an op fails on the real tensors (see ``run_graph_recorded``).
    """
    return _run_graph(gm, args, None)


def run_graph_recorded(gm: fx.GraphModule, args: list[Any]) -> tuple[list[Any], RealLayouts]:
    """``run_graph``, and the ``RealLayouts`` the run shows: the RealLayout of every
    call_function node whose real tensor value differs in strides, storage offset or
    storage bytes from its traced FakeTensor (``node.meta["val"]``), by node name, and
    the values (``RealLayout.values``) of every node that is the argument of an op in
    ``op_signature.VALUE_ARGUMENTS``.

    Returns:
        ``(the output node's values as a flat list, the real layouts)``.

    Raises:
        UnsupportedGraph: an op of the graph fails on the real tensors (e.g. a ``view``
            of a tensor whose real strides differ from the traced ones, because an op's
            meta function and its kernel disagree on the output's layout); names the
            node and the first node whose real strides differed from the traced ones.
    """
    layouts: dict[str, RealLayout] = {}
    return _run_graph(gm, args, layouts), RealLayouts(layouts)


@torch.no_grad()
def _run_graph(gm: fx.GraphModule, args: list[Any], layouts: dict[str, RealLayout] | None) -> list[Any]:
    """The one executor of ``run_graph`` and ``run_graph_recorded`` (``layouts``: None,
    or the dict the run's real layouts are recorded in)."""
    nodes = list(gm.graph.nodes)
    last_user: dict[fx.Node, fx.Node] = {}
    for n in reversed(nodes):
        for a in n.all_input_nodes:
            last_user.setdefault(a, n)
    free_after: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_user.items():
        free_after.setdefault(user, []).append(value)
    env: dict[fx.Node, Any] = {}
    inputs = list(args)
    args.clear()
    inputs.reverse()
    result: list[Any] = []
    first_mismatch: str | None = None
    for n in nodes:
        if n.op == "placeholder":
            env[n] = inputs.pop()
        elif n.op == "call_function":
            a = fx.node.map_arg(n.args, env.__getitem__)
            k = fx.node.map_arg(n.kwargs, env.__getitem__)
            if layouts is not None:
                _record_values(n, env, layouts)
            try:
                env[n] = n.target(*a, **k)
            except RuntimeError as e:
                raise _cannot_run(n, e, first_mismatch) from e
            del a, k
            released_by_collective_thread(n, env[n])
            if first_mismatch is None:
                first_mismatch = _stride_mismatch(n, env[n])
            if layouts is not None:
                real = _real_layout(n, env[n])
                if real is not None:
                    layouts[n.name] = real
        elif n.op == "get_attr":
            obj: Any = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            env[n] = obj
        elif n.op == "output":
            result = list(fx.node.map_arg(n.args[0], env.__getitem__))
        else:
            raise ValueError(f"run_graph cannot run {n.op} node {n.format_node()}")
        if n not in last_user and n.op != "output":
            env.pop(n, None)  # dead value: freed at once
        for v in free_after.get(n, ()):
            env.pop(v, None)
    env.clear()
    return result


def _record_values(node: fx.Node, env: dict[fx.Node, Any], layouts: dict[str, RealLayout]) -> None:
    """Record in ``layouts`` the values of the argument of ``node``'s op whose values
    decide its allocations (``op_signature.value_arguments``: ``_grouped_mm``'s offsets, a
    boolean mask of ``index_put``)."""
    call = op_call(node)
    for src in value_arguments(call) if call is not None else ():
        if isinstance(env.get(src), torch.Tensor):
            value = env[src]
            layout = layouts.get(src.name) or RealLayout.of(value)
            layouts[src.name] = dataclasses.replace(layout, values=tuple(int(v) for v in value.flatten().tolist()))


def _real_layout(node: fx.Node, value: Any) -> RealLayout | None:
    """The RealLayout of ``value`` when it differs from the layout of ``node``'s traced
    FakeTensor (same shape; strides, offset or storage bytes differ), else None."""
    val = node.meta.get("val")
    if not (isinstance(value, torch.Tensor) and isinstance(val, torch.Tensor)) or value.layout != torch.strided:
        return None
    real = RealLayout.of(value)
    try:
        traced = RealLayout.of(val)
    except (TypeError, RuntimeError):  # symbolic sizes: no concrete layout to compare
        return None
    return real if real != traced and tuple(val.shape) == tuple(value.shape) else None


def _stride_mismatch(node: fx.Node, value: Any) -> str | None:
    """``"name: traced strides (..), real (..)"`` when a tensor's real strides differ
    from its traced (FakeTensor) ones in a dimension of size above 1, else None (the
    stride of a size-1 dimension never moves an element: a scalar's expand to
    ``[2, 1, 2]`` is ``(0, 1, 0)`` traced and ``(0, 0, 0)`` real, the same layout)."""
    val = node.meta.get("val")
    if not (isinstance(value, torch.Tensor) and isinstance(val, torch.Tensor)) or value.dim() < 2:
        return None
    traced, real = tuple(val.stride()), tuple(value.stride())
    if tuple(val.shape) != tuple(value.shape) or all(
            t == r for t, r, n in zip(traced, real, value.shape) if n > 1):
        return None
    op = node.args[0].target if node.target is operator.getitem and isinstance(node.args[0], fx.Node) else node.target
    return f"{node.name} (output of {op}): traced strides {traced}, real {real}"


def _cannot_run(node: fx.Node, error: RuntimeError, first_mismatch: str | None) -> UnsupportedGraph:
    why = (f"; the first value whose real memory layout differs from the traced one is {first_mismatch}, "
           "i.e. that op's meta function (used for tracing) and its kernel disagree on the output's strides, "
           "so the traced graph is not valid for the real tensors" if first_mismatch else "")
    return UnsupportedGraph(
        f"the traced step cannot run: node {node.name} ({node.target}) fails on the real tensors "
        f"({type(error).__name__}: {error}){why}. No peak is valid for it: make that op's input "
        "contiguous in the model (.contiguous() before it), or keep the op outside the traced model"
    )


def run_step(step: RewrittenStep, joint: JointGraph) -> tuple[list[Any], list[Any]]:
    """One forward + backward of ``step`` on ``joint``'s primals and tangents.

    The step is functional: a buffer it writes in place (``JointGraph.buffer_updates``)
    is left as it was, its new value is a forward output (``buffer_updates.updated_buffers``).

    Returns:
        ``(fwd_outputs, grads)``: the loss (then the buffers' new values) and one
        gradient per primal.
    """
    fw_out = run_graph(step.forward, list(joint.primal_values))
    k = step.num_fwd_outputs
    outputs, bw_args = fw_out[:k], fw_out[k:]
    del fw_out
    bw_args += [joint.primal_values[i] for i in step.backward_primal_indices]
    bw_args += list(joint.tangent_values)
    grads = run_graph(step.backward, bw_args)
    return outputs, grads


def run_joint(joint: JointGraph) -> tuple[list[Any], list[Any]]:
    """The un-rewritten joint graph, run by the same executor: ``(fwd_outputs, grads)``
    (raises as ``run_graph``)."""
    out = run_graph(joint.gm, [*joint.primal_values, *joint.tangent_values])
    return out[: joint.num_fwd_outputs], out[joint.num_fwd_outputs :]


@dataclasses.dataclass(frozen=True)
class JointRun:
    """One run of the un-rewritten joint graph (``reference_run``).

    Attributes:
        outputs: the forward outputs (the loss: a list of one).
        grads: one gradient per primal (None where none).
        layouts: the real layouts of the values that differ from the traced ones, and
            the values an op's memory depends on (``RealLayouts``); what a rewrite of
            the same step takes to carry them (``rewrite.rewrite(..., layouts)``).
    """

    outputs: list[Any]
    grads: list[Any]
    layouts: RealLayouts


def reference_run(joint: JointGraph) -> JointRun:
    """Run the un-rewritten joint graph once, as ``run_joint`` does (seed the RNG
    first), and return what it showed as a value: outputs, gradients, real layouts.

    Raises:
        UnsupportedGraph: an op fails on the real tensors; names the node and the first
            value whose real layout differed from the traced one (``run_graph``).
    """
    out, layouts = run_graph_recorded(joint.gm, [*joint.primal_values, *joint.tangent_values])
    return JointRun(out[: joint.num_fwd_outputs], out[joint.num_fwd_outputs :], layouts)


def eager_grads(
    model: torch.nn.Module, example_inputs: Any, loss_fn: Any = None
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Loss and parameter gradients from plain eager autograd (``loss.backward()``).

    Parameters are the model's ``named_parameters()`` in order (None for a frozen one).
    ``loss.backward()`` is used rather than ``torch.autograd.grad`` so that models using
    reentrant ``torch.utils.checkpoint`` work; the parameters' own ``.grad`` fields are
    restored afterwards, and so are the buffers the step writes in place (BatchNorm's
    running statistics in train mode), so the model is left as it was.
    """
    args, kwargs = split_inputs(example_inputs)
    params = list(model.parameters())
    stash = [p.grad for p in params]
    buffers = [(b, b.clone()) for b in model.buffers() if not (b.is_meta or b.is_inference())]
    for p in params:
        p.grad = None
    try:
        loss = extract_loss(model(*args, **kwargs), loss_fn)
        if loss.requires_grad:
            loss.backward()
        grads = [p.grad for p in params]
    finally:
        for p, g in zip(params, stash):
            p.grad = g
        with torch.no_grad():
            for b, old in buffers:
                if not torch.equal(b, old):
                    b.copy_(old)
    return loss.detach(), grads


def grads_bitwise_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two gradient lists are equal element by element, bit for bit (None = None).

    Floating-point values are compared as their bit patterns, so a NaN equals a NaN of
    the same bits (``torch.equal`` says NaN != NaN, which would call a model whose own
    gradients hold NaN, e.g. from ``h * log_softmax(h)`` overflowing, wrongly rewritten)
    and -0.0 differs from 0.0.
    """
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and not (
            x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
        ):
            return False
    return True


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same size (their bit patterns); others as they are."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def max_abs_diff(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Largest |a - b| over paired tensors (inf if one is None and the other is not)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        if x is None or y is None:
            return float("inf")
        worst = max(worst, float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
    return worst


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What running one rewritten step showed.

    Attributes:
        peak_bytes: measured peak activation bytes above the start of the step.
        device: "cpu" or "cuda".
        timeline_bytes: running allocated bytes after every allocator event (CPU).
        loss: the step's loss.
        grads: one gradient per primal (None where none).
        buffers: the value after the step of every buffer or input the step writes in
            place (``JointGraph.buffer_updates``: BatchNorm's running statistics), by
            primal label; the primals themselves are left as they were. Empty: none.
    """

    peak_bytes: int
    device: str
    timeline_bytes: tuple[int, ...]
    loss: torch.Tensor
    grads: list[Any]
    buffers: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def measure_step(step: RewrittenStep, joint: JointGraph, seed: int = 0) -> Measurement:
    """Run ``step`` once to warm up, then once measured, both with RNG seed ``seed``.

    The cycle collector is paused during the measured step, so that no tensor allocated
    earlier is freed inside the window. ``measured_step_timeline``
    measures the same way, per step.

    Returns:
        The Measurement of the second run (its loss and gradients included).
    """
    device = joint.primal_values[0].device.type if joint.primal_values else "cpu"
    result: dict[str, Any] = {}

    def once() -> None:
        torch.manual_seed(seed)
        outs, grads = run_step(step, joint)
        result["loss"], result["grads"] = outs[0], grads
        result["buffers"] = updated_buffers(outs, joint.num_user_outputs, joint.buffer_updates, joint.primal_labels)

    once()
    result.clear()
    if device == "cuda":
        with _collector_paused():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            once()
            torch.cuda.synchronize()
            peak, timeline = torch.cuda.max_memory_allocated() - base, []
    else:
        peak, timeline = profiled_peak_cpu(once)
    return Measurement(peak, device, tuple(timeline), result["loss"], result["grads"], result["buffers"])


class _MarkedGraph:
    """A graph whose call_function nodes run inside ``record_function(label)``; duck-types
    the GraphModule that ``run_graph`` needs (``.graph`` and attributes)."""

    def __init__(self, gm: fx.GraphModule, first: int):
        self._gm = gm
        self.graph = fx.Graph()
        out = self.graph.graph_copy(gm.graph, {})
        self.graph.output(out)
        self.labels: list[str] = []  # one per step; get_attr steps run no op
        for new in self.graph.nodes:
            if new.op in ("placeholder", "output"):
                continue
            label = f"remat::{first + len(self.labels)}"
            self.labels.append(label)
            if new.op == "call_function":
                new.target = _marked(new.target, label)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gm, name)


def _marked(target: Any, label: str) -> Any:
    from torch.profiler import record_function

    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return target(*args, **kwargs)

    return run


def measured_step_timeline(step: RewrittenStep, joint: JointGraph, seed: int = 0) -> tuple[int, ...]:
    """Measured live bytes at every step of ``step``, aligned with ``MemoryReport.timeline``.

    Runs the step as ``measure_step`` does on CPU (one warm-up, then one run under the
    profiler with the collector paused), with every node's call wrapped in
    ``record_function("remat::<i>")``. The allocator events are ordered by time and
    summed; step i's value is the largest running sum between the start and the end of
    node i (its inputs and outputs coexist there, as the liveness model counts), or the
    running sum when it starts if the node allocates nothing; a get_attr step (no op
    runs) takes the running sum when the next op starts. Frees of values after
    their last use happen between nodes, outside every window, as in the model.

    Differences from the prediction are real: scratch memory an op allocates and frees
    inside itself raises the measured value of that step only.

    Args:
        step: the rewritten step; joint: its JointGraph (primal and tangent values).
        seed: RNG seed for both runs (dropout masks).

    Returns:
        One int per step (forward steps, then backward steps), bytes above the start.

    Raises:
        ValueError: the step runs on CUDA (use ``measure_step``'s peak there).
    """
    device = joint.primal_values[0].device.type if joint.primal_values else "cpu"
    if device != "cpu":
        raise ValueError(f"measured_step_timeline runs on CPU only; this step runs on {device}")
    fw = _MarkedGraph(step.forward, 0)
    bw = _MarkedGraph(step.backward, len(fw.labels))
    marked = dataclasses.replace(step, forward=fw, backward=bw)

    def once() -> None:
        torch.manual_seed(seed)
        run_step(marked, joint)

    once()
    events = profile_memory_events(once)
    windows = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns())
               for e in events if e.name().startswith("remat::")}
    times, running = running_bytes(events)
    out: list[int | None] = []
    for label in fw.labels + bw.labels:
        if label not in windows:  # a get_attr step: no op runs, nothing is allocated
            out.append(None)
            continue
        start, stop = windows[label]
        i0 = bisect.bisect_left(times, start)
        i1 = bisect.bisect_right(times, stop)
        before = running[i0 - 1] if i0 > 0 else 0
        # a get_attr step holds what is live when the next op starts: the previous op's
        # outputs, after the frees that follow it (not its scratch)
        out = [before if v is None else v for v in out]
        out.append(max([before, *running[i0:i1]]))
    end = running[-1] if running else 0
    return tuple(end if v is None else v for v in out)
