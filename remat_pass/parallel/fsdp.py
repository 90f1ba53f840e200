"""FSDP2 (``fully_shard`` per layer and on the root): one rank's predicted step.

The rank runs the unsharded model's step on its share of the batch; FSDP2 adds its
parameter and gradient buffers at its hooks. The step's own activation bytes come from
the joint graph's liveness (``intervals.live_intervals`` / ``live_timeline``, the one
sweep); FSDP's buffers are storages added over the steps they span, and the moments
inside a hook (between two steps) are checked apart. Units: each layer of the stack
and the root (every parameter outside it); P_u is a unit's unsharded bytes (each
parameter's first dimension padded to a multiple of the world size d).

Life cycle, read from torch 2.13 ``_fsdp_param_group.py`` and measured per hook with the
profiler on gloo (``distributed.fsdp_rank_main``), ``reshard_after_forward=True``:

- static: the sharded parameters, sum of P_u / d.
- pre_forward(u): all-gather into ``all_gather_output`` (P_u) with a gloo temporary
  of P_u during the call, then the copy-out into the unsharded parameters (P_u). In
  forward the all-gather output is kept in ``comm_ctx.all_gather_state`` until the next
  unit's copy-out (FSDP2 keeps it to overlap that copy-out with the next all-gather);
  the root's post_forward frees the last one.
- post_forward(u): the unsharded parameters are freed (the root's after the whole
  forward).
- pre_backward(root), at the start of backward: the root is gathered again (its
  all-gather output freed right after the copy-out in backward), then the last layer
  is prefetched: its all-gather output (+ the gloo temporary) lives until that
  layer's pre_backward copies it out; each pre_backward(u) prefetches u - 1 the same
  way.
- post_backward(u), after layer u's last backward step: the unsharded parameters are
  freed; the previous unit's ``reduce_scatter_input`` is freed (one kept in flight);
  u's gradients are copied into a new ``reduce_scatter_input`` (P_u) and freed; the
  sharded gradient (P_u / d) is kept; gloo's copy of the reduce-scatter input (P_u)
  lives during the call. The root's post_backward runs after the last step.

What this model leaves out (the measured difference is reported per hook by
``benchmarks/distributed.py``): eager autograd's own order of frees inside a layer
(the timeline is the AOT graph's), the moment autograd fires FSDP's post-backward hook
(when the layer's input gradient is ready, which may precede its last weight
gradient), and gloo's copy of a reduce-scatter input, which a worker thread releases
at a time that varies from run to run (up to the next collective).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from ..liveness.intervals import Storage, memory_intervals
from ..liveness.timeline import live_timeline
from ..memory.memory_model import MemoryModel
from ..recompute.rewrite import RewrittenStep

ROOT = None


@dataclasses.dataclass(frozen=True)
class FsdpPrediction:
    """One rank's FSDP2 step (bytes).

    Attributes:
        peak_bytes: predicted peak activation bytes (FSDP's buffers included).
        where: the step or hook at the peak (``pre_backward(layer 2)``, a node name).
        static_bytes: sharded parameters (sum of P_u / d).
        unit_bytes: unsharded bytes of each unit (``"root"`` and layer indices).
        hooks: predicted bytes at each hook instant, in order.
        step_peak_bytes: the highest step of the timeline (outside the hooks).
    """

    peak_bytes: int
    where: str
    static_bytes: int
    unit_bytes: dict[str, int]
    hooks: tuple[tuple[str, int], ...]
    step_peak_bytes: int


def _padded_bytes(t: torch.Tensor, world: int) -> int:
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    return -(-rows // world) * world * per_row * t.element_size()


def unit_of(label: str, stack_path: str) -> int | None:
    """The layer a parameter name belongs to (None: the root)."""
    prefix = stack_path + "."
    return int(label[len(prefix):].split(".")[0]) if label.startswith(prefix) else ROOT


def predict_fsdp(step: RewrittenStep, primal_values: list[Any], primal_kinds: list[str],
                 primal_labels: list[str], stack_path: str, num_layers: int, world: int) -> FsdpPrediction:
    """The predicted step of one FSDP2 rank (module docstring).

    Args:
        step: the rank's local step (its share of the batch, unsharded model).
        primal_values, primal_kinds, primal_labels: of its joint graph.
        stack_path: the layer stack (each layer is one ``fully_shard`` unit).
        num_layers: L; world: d, the FSDP size.
    """
    iv = memory_intervals(step, MemoryModel.table_only())[0]
    units = _unit_bytes(primal_values, primal_kinds, primal_labels, stack_path, world)
    fw, bw = _layer_spans(step, iv, num_layers)
    post_bw = {u: bw[u][1] for u in range(num_layers)}
    grads = _cut_gradients(step, iv, primal_kinds, primal_labels, stack_path, post_bw)
    order = sorted(range(num_layers), key=lambda u: bw[u][0])  # backward order: L-1 first
    _add_fsdp_storages(iv, step, units, fw, bw, order, world)
    timeline = live_timeline(iv)
    hooks = _hook_bytes(iv, timeline, units, fw, bw, order, grads, world)
    peak_step = max(range(len(timeline)), key=lambda i: (timeline[i], -i)) if timeline else 0
    best_hook = max(hooks, key=lambda h: h[1])
    step_peak = timeline[peak_step] if timeline else 0
    peak, where = (best_hook[1], best_hook[0]) if best_hook[1] > step_peak else (step_peak, iv.steps[peak_step].name)
    return FsdpPrediction(peak, where, sum(-(-b // world) for b in units.values()),
                          {("root" if u is None else str(u)): b for u, b in units.items()}, tuple(hooks), step_peak)


def _unit_bytes(primal_values: list[Any], primal_kinds: list[str], primal_labels: list[str], stack_path: str,
                world: int) -> dict[Any, int]:
    """P_u: the unsharded (padded) parameter bytes of each unit (ROOT and layer indices)."""
    units: dict[Any, int] = {}
    for v, kind, label in zip(primal_values, primal_kinds, primal_labels):
        if kind == "param":
            u = unit_of(label, stack_path)
            units[u] = units.get(u, 0) + _padded_bytes(v, world)
    return units


def _layer_spans(step: RewrittenStep, iv: Any, num_layers: int) -> tuple[dict[int, tuple[int, int]],
                                                                         dict[int, tuple[int, int]]]:
    """The first and last step of each layer in forward and in backward."""
    n_fw = len(iv.fw_steps)
    layer_steps: dict[int, list[int]] = {}
    for i, n in enumerate(iv.steps):
        layer = step.layer_of.get(n.name)
        if layer is not None:
            layer_steps.setdefault(layer, []).append(i)
    fw = {u: (min(s for s in layer_steps[u] if s < n_fw), max(s for s in layer_steps[u] if s < n_fw))
          for u in range(num_layers)}
    bw = {u: (min(s for s in layer_steps[u] if s >= n_fw), max(s for s in layer_steps[u] if s >= n_fw))
          for u in range(num_layers)}
    return fw, bw


def _add_fsdp_storages(iv: Any, step: RewrittenStep, units: dict[Any, int], fw: dict[int, tuple[int, int]],
                       bw: dict[int, tuple[int, int]], order: list[int], world: int) -> None:
    """Add FSDP's buffers to ``iv`` as storages over the steps they span (module
    docstring): unsharded parameters, all-gather outputs (prefetched in backward), the
    loss gradient, sharded gradients and reduce-scatter inputs."""
    n_fw, end, num_layers = len(iv.fw_steps), len(iv.steps) - 1, len(fw)
    post_bw = {u: bw[u][1] for u in range(num_layers)}

    def add(nbytes: int, first: int, last: int, name: str) -> None:
        if nbytes and last >= first:
            iv.storages.append(Storage(nbytes, first, last, name, None, "fsdp", False))

    add(units[ROOT], 0, n_fw - 1, "root.unsharded.forward")
    for u in range(num_layers):
        add(units[u], fw[u][0], fw[u][1], f"{u}.unsharded.forward")
        nxt = fw[u + 1][0] - 1 if u + 1 < num_layers else n_fw - 1
        add(units[u], fw[u][0], nxt, f"{u}.all_gather_output.forward")
    for ph in (n for n in step.backward.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")):
        t = iv.storages[iv.sid_of[ph]]
        # eager autograd allocates it, and torch.autograd.backward holds it (its
        # grad_tensors) until backward returns: through every backward hook
        add(t.nbytes, n_fw, end, "loss_gradient")
    add(units[ROOT], 0, fw[0][0] - 1 if num_layers else n_fw - 1, "root.all_gather_output.forward")
    add(units[ROOT], n_fw, end, "root.unsharded.backward")
    prefetch_from = n_fw
    for u in order:
        add(units[u], prefetch_from, bw[u][0] - 1, f"{u}.all_gather_output.prefetch")
        add(units[u], bw[u][0], bw[u][1], f"{u}.unsharded.backward")
        prefetch_from = bw[u][0]
    for k, u in enumerate(order):
        add(-(-units[u] // world), post_bw[u] + 1, end, f"{u}.sharded_gradient")
        until = post_bw[order[k + 1]] if k + 1 < len(order) else end
        add(units[u], post_bw[u] + 1, until, f"{u}.reduce_scatter_input")


def _hook_bytes(iv: Any, timeline: list[int], units: dict[Any, int], fw: dict[int, tuple[int, int]],
                bw: dict[int, tuple[int, int]], order: list[int], grads: dict[Any, int],
                world: int) -> list[tuple[str, int]]:
    """The predicted bytes at each hook instant, in run order (module docstring)."""
    n_fw, end, num_layers = len(iv.fw_steps), len(iv.steps) - 1, len(fw)
    post_bw = {u: bw[u][1] for u in range(num_layers)}
    live = [s for s in iv.storages if not s.static and s.nbytes]

    def across(a: int) -> int:
        """Bytes live both at step a - 1 and at step a (what a hook between them sees),
        with what an earlier hook between them (a post_backward) created."""
        made_here = ("reduce_scatter_input", "gloo_reduce_scatter_copy", "sharded_gradient", "loss_gradient")
        return sum(s.nbytes for s in live if s.last >= a and (
            s.first <= a - 1 or (s.first == a and s.kind == "fsdp" and s.name.endswith(made_here))))

    hooks = [("pre_forward(root)", 2 * units[ROOT])]
    for u in range(num_layers):  # the previous all-gather output, + u's + gloo temporary, then + the copy-out
        hooks.append((f"pre_forward(layer {u})", across(fw[u][0]) + units[u - 1 if u else ROOT] + 2 * units[u]))
    first = order[0] if order else None
    prefetch = 2 * units[first] if first is not None else 0
    hooks.append(("pre_backward(root)", across(n_fw) + max(2 * units[ROOT], units[ROOT] + prefetch)))
    for k, u in enumerate(order):
        nxt = order[k + 1] if k + 1 < len(order) else None
        prefetch = 2 * units[nxt] if nxt is not None else 0
        hooks.append((f"pre_backward(layer {u})", across(bw[u][0]) + max(2 * units[u], units[u] + prefetch)))
        after = post_bw[u] + 1
        base = sum(x.nbytes for x in live if x.first <= after - 1 and x.last >= after) if after <= end else timeline[end]
        base += units[nxt] if nxt is not None else 0  # the prefetched all-gather output, copied out after this hook
        shard = -(-units[u] // world)
        prev = units[order[k - 1]] if k else 0
        start = base + units[u] + prev + grads.get(u, 0)  # unsharded u, previous rs input, u's gradients
        hooks.append((f"post_backward(layer {u})", max(start, base + max(grads.get(u, 0) + units[u],
                                                                         2 * units[u] + shard))))
    last = order[-1] if order else None
    base = timeline[end] - units[ROOT] - (units[last] if last is not None else 0)
    # the root's gradients are still in timeline[end]: + its reduce-scatter input, then
    # - its gradients + its shard + gloo's copy
    hooks.append(("post_backward(root)", base + max(units[ROOT],
                                                    2 * units[ROOT] + -(-units[ROOT] // world) - grads.get(ROOT, 0))))
    return hooks


def _cut_gradients(step: RewrittenStep, iv: Any, primal_kinds: list[str], primal_labels: list[str],
                   stack_path: str, post_bw: dict[int, int]) -> dict[Any, int]:
    """End each layer's parameter gradients at its post_backward (they move into the
    reduce-scatter input); returns the gradient bytes per unit."""
    out_node = next(n for n in reversed(step.backward.graph.nodes) if n.op == "output")
    per_unit: dict[Any, int] = {}
    seen: set[int] = set()
    for i, g in enumerate(out_node.args[0]):
        if i >= len(primal_kinds) or primal_kinds[i] != "param" or not isinstance(g, fx.Node):
            continue
        sid = iv.sid_of.get(g)
        if not isinstance(sid, int) or sid in seen or iv.storages[sid].static:
            continue
        seen.add(sid)
        u = unit_of(primal_labels[i], stack_path)
        per_unit[u] = per_unit.get(u, 0) + iv.storages[sid].nbytes
        if u is not None:
            iv.storages[sid].last = post_bw[u]
    return per_unit
