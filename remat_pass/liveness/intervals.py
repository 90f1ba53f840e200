"""Live intervals of a rewritten step: every storage (views counted once) and the steps
it is live at, plus op scratch, by the memory model that ``liveness`` states.

The intervals depend only on the graphs; sizes come from a ``size_of`` function, so
concrete bytes (``memory_intervals``, what ``liveness.analyze`` counts) and polynomials
(``symbolic``) share them. ``liveness.live_timeline`` is the one sweep over them.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph.costs import (
    collective_rule,
    held_scratch_bytes,
    run_alias_of,
    same_storage,
    tensor_val,
    wait_of,
)
from ..memory.memory_model import ALLOCATORS, MemoryModel, NodeMemory
from ..graph.op_signature import output_values
from ..recompute.rewrite import RewrittenStep


@dataclasses.dataclass
class Storage:
    """One storage of a rewritten step and the steps it is live at.

    Attributes:
        nbytes: what the ``size_of`` function of ``live_intervals`` returned (bytes: an
            int, or a symbolic size), or the op's scratch for kind ``"scratch"``.
        first, last: the steps it is live at, inclusive (``-1`` for static storages).
        name: the node that allocated it (forward or backward graph name).
        layer: that node's layer (None: outer).
        kind: "forward", "saved", "output", "recompute", "backward", "gradient",
            "static" (primals, tangents, graph constants) or "scratch" (memory an op
            allocates and frees inside itself, live during that op only).
        static: it exists before the step (not activation memory).
    """

    nbytes: Any
    first: int
    last: int
    name: str
    layer: int | None
    kind: str
    static: bool



def storage_bytes(val: torch.Tensor, allocator: str = "cpu") -> int:
    """Bytes ``allocator`` gives the FakeTensor storage of ``val``: exact on CPU, rounded
    up to a multiple of 512 on CUDA (``MemoryModel.allocator_bytes``).

    Raises:
        ValueError: unknown allocator, or a symbolic (non-integer) size; use the
            symbolic model for dynamic shapes.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r} is not one of {ALLOCATORS}")
    return MemoryModel(device=allocator, allocator=allocator).storage_bytes(val)


def collective_scratch_bytes(node: fx.Node, memory: MemoryModel) -> int:
    """Bytes a collective's backend holds from its call to its wait under ``memory``'s
    allocator (gloo on CPU, nccl on CUDA; ``costs.held_scratch_bytes``), as the
    allocator gives them (``MemoryModel.allocator_bytes``: one block on CUDA).

    Raises:
        ValueError: a symbolic (non-integer) size; use the symbolic model.
    """
    return memory.allocator_bytes(held_scratch_bytes(node, memory.allocator))


@dataclasses.dataclass
class Intervals:
    """The storages of a rewritten step and the steps they are live at.

    Attributes:
        storages: every storage (static ones with ``first == -1``), then one of kind
            ``"scratch"`` per step with modelled op scratch.
        fw_steps, bw_steps: the nodes run as steps, forward then backward; step ``i``
            is ``(fw_steps + bw_steps)[i]``.
        saved_sids: index into ``storages`` of each saved value (None: not a tensor).
        sid_of: forward / backward graph node -> the storage id(s) its value lives in
            (an int, a list for a tuple, None for a non-tensor), for callers that need
            every read of a storage rather than its last.
        output_sids: index into ``storages`` of each forward output (the loss first;
            None: not a tensor).
        gradient_sids: index into ``storages`` of each backward output (one per primal;
            None: no gradient or not a tensor).
    """

    storages: list[Storage]
    fw_steps: list[fx.Node]
    bw_steps: list[fx.Node]
    saved_sids: list[Any]
    sid_of: dict[fx.Node, Any] = dataclasses.field(default_factory=dict)
    output_sids: list[Any] = dataclasses.field(default_factory=list)
    gradient_sids: list[Any] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> list[fx.Node]:
        """Forward steps, then backward steps."""
        return self.fw_steps + self.bw_steps

    @property
    def num_steps(self) -> int:
        """Forward steps plus backward steps."""
        return len(self.fw_steps) + len(self.bw_steps)


def live_intervals(step: RewrittenStep, size_of: Callable[[torch.Tensor], Any],
                   scratch_of: Callable[[fx.Node], Any] | None = None,
                   held_scratch_of: Callable[[fx.Node], Any] | None = None,
                   hold_outputs: bool = True) -> Intervals:
    """Storages of ``step`` with their live intervals (the memory model of ``liveness``).

    Args:
        step: the rewritten step.
        size_of: ``size_of(fake tensor) -> bytes`` of its storage; the interval
            computation never looks at sizes, so they may be symbolic (polynomials).
        scratch_of: ``scratch_of(node) -> bytes`` an op allocates and frees inside
            itself (in the units of ``size_of``); None: no scratch.
        held_scratch_of: ``held_scratch_of(node) -> bytes`` a collective's backend
            holds from the collective's step to its ``wait_tensor``'s step
            (``collective_scratch_bytes``); None: none.
        hold_outputs: keep the forward outputs and the gradients live until the step
            ends (a step of one graph). False: each lives until its own last use in
            the graph, for a caller that decides how long the rest of the step holds
            it (``step_flow``, composing several graphs into one step).

    Returns:
        The Intervals. The steps and intervals depend only on the graphs, not on sizes.
    """
    builder = _IntervalBuilder(step, size_of, hold_outputs)
    saved_sids = builder.forward()
    builder.backward(saved_sids)
    steps = builder.fw_steps + builder.bw_steps
    builder.hold_collective_inputs()
    for i, n in enumerate(steps):
        extra = [(scratch_of(n) if scratch_of is not None else 0, i)]
        if held_scratch_of is not None:
            w = wait_of(n)
            extra.append((held_scratch_of(n), builder.step_of.get(w, i)))
        for scratch, last in extra:
            if scratch:
                builder.storages.append(
                    Storage(scratch, i, last, n.name, step.layer_of.get(n.name), "scratch", False))
    return Intervals(builder.storages, builder.fw_steps, builder.bw_steps, saved_sids, builder.sid_of,
                     builder.output_sids, builder.gradient_sids)


def memory_intervals(step: RewrittenStep, memory: MemoryModel,
                     hold_outputs: bool = True) -> tuple[Intervals, list[NodeMemory | None]]:
    """``live_intervals`` sized and with scratch by ``memory``: what ``liveness.analyze`` counts.

    Every new storage is ``memory.allocator_bytes`` of its size: the real output size
    where the memory model has one for the op that made it (``NodeMemory.
    output_storage_bytes``), else the FakeTensor storage size; each step's scratch is
    ``NodeMemory.scratch_bytes`` of its op; ``hold_outputs`` as ``live_intervals``.

    Returns:
        ``(intervals, node_memory)``: ``node_memory[i]`` describes step ``i``'s op
        (None where no op runs).

    Raises:
        ValueError: a symbolic (non-integer) size; use the symbolic model.
    """
    steps = [n for g in (step.forward, step.backward) for n in g.graph.nodes if n.op not in ("placeholder", "output")]
    per_step = [memory.node_memory(n) for n in steps]
    real: dict[int, int] = {}  # id(FakeTensor output) -> its real storage bytes
    for n, m in zip(steps, per_step):
        if m is not None and m.output_storage_bytes is not None:
            outs = [v for v in output_values(n) if v is not None]
            for v, nbytes in zip(outs, m.output_storage_bytes):
                real[id(v)] = nbytes
    by_node = {n: m for n, m in zip(steps, per_step)}

    def size_of(val: torch.Tensor) -> int:
        nbytes = real.get(id(val))
        return memory.storage_bytes(val) if nbytes is None else memory.allocator_bytes(nbytes)

    def scratch_of(node: fx.Node) -> int:
        m = by_node.get(node)
        return 0 if m is None else m.scratch_bytes

    def held_scratch_of(node: fx.Node) -> int:
        return collective_scratch_bytes(node, memory)

    return live_intervals(step, size_of, scratch_of, held_scratch_of, hold_outputs), per_step


class _IntervalBuilder:
    """One pass over the forward then the backward graph, creating storages and
    extending their intervals to each alias's last use (see ``live_intervals``)."""

    def __init__(self, step: RewrittenStep, size_of: Callable[[torch.Tensor], Any], hold_outputs: bool = True):
        self.step, self.size_of, self.hold_outputs = step, size_of, hold_outputs
        self.output_sids: list[Any] = []
        self.gradient_sids: list[Any] = []
        self.storages: list[Storage] = []
        self.fw_nodes = list(step.forward.graph.nodes)
        self.bw_nodes = list(step.backward.graph.nodes)
        self.fw_steps = [n for n in self.fw_nodes if n.op not in ("placeholder", "output")]
        self.bw_steps = [n for n in self.bw_nodes if n.op not in ("placeholder", "output")]
        self.step_of = {n: i for i, n in enumerate(self.fw_steps + self.bw_steps)}
        self.end = len(self.fw_steps) + len(self.bw_steps) - 1
        # storage ids per node: an int for a tensor, a list for a tuple, None otherwise
        self.sid_of: dict[fx.Node, Any] = {}
        self.primal_sid: dict[str, int] = {}
        self.constant_sid: dict[Any, int] = {}  # a graph constant's storage -> its one storage id

    def new_storage(self, val: torch.Tensor, node: fx.Node, static: bool, kind: str) -> int:
        first = -1 if static else self.step_of[node]
        self.storages.append(
            Storage(self.size_of(val), first, first, node.name, self.step.layer_of.get(node.name), kind, static))
        return len(self.storages) - 1

    def constant_storage(self, val: torch.Tensor, node: fx.Node) -> int:
        """The static storage of a get_attr constant: one per storage of the graph
        modules' attributes, however many nodes (in forward and backward) read it and
        whichever views of it they are (Megatron's ``GlobalMemoryBuffer``)."""
        attr: Any = node.graph.owning_module
        for part in str(node.target).split("."):
            attr = getattr(attr, part, None)
        key = attr.untyped_storage()._cdata if isinstance(attr, torch.Tensor) else ("node", node.name)
        if key not in self.constant_sid:
            self.constant_sid[key] = self.new_storage(val, node, True, "static")
        return self.constant_sid[key]

    def touch(self, sids: Any, at: int) -> None:
        """Extend the storage(s) ``sids`` (an id or a nested list of ids) to step ``at``."""
        if isinstance(sids, int):
            if self.storages[sids].last < at:
                self.storages[sids].last = at
        elif isinstance(sids, list):
            for e in sids:
                self.touch(e, at)

    def last_use(self, node: fx.Node, graph_end: int) -> int:
        uses = [self.step_of[u] for u in node.users if u.op != "output"]
        if any(u.op == "output" for u in node.users):
            uses.append(graph_end)
        return max(uses) if uses else self.step_of.get(node, -1)

    def hold_collective_inputs(self) -> None:
        """Extend the input of every all-gather / reduce-scatter to its wait's step
        (``costs.CollectiveRule.input_held_until_wait``)."""
        for n in self.fw_steps + self.bw_steps:
            rule = collective_rule(n)
            w = wait_of(n)
            if rule is not None and rule.input_held_until_wait and w in self.step_of:
                inp = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
                sid = self.sid_of.get(inp) if inp is not None else None
                if isinstance(sid, int) and not self.storages[sid].static:
                    self.touch(sid, self.step_of[w])

    def alias_of(self, val: torch.Tensor, node: fx.Node) -> int | None:
        """The storage id of an input of ``node`` that ``val`` is a view of, if any
        (or that ``node`` returns at run time, ``costs.run_alias_of``)."""
        source = run_alias_of(node)
        if source is not None and isinstance(self.sid_of.get(source), int):
            return self.sid_of[source]
        for a in node.all_input_nodes:
            s = self.sid_of.get(a)
            av = a.meta.get("val")
            if isinstance(s, int) and isinstance(av, torch.Tensor) and same_storage(val, av):
                return s
            if isinstance(s, list) and isinstance(av, (tuple, list)):
                for si, ev in zip(s, av):
                    if si is not None and isinstance(ev, torch.Tensor) and same_storage(val, ev):
                        return si
        return None

    def alloc(self, val: Any, node: fx.Node, kind: str) -> Any:
        if isinstance(val, torch.Tensor):
            s = self.alias_of(val, node)
            return self.new_storage(val, node, False, kind) if s is None else s
        if isinstance(val, (tuple, list)):
            return [self.alloc(e, node, kind) for e in val]
        return None

    def visit(self, node: fx.Node, graph_end: int, kind: str) -> None:
        parent = node.args[0] if node.args else None
        if node.op == "get_attr":  # a constant of the graph module: exists before the step
            val = tensor_val(node)
            self.sid_of[node] = None if val is None else self.constant_storage(val, node)
        elif node.target is operator.getitem and isinstance(self.sid_of.get(parent), list):
            self.sid_of[node] = self.sid_of[parent][node.args[1]]
        else:
            # a tuple result holds its elements until its last getitem
            self.sid_of[node] = self.alloc(node.meta.get("val"), node, kind)
        self.touch(self.sid_of[node], self.last_use(node, graph_end))

    def forward(self) -> list[Any]:
        """Visit the forward graph; return the storage id of each saved value."""
        for n in self.fw_nodes:
            if n.op == "placeholder":
                val = tensor_val(n)
                if val is not None:  # static; its last use is recorded all the same
                    self.sid_of[n] = self.primal_sid[n.name] = self.new_storage(val, n, True, "static")
                    self.touch(self.sid_of[n], self.last_use(n, len(self.fw_steps) - 1))
            elif n.op != "output":
                self.visit(n, len(self.fw_steps) - 1, "forward")
        outs = list(self.fw_nodes[-1].args[0])
        k = self.step.num_fwd_outputs
        for out in outs[:k]:  # the loss lives until the step ends
            sid = self.sid_of.get(out) if isinstance(out, fx.Node) else None
            self.output_sids.append(sid if isinstance(sid, int) else None)
            if isinstance(sid, int):
                if self.hold_outputs:
                    self.touch(sid, self.end)
                if not self.storages[sid].static:
                    self.storages[sid].kind = "output"
        saved_sids = [self.sid_of.get(out) for out in outs[k:]]
        for sid in saved_sids:
            if isinstance(sid, int) and not self.storages[sid].static:
                self.storages[sid].kind = "saved"
        return saved_sids

    def backward(self, saved_sids: list[Any]) -> None:
        """Visit the backward graph: its placeholders continue forward storages (saved
        values, primals) or are static (tangents); gradients live to the end."""
        placeholders = [n for n in self.bw_nodes if n.op == "placeholder"]
        for i, ph in enumerate(placeholders):
            if i < len(self.step.saved):
                self.sid_of[ph] = saved_sids[i]
            elif ph.name in self.primal_sid:
                self.sid_of[ph] = self.primal_sid[ph.name]
            elif tensor_val(ph) is not None:  # tangents
                self.sid_of[ph] = self.new_storage(tensor_val(ph), ph, True, "static")
            if isinstance(self.sid_of.get(ph), int):
                self.touch(self.sid_of[ph], self.last_use(ph, self.end))
        for n in self.bw_steps:
            self.visit(n, self.end, self.step.kind_of.get(n.name, "backward"))
        for g in self.bw_nodes[-1].args[0]:
            sid = self.sid_of.get(g) if isinstance(g, fx.Node) else None
            self.gradient_sids.append(sid if isinstance(sid, int) else None)
            if isinstance(sid, int):
                if self.hold_outputs:
                    self.touch(sid, self.end)
                if not self.storages[sid].static:
                    self.storages[sid].kind = "gradient"
