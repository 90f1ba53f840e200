"""Partition a joint graph into forward and backward graphs under a recompute Schedule.

For every recomputed group g (layers ``schedule.groups[g]``):

- The values of group g that group g's backward reads are recomputed from the group's
  inputs (checkpoints: values defined outside the group and read by the recomputed
  nodes). Checkpoints are saved; a checkpoint shared by many groups (a mask, a rotary
  table) is saved once.
- The recompute segment is placed immediately before the first backward node that
  reads a recomputed value of group g (the start of group g's backward, as Megatron-LM's
  ``CheckpointFunction.backward`` does), so one group's recomputed values are live at a
  time, and each dies at its last backward use.
- A value of group g that a backward node of *another* layer or of the outer region
  reads (the group's output, read by the next layer's or the final norm's backward) is
  saved: recomputing it there would rebuild the group early.
- Random ops in a recomputed segment replay the forward's RNG state: forward runs them
  under ``torch._prims.rng_prims.run_and_save_rng_state``, whose state is saved, and the
  recompute under ``run_with_rng_state``; the recomputed values equal the forward's bit
  for bit.

Everything outside the groups (stored layers, outer) follows ``none``: every forward
value backward reads is saved, as AOTAutograd's ``default_partition`` does.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Iterable

import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from .costs import RNG_STATE_BYTES, is_mutating, is_random, tensor_val
from .errors import UnsupportedGraph
from .regions import LayerStack
from .schedule import Schedule
from .trace import JointGraph


@dataclasses.dataclass(frozen=True)
class RecomputeSegment:
    """One group's recompute, as it runs in backward.

    Attributes:
        group: index into ``Schedule.groups``.
        layers: the group's layers.
        nodes: joint-graph names of the recomputed forward nodes, in run order.
        checkpoints: joint-graph names of the saved values the segment starts from.
        insert_before: the backward node the segment runs just before.
        rng_replayed: recomputed random ops that replay the forward's RNG state.
    """

    group: int
    layers: tuple[int, ...]
    nodes: tuple[str, ...]
    checkpoints: tuple[str, ...]
    insert_before: str
    rng_replayed: tuple[str, ...]


@dataclasses.dataclass
class RewrittenStep:
    """The forward and backward graphs of one rewritten training step.

    Calling convention (see ``measure.run_step``):
    ``forward(*primals) -> [*fwd_outputs, *saved]`` and
    ``backward(*saved, *[primals[i] for i in backward_primal_indices], *tangents)
    -> [one gradient per primal, None where none]``.

    Attributes:
        forward, backward: the GraphModules.
        schedule: the Schedule that was applied.
        num_fwd_outputs: forward outputs before the saved values (1: the loss).
        saved: names of the saved values (forward nodes, RNG states included), in the
            order forward returns them and backward takes them.
        backward_primal_indices: which primals backward reads (parameters, inputs).
        segments: the recompute segments, in the order they run.
        forced_saves: saved values inside a recomputed group, with the reason.
        layer_of: forward / backward graph node name -> layer (None: outer).
        kind_of: forward / backward graph node name -> "forward", "backward" or
            "recompute".
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    schedule: Schedule
    num_fwd_outputs: int
    saved: tuple[str, ...]
    backward_primal_indices: tuple[int, ...]
    segments: tuple[RecomputeSegment, ...]
    forced_saves: dict[str, str]
    layer_of: dict[str, int | None]
    kind_of: dict[str, str]


def _tensor_ancestors_in(
    start: Iterable[fx.Node], allowed: set[fx.Node], stop: set[fx.Node]
) -> set[fx.Node]:
    """Closure of ``start`` over inputs that are in ``allowed`` and not in ``stop``."""
    out: set[fx.Node] = set()
    todo = list(start)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        for a in n.all_input_nodes:
            if a in allowed and a not in stop and a not in out:
                todo.append(a)
    return out


def _check_rng_supported(node: fx.Node) -> None:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    devices = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
    if not devices <= {"cpu", "cuda"}:
        raise UnsupportedGraph(
            f"random op {node.format_node()} runs on {sorted(devices)}: its RNG state can "
            "be replayed only on cpu or cuda, so recomputing it would change gradients. "
            "Keep its layer out of the recomputed groups."
        )


def rewrite(joint: JointGraph, stack: LayerStack, schedule: Schedule) -> RewrittenStep:
    """Partition ``joint`` into forward and backward graphs that apply ``schedule``.

    Args:
        joint: the traced step (its graph is not modified).
        stack: the layer stack and the layer of every joint node (``assign_layers``).
        schedule: which layers are recomputed, in which groups.

    Returns:
        The RewrittenStep. Its gradients equal the joint graph's bit for bit (same ops on
        the same values; random ops replay their RNG state).

    Raises:
        InvalidSchedule: the schedule is for another number of layers.
        UnsupportedGraph: the joint graph mutates a value in place, or a random op in
            a recomputed group runs on a device whose RNG state cannot be replayed.
    """
    from .errors import InvalidSchedule

    if schedule.num_layers != stack.num_layers:
        raise InvalidSchedule(
            f"schedule {schedule.provenance} is for L={schedule.num_layers} layers but the "
            f"layer stack {stack.path!r} has L={stack.num_layers}"
        )
    graph = joint.gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if is_mutating(n):
            raise UnsupportedGraph(
                f"the joint graph mutates a value in place at {n.format_node()}; a saved "
                "or recomputed value could be stale. Remove the in-place update of a "
                "parameter, buffer or input from the training step."
            )
    fwd = {by_name[name] for name in stack.forward_nodes}
    primal_nodes = [by_name[p] for p in joint.primals]
    primal_set = set(primal_nodes)
    primal_index = {p: i for i, p in enumerate(primal_nodes)}
    tangent_nodes = [by_name[t] for t in joint.tangents]
    output = nodes[-1]
    fwd_computed = fwd - primal_set
    bwd_nodes = [n for n in nodes if n not in fwd and n.op == "call_function"]
    bwd_set = set(bwd_nodes)
    layer = stack.layer_of

    # Which forward values backward reads, and who reads them.
    bw_readers: dict[fx.Node, list[fx.Node]] = {}
    for b in bwd_nodes:
        for a in b.all_input_nodes:
            if a in fwd_computed:
                bw_readers.setdefault(a, []).append(b)

    # Per group: its forward nodes, values forced saved, recompute closure, checkpoints.
    group_nodes: list[set[fx.Node]] = []
    forced: dict[fx.Node, str] = {}
    for g in schedule.groups:
        members = {n for n in fwd_computed if layer[n.name] in g}
        group_nodes.append(members)
        for v in members:
            for b in bw_readers.get(v, ()):
                if layer[b.name] not in g:
                    forced[v] = (
                        "read by the backward of "
                        + (f"layer {layer[b.name]}" if layer[b.name] is not None else "the outer region")
                        + f" ({b.name}), outside the group"
                    )
                    break
    checkpoints: set[fx.Node] = set()
    recompute: list[set[fx.Node]] = [set() for _ in schedule.groups]
    for _ in range(len(nodes) + 1):
        stop = set(forced) | checkpoints
        new_ckpt: set[fx.Node] = set()
        for gi, members in enumerate(group_nodes):
            needed = [v for v in members if v in bw_readers and v not in stop]
            # a multi-output op stays with the getitems that read it
            allowed = members | {v for v in fwd_computed if tensor_val(v) is None}
            r = _tensor_ancestors_in(needed, allowed, stop)
            recompute[gi] = r
            for v in r:
                for a in v.all_input_nodes:
                    if a in fwd_computed and a not in r:
                        new_ckpt.add(a)
        if new_ckpt == checkpoints:
            break
        checkpoints = new_ckpt
    recomputed_any = set().union(*recompute) if recompute else set()
    saved_nodes = sorted(
        ({v for v in bw_readers if v not in recomputed_any} | checkpoints),
        key=order.__getitem__,
    )
    random_in_recompute = sorted((v for v in recomputed_any if is_random(v)), key=order.__getitem__)
    for v in random_in_recompute:
        _check_rng_supported(v)

    # Where each segment runs: before the first backward node reading its values.
    segments: list[tuple[int, int, list[fx.Node]]] = []
    for gi, r in enumerate(recompute):
        readers = [b for v in r for b in bw_readers.get(v, ())]
        if not readers:
            continue
        first = min(readers, key=order.__getitem__)
        segments.append((order[first], gi, sorted(r, key=order.__getitem__)))
    segments.sort()

    # ---- forward graph
    fgraph = fx.Graph()
    fenv: dict[fx.Node, fx.Node] = {}
    rng_state_of: dict[fx.Node, fx.Node] = {}
    layer_out: dict[str, int | None] = {}
    kind_out: dict[str, str] = {}
    for n in nodes:
        if n not in fwd:
            continue
        if n in recomputed_any and is_random(n):
            args = fx.node.map_arg(n.args, fenv.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, fenv.__getitem__)
            both = fgraph.create_node(
                "call_function", run_and_save_rng_state, (n.target, *args), kwargs,
                name=f"{n.name}_with_rng_state",
            )
            state = fgraph.create_node(
                "call_function", operator.getitem, (both, 0), name=f"{n.name}_rng_state"
            )
            value = fgraph.create_node("call_function", operator.getitem, (both, 1), name=n.name)
            device = next(iter(_devices(n)))
            state_val = torch.empty(
                RNG_STATE_BYTES.get(device, 16), dtype=torch.uint8, device="meta"
            )
            state.meta["val"] = state_val
            both.meta["val"] = (state_val, n.meta["val"])
            value.meta.update(n.meta)
            for extra in (both, state):
                layer_out[extra.name] = layer[n.name]
                kind_out[extra.name] = "forward"
            fenv[n] = value
            rng_state_of[n] = state
            new = value
        else:
            new = fgraph.node_copy(n, fenv.__getitem__)
            fenv[n] = new
        layer_out[new.name] = layer[n.name]
        kind_out[new.name] = "forward"
    fwd_outs = [fenv[a] if isinstance(a, fx.Node) else a for a in output.args[0][: joint.num_fwd_outputs]]
    rng_nodes = [rng_state_of[v] for v in random_in_recompute]
    fgraph.output([*fwd_outs, *(fenv[v] for v in saved_nodes), *rng_nodes])
    fgraph.lint()
    forward_gm = fx.GraphModule(joint.gm, fgraph, class_name="RematForward")

    # ---- backward graph
    bgraph = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for v in saved_nodes:
        ph = bgraph.placeholder(v.name)
        ph.meta.update(v.meta)
        benv[v] = ph
        layer_out[ph.name] = layer[v.name]
    state_ph: dict[fx.Node, fx.Node] = {}
    for v in random_in_recompute:
        src = rng_state_of[v]
        ph = bgraph.placeholder(src.name)
        ph.meta.update(src.meta)
        state_ph[v] = ph
        layer_out[ph.name] = layer[v.name]
    used_primals: set[fx.Node] = set()
    for b in bwd_nodes:
        used_primals.update(a for a in b.all_input_nodes if a in primal_set)
    for r in recompute:
        for v in r:
            used_primals.update(a for a in v.all_input_nodes if a in primal_set)
    bw_primals = [p for p in primal_nodes if p in used_primals]
    for p in bw_primals:
        ph = bgraph.placeholder(p.name)
        ph.meta.update(p.meta)
        benv[p] = ph
        layer_out[ph.name] = None
    for t in tangent_nodes:
        ph = bgraph.placeholder(t.name)
        ph.meta.update(t.meta)
        benv[t] = ph
        layer_out[ph.name] = None

    seg_records: list[RecomputeSegment] = []
    renv: dict[fx.Node, fx.Node] = {}
    pending = list(segments)
    for b in bwd_nodes:
        while pending and pending[0][0] == order[b]:
            _, gi, seg_nodes = pending.pop(0)
            local: dict[fx.Node, fx.Node] = {}

            def lookup(a: fx.Node) -> fx.Node:
                return local[a] if a in local else benv[a]

            for v in seg_nodes:
                args = fx.node.map_arg(v.args, lookup)
                kwargs = fx.node.map_arg(v.kwargs, lookup)
                if is_random(v):
                    target, args = run_with_rng_state, (state_ph[v], v.target, *args)
                else:
                    target = v.target
                new = bgraph.create_node(
                    v.op, target, args, kwargs, name=f"{v.name}_recompute"
                )
                new.meta.update(v.meta)
                local[v] = new
                layer_out[new.name] = layer[v.name]
                kind_out[new.name] = "recompute"
            renv.update(local)
            seg_records.append(
                RecomputeSegment(
                    group=gi,
                    layers=schedule.groups[gi],
                    nodes=tuple(v.name for v in seg_nodes),
                    checkpoints=tuple(
                        sorted(
                            {a.name for v in seg_nodes for a in v.all_input_nodes
                             if a in fwd_computed and a not in local},
                        )
                    ),
                    insert_before=b.name,
                    rng_replayed=tuple(v.name for v in seg_nodes if is_random(v)),
                )
            )

        def resolve(a: fx.Node) -> fx.Node:
            if a in benv:
                return benv[a]
            if a in renv:
                return renv[a]
            raise AssertionError(f"rewrite bug: {a.name} is neither saved nor recomputed before {b.name}")

        new = bgraph.node_copy(b, resolve)
        benv[b] = new
        layer_out[new.name] = layer[b.name]
        kind_out[new.name] = "backward"
    grads = output.args[0][joint.num_fwd_outputs :]
    bgraph.output([benv[g] if isinstance(g, fx.Node) else g for g in grads])
    bgraph.lint()
    backward_gm = fx.GraphModule(joint.gm, bgraph, class_name="RematBackward")

    saved_names = tuple(fenv[v].name for v in saved_nodes) + tuple(s.name for s in rng_nodes)
    return RewrittenStep(
        forward=forward_gm,
        backward=backward_gm,
        schedule=schedule,
        num_fwd_outputs=joint.num_fwd_outputs,
        saved=saved_names,
        backward_primal_indices=tuple(primal_index[p] for p in bw_primals),
        segments=tuple(seg_records),
        forced_saves={v.name: reason for v, reason in sorted(forced.items(), key=lambda kv: order[kv[0]])},
        layer_of=layer_out,
        kind_of=kind_out,
    )


def _devices(node: fx.Node) -> set[str]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return {v.device.type for v in vals if isinstance(v, torch.Tensor)} or {"cpu"}
