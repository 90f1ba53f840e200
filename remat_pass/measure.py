"""Run a rewritten step, measure its real peak memory, compare its gradients.

Execution: ``run_graph`` runs a GraphModule node by node and drops every value right
after its last use, arguments included (the caller's list is emptied, as AOTAutograd's
boxed calling convention does), which is the schedule ``liveness.analyze`` models.

Measurement (DESIGN.md, Measurement):

- CPU: the PyTorch profiler's allocator events (``profile_memory=True``); the ``[memory]``
  events ordered by ``start_ns()``, running sum of ``nbytes()``; the peak of the running
  sum above the start of the step. Everything the step frees is allocated inside the
  window; one warm-up step runs first.
- CUDA: ``torch.cuda.reset_peak_memory_stats()``, then ``max_memory_allocated()`` minus
  the ``memory_allocated()`` at the start of the step.
- Gradients: the rewritten step against the un-rewritten joint graph run by the same
  executor with the same RNG seed (must be bitwise equal), and the largest absolute
  difference from plain eager autograd on the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx

from .rewrite import RewrittenStep
from .trace import JointGraph, _split_inputs, extract_loss


@torch.no_grad()
def run_graph(gm: fx.GraphModule, args: list[Any]) -> list[Any]:
    """Run ``gm`` node by node under ``no_grad``, freeing each value after its last use.

    Args:
        gm: a graph of placeholders, call_function / get_attr nodes and one output.
        args: one value per placeholder; the list is emptied so that the graph, not the
            caller, decides when an argument dies. Keep no other reference to the values
            if their memory should be released.

    Returns:
        The output node's values as a flat list.
    """
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
    for n in nodes:
        if n.op == "placeholder":
            env[n] = inputs.pop()
        elif n.op == "call_function":
            a = fx.node.map_arg(n.args, env.__getitem__)
            k = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = n.target(*a, **k)
            del a, k
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


def run_step(step: RewrittenStep, joint: JointGraph) -> tuple[list[Any], list[Any]]:
    """One forward + backward of ``step`` on ``joint``'s primals and tangents.

    Returns:
        ``(fwd_outputs, grads)``: the loss (list of one) and one gradient per primal.
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
    """The un-rewritten joint graph, run by the same executor: ``(fwd_outputs, grads)``."""
    out = run_graph(joint.gm, [*joint.primal_values, *joint.tangent_values])
    return out[: joint.num_fwd_outputs], out[joint.num_fwd_outputs :]


def eager_grads(
    model: torch.nn.Module, example_inputs: Any, loss_fn: Any = None
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Loss and parameter gradients from plain eager autograd (``loss.backward()``).

    Parameters are the model's ``named_parameters()`` in order (None for a frozen one).
    ``loss.backward()`` is used rather than ``torch.autograd.grad`` so that models using
    reentrant ``torch.utils.checkpoint`` work; the parameters' own ``.grad`` fields are
    restored afterwards.
    """
    args, kwargs = _split_inputs(example_inputs)
    params = list(model.parameters())
    stash = [p.grad for p in params]
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
    return loss.detach(), grads


def grads_bitwise_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two gradient lists are equal element by element, bit for bit (None = None)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and not (
            x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
        ):
            return False
    return True


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


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null while active (C++ log lines included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def _profiled_peak_cpu(fn: Any) -> tuple[int, list[int]]:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the CPU build's profiler logs start/stop lines on fd 2
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running, peak, timeline = 0, 0, []
    for e in events:
        running += e.nbytes()
        timeline.append(running)
        peak = max(peak, running)
    return peak, timeline


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What running one rewritten step showed.

    Attributes:
        peak_bytes: measured peak activation bytes above the start of the step.
        device: "cpu" or "cuda".
        timeline_bytes: running allocated bytes after every allocator event (CPU).
        loss: the step's loss.
        grads: one gradient per primal (None where none).
    """

    peak_bytes: int
    device: str
    timeline_bytes: tuple[int, ...]
    loss: torch.Tensor
    grads: list[Any]


def measure_step(step: RewrittenStep, joint: JointGraph, seed: int = 0) -> Measurement:
    """Run ``step`` once to warm up, then once measured, both with RNG seed ``seed``.

    The cycle collector runs before the measured step and is paused during it, so that
    no tensor allocated earlier is freed inside the window.

    Returns:
        The Measurement of the second run (its loss and gradients included).
    """
    device = joint.primal_values[0].device.type if joint.primal_values else "cpu"
    result: dict[str, Any] = {}

    def once() -> None:
        torch.manual_seed(seed)
        outs, grads = run_step(step, joint)
        result["loss"], result["grads"] = outs[0], grads

    once()
    result.clear()
    # Python's cycle collector must not free older tensors inside the window: their
    # frees would lower the running sum below what the step itself allocates.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            once()
            torch.cuda.synchronize()
            peak, timeline = torch.cuda.max_memory_allocated() - base, []
        else:
            peak, timeline = _profiled_peak_cpu(once)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Measurement(peak, device, tuple(timeline), result["loss"], result["grads"])
