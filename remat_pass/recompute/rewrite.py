"""Build the forward and backward graphs of a training step from a Partition.

Forward runs every forward node of the joint graph and returns the loss, then the saved
values, then one RNG state per replayed random op. Backward takes the saved values, the
RNG states, the primals it reads and the tangents; it runs the joint graph's backward
nodes in order, with each recompute segment inserted right before the node the
Partition names. Random ops in a segment replay the forward's RNG state: forward runs
them under ``torch._prims.rng_prims.run_and_save_rng_state`` and the recompute under
``run_with_rng_state``, so recomputed values equal the forward's bit for bit.

The Partition is checked against the graph first: a rewrite that would change
gradients (a value backward reads that is neither saved nor recomputed before it, an
in-place update, a recomputed random op not listed for RNG replay, a random op whose
state cannot be replayed) is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
# generates the Python code of a graph on its first call, not when built: a planner builds
# and profiles dozens of candidate steps and runs one (Inductor's pattern passes use it so)
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..graph.costs import RNG_STATE_BYTES, is_mutating, is_random
from ..errors import InvalidSchedule, UnsupportedGraph
from ..graph.op_signature import REAL_LAYOUT, RealLayout
from .partition import Partition, Segment, partition
from .reinplace import reinplace
from ..graph.regions import LayerStack
from .schedule import Schedule
from ..graph.trace import JointGraph, RealLayouts


@dataclasses.dataclass
class RewrittenStep:
    """The forward and backward graphs of one rewritten training step.

    Calling convention (see ``measure.run_step``):
    ``forward(*primals) -> [*fwd_outputs, *saved]`` and
    ``backward(*saved, *[primals[i] for i in backward_primal_indices], *tangents)
    -> [one gradient per primal, None where none]``.

    Attributes:
        forward, backward: the GraphModules.
        partition: the Partition that was applied.
        num_fwd_outputs: forward outputs before the saved values (1: the loss).
        saved: names of the saved values (forward nodes, RNG states included), in the
            order forward returns them and backward takes them.
        backward_primal_indices: which primals backward reads (parameters, inputs).
        layer_of: forward / backward graph node name -> layer (None: outer).
        kind_of: forward / backward graph node name -> "forward", "backward" or
            "recompute".
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    partition: Partition
    num_fwd_outputs: int
    saved: tuple[str, ...]
    backward_primal_indices: tuple[int, ...]
    layer_of: dict[str, int | None]
    kind_of: dict[str, str]

    @property
    def schedule(self) -> Schedule | None:
        """The layer-level Schedule the partition came from (None: op-level)."""
        return self.partition.schedule

    @property
    def provenance(self) -> str:
        """The schedule's readable name (``uniform(K=4)``)."""
        return self.partition.provenance

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The recompute segments, in the order they run."""
        return self.partition.segments

    @property
    def forced_saves(self) -> dict[str, str]:
        """Saved values of recomputed groups that another layer's backward reads."""
        return self.partition.forced_saves


def _devices(node: fx.Node) -> set[str]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return {v.device.type for v in vals if isinstance(v, torch.Tensor)}


def _check(joint: JointGraph, stack: LayerStack, p: Partition) -> None:
    """Refuse a Partition that would change gradients (see the module docstring)."""
    nodes = list(joint.gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    order = {n: i for i, n in enumerate(nodes)}
    forward = {by_name[n] for n in stack.forward_nodes}
    primals = {by_name[n] for n in joint.primals}
    for n in nodes:
        if is_mutating(n):
            raise UnsupportedGraph(
                f"the joint graph mutates a value in place at {n.format_node()}; a saved "
                "or recomputed value could be stale. Remove the in-place update of a "
                "parameter, buffer or input from the training step."
            )
    saved = set()
    for s in p.saved:
        node = by_name.get(s.name)
        if node is None or node not in forward or node in primals:
            raise InvalidSchedule(f"{p.provenance}: saved value {s.name!r} is not a forward node of the joint graph")
        saved.add(node)
    available_at: dict[fx.Node, int] = {}  # recomputed node -> graph position of its segment
    for seg in p.segments:
        before = by_name.get(seg.insert_before)
        if before is None or before in forward:
            raise InvalidSchedule(f"{p.provenance}: segment of group {seg.group} runs before "
                                  f"{seg.insert_before!r}, which is not a backward node")
        local: set[fx.Node] = set()
        for name in seg.nodes:
            node = by_name.get(name)
            if node is None or node not in forward or node in primals:
                raise InvalidSchedule(f"{p.provenance}: recomputed {name!r} is not a forward node")
            for a in node.all_input_nodes:
                if not (a in primals or a.op == "get_attr" or a in saved or a in local
                        or (a in available_at and available_at[a] <= order[before])):
                    raise InvalidSchedule(
                        f"{p.provenance}: recomputing {node.format_node()} reads {a.name}, which is "
                        "neither a primal, saved, nor recomputed earlier in its segment")
            if is_random(node) and name not in seg.rng_replayed:
                raise InvalidSchedule(
                    f"{p.provenance}: the segment before {seg.insert_before} recomputes the random op "
                    f"{node.format_node()} without replaying its RNG state: it would draw new random "
                    "numbers and change gradients. List it in Segment.rng_replayed (the rewrite then "
                    "replays the forward's state) or save its outputs instead of recomputing them."
                )
            if is_random(node) and not _devices(node) <= {"cpu", "cuda"}:
                raise UnsupportedGraph(
                    f"random op {node.format_node()} runs on {sorted(_devices(node))}: its RNG "
                    "state can be replayed only on cpu or cuda, so recomputing it would change "
                    "gradients. Keep its layer out of the recomputed groups."
                )
            local.add(node)
        for node in local:
            available_at.setdefault(node, order[before])
    for b in nodes:
        if b in forward or b.op != "call_function":
            continue
        for a in b.all_input_nodes:
            if a in forward and a not in primals and a.op != "get_attr" and a not in saved and not (
                    a in available_at and available_at[a] <= order[b]):
                raise InvalidSchedule(
                    f"{p.provenance}: backward node {b.format_node()} reads {a.name}, which is "
                    "neither saved nor recomputed before it: the rewrite would change gradients")


def rewrite(joint: JointGraph, stack: LayerStack, decision: Partition | Schedule,
            layouts: Mapping[str, RealLayout] = RealLayouts(), in_place: bool = True) -> RewrittenStep:
    """Build the forward and backward graphs that apply ``decision``.

    Args:
        joint: the traced step (its graph is not modified).
        stack: the layer stack: the forward nodes and the layer of every joint node
            (``assign_layers``).
        decision: a Partition, or a Schedule (partitioned with ``partition.partition``).
        layouts: the real layouts a run of the step showed (``trace.RealLayouts``,
            from ``measure.run.reference_run``); each is put on every node holding
            that joint node's value (``node.meta[op_signature.REAL_LAYOUT]``), where
            op signatures, the memory model and calibration read it. Default: none
            (the traced layouts). The result depends on the arguments alone.
        in_place: restore in-place reuse where the functional trace removed it and it
            is safe (``reinplace.reinplace``: a value nobody reads later is written
            over, as eager code does). False: every op allocates, as traced (a graph
            handed to another compiler, which reinplaces by its own rules).

    Returns:
        The RewrittenStep. Its gradients equal the joint graph's bit for bit (same ops on
        the same values; random ops replay their RNG state).

    Raises:
        InvalidSchedule: a Schedule for another number of layers, a Partition that
            leaves a value backward reads neither saved nor recomputed before it, or one
            that recomputes a random op without replaying its RNG state.
        UnsupportedGraph: the joint graph mutates a value in place, or a random op in
            a segment runs on a device whose RNG state cannot be replayed.
    """
    p = decision if isinstance(decision, Partition) else partition(joint, stack, decision)
    _check(joint, stack, p)
    step = _Builder(joint, stack, p, layouts).build()
    if in_place:
        reinplace(step)
    return step


def _bare_node(graph: fx.Graph, op: str, target: Any, args: tuple, kwargs: dict, name: str,
               type_expr: Any = None) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name)`` for arguments taken from an
    already built graph: created without arguments, then given them, which skips
    torch 2.13's ``Graph.create_node`` scan of every argument leaf for raw SymInts (a
    pytree walk that was half of a rewrite's time; these arguments passed it when the
    traced graph was built). The node is the same: arguments, users and name."""
    node = graph.create_node(op, target, (), {}, name, type_expr)
    node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def _copy_node(graph: fx.Graph, node: fx.Node, transform: Any) -> fx.Node:
    """``graph.node_copy(node, transform)`` through ``_bare_node``: the same node, meta
    copied (shallow, as ``node_copy`` does)."""
    args = fx.node.map_arg(node.args, transform)
    kwargs = fx.node.map_arg(node.kwargs, transform)
    new = _bare_node(graph, node.op, node.target, args, kwargs, node.name, node.type)
    new.meta = copy.copy(node.meta)
    return new


class _Builder:
    """Copies the joint graph's nodes into the forward and backward graphs."""

    def __init__(self, joint: JointGraph, stack: LayerStack, p: Partition, layouts: Mapping[str, RealLayout]):
        # a plain dict: Mapping.get on RealLayouts raises and catches a KeyError per miss
        self.joint, self.p, self.layouts = joint, p, dict(layouts)
        self.nodes = list(joint.gm.graph.nodes)
        self.by_name = {n.name: n for n in self.nodes}
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.forward = {self.by_name[n] for n in stack.forward_nodes}
        self.layer = stack.layer_of
        self.saved_nodes = [self.by_name[n] for n in p.saved_names]
        self.random = sorted((self.by_name[n] for seg in p.segments for n in seg.rng_replayed),
                             key=self.order.__getitem__)
        self.layer_out: dict[str, int | None] = {}
        self.kind_out: dict[str, str] = {}

    def _real_layout(self, new: fx.Node, source: fx.Node) -> None:
        """Put the real layout the step's run recorded for joint node ``source`` (if it
        differs from the traced one) on ``new``, the node holding the same value."""
        layout = self.layouts.get(source.name)
        if layout is not None:
            new.meta[REAL_LAYOUT] = layout

    def _label(self, new: fx.Node, source: fx.Node, kind: str | None) -> None:
        self.layer_out[new.name] = self.layer[source.name]
        if kind is not None:
            self.kind_out[new.name] = kind

    def build_forward(self) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        rng_state_of: dict[fx.Node, fx.Node] = {}
        replayed = set(self.random)
        for n in self.nodes:
            if n not in self.forward:
                continue
            if n in replayed:
                value, state = self._forward_with_rng_state(graph, n, env)
                rng_state_of[n] = state
            else:
                value = _copy_node(graph, n, env.__getitem__)
            self._real_layout(value, n)
            env[n] = value
            self._label(value, n, "forward")
        output = self.nodes[-1]
        k = self.joint.num_fwd_outputs
        fwd_outs = [env[a] if isinstance(a, fx.Node) else a for a in output.args[0][:k]]
        graph.output([*fwd_outs, *(env[v] for v in self.saved_nodes), *(rng_state_of[v] for v in self.random)])
        graph.lint()
        return _LazyGraphModule(self.joint.gm, graph, class_name="RematForward"), env, rng_state_of

    def _forward_with_rng_state(self, graph: fx.Graph, n: fx.Node, env: dict) -> tuple[fx.Node, fx.Node]:
        args = fx.node.map_arg(n.args, env.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
        both = graph.create_node("call_function", run_and_save_rng_state, (n.target, *args), kwargs,
                                 name=f"{n.name}_with_rng_state")
        state = graph.create_node("call_function", operator.getitem, (both, 0), name=f"{n.name}_rng_state")
        value = graph.create_node("call_function", operator.getitem, (both, 1), name=n.name)
        device = next(iter(_devices(n) or {"cpu"}))
        state_val = torch.empty(RNG_STATE_BYTES.get(device, 16), dtype=torch.uint8, device="meta")
        state.meta["val"] = state_val
        both.meta["val"] = (state_val, n.meta["val"])
        value.meta.update(n.meta)
        for extra in (both, state):
            self._label(extra, n, "forward")
        return value, state

    def build(self) -> RewrittenStep:
        forward_gm, fenv, rng_state_of = self.build_forward()
        backward_gm, bw_primals = self.build_backward(rng_state_of)
        primal_index = {name: i for i, name in enumerate(self.joint.primals)}
        saved_names = tuple(fenv[v].name for v in self.saved_nodes) + tuple(
            rng_state_of[v].name for v in self.random)
        return RewrittenStep(
            forward=forward_gm,
            backward=backward_gm,
            partition=self.p,
            num_fwd_outputs=self.joint.num_fwd_outputs,
            saved=saved_names,
            backward_primal_indices=tuple(primal_index[p.name] for p in bw_primals),
            layer_of=self.layer_out,
            kind_of=self.kind_out,
        )

    def build_backward(self, rng_state_of: dict[fx.Node, fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for v in self.saved_nodes:
            env[v] = self._placeholder(graph, v, v)
        state_placeholder = {v: self._placeholder(graph, rng_state_of[v], v) for v in self.random}
        primals = [self.by_name[p] for p in self.joint.primals]
        primal_set = set(primals)
        backward_nodes = [n for n in self.nodes if n not in self.forward and n.op == "call_function"]
        recomputed = [self.by_name[n] for n in self.p.recomputed_names]
        used = {a for n in backward_nodes + recomputed for a in n.all_input_nodes if a in primal_set}
        bw_primals = [p for p in primals if p in used]
        for p in bw_primals:
            env[p] = self._placeholder(graph, p, None)
        for t in self.joint.tangents:
            env[self.by_name[t]] = self._placeholder(graph, self.by_name[t], None)
        segments_before: dict[str, list[Segment]] = {}
        for seg in self.p.segments:
            segments_before.setdefault(seg.insert_before, []).append(seg)
        recomputed_env: dict[fx.Node, fx.Node] = {}
        for b in backward_nodes:
            for seg in segments_before.get(b.name, ()):
                self._recompute(graph, seg, env, recomputed_env, state_placeholder)

            new = _copy_node(graph, b, lambda a: self._lookup(graph, a, env, recomputed_env))
            self._real_layout(new, b)
            env[b] = new
            self._label(new, b, "backward")
        grads = self.nodes[-1].args[0][self.joint.num_fwd_outputs:]
        graph.output([env[g] if isinstance(g, fx.Node) else g for g in grads])
        graph.lint()
        return _LazyGraphModule(self.joint.gm, graph, class_name="RematBackward"), bw_primals

    def _lookup(self, graph: fx.Graph, a: fx.Node, env: dict, recomputed_env: dict) -> fx.Node:
        """The backward graph's node for joint node ``a``: saved, primal, tangent or
        earlier backward node, recomputed, or a graph constant (copied on first use)."""
        if a in env:
            return env[a]
        if a in recomputed_env:
            return recomputed_env[a]
        if a.op == "get_attr":
            env[a] = graph.node_copy(a)
            self._label(env[a], a, None)
            return env[a]
        raise KeyError(a.name)  # _check guarantees every other input is available

    def _placeholder(self, graph: fx.Graph, source: fx.Node, layer_source: fx.Node | None) -> fx.Node:
        ph = graph.placeholder(source.name)
        ph.meta.update(source.meta)
        self._real_layout(ph, source)
        self.layer_out[ph.name] = None if layer_source is None else self.layer[layer_source.name]
        return ph

    def _recompute(self, graph: fx.Graph, seg: Segment, env: dict, recomputed_env: dict,
                   state_placeholder: dict[fx.Node, fx.Node]) -> None:
        local: dict[fx.Node, fx.Node] = {}

        def lookup(a: fx.Node) -> Any:
            return local[a] if a in local else self._lookup(graph, a, env, recomputed_env)

        for name in seg.nodes:
            v = self.by_name[name]
            args = fx.node.map_arg(v.args, lookup)
            kwargs = fx.node.map_arg(v.kwargs, lookup)
            target = v.target
            if v in state_placeholder:
                target, args = run_with_rng_state, (state_placeholder[v], v.target, *args)
            new = _bare_node(graph, v.op, target, args, kwargs, f"{v.name}_recompute")
            new.meta.update(v.meta)
            self._real_layout(new, v)
            local[v] = new
            self._label(new, v, "recompute")
        recomputed_env.update(local)
