"""One rewrite of a layer-reuse template, cut into blocks: the kind of each block it
runs and, for each storage, which steps read it, seen from the layer that allocated it
(the layer itself, a neighbour, an outer block), checked against the template's own
live intervals (``layer_reuse`` merges what several templates show).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch.fx as fx

from ..graph.costs import node_flops
from ..graph.layer_alike import alike, block_evidence
from ..errors import UnsupportedGraph
from .intervals import memory_intervals
from .layer_roles import block_order, op_option, schedule_of_roles
from ..memory.memory_model import MemoryModel
from ..graph.regions import LayerStack
from ..recompute.partition import OpLevelChoice, op_level_partition
from ..recompute.rewrite import rewrite
from ..graph.trace import JointGraph


@dataclasses.dataclass
class BlockType:
    """One kind of block: its steps (template nodes), FLOPs, its recomputed nodes
    (``recomputed``, their FLOPs ``recompute_flops``: a recompute block's, or the
    just-in-time recomputes in an ``S<k>`` layer's backward), and the storages it
    allocates, as ``(offset, bytes, is scratch)`` in a fixed order."""

    phase: str
    nodes: list[fx.Node]
    flops: int
    storages: list[tuple[int, Any, bool]]
    recompute_flops: int = 0
    recomputed: tuple[fx.Node, ...] = ()

    def matches(self, other: "BlockType") -> bool:
        """Whether ``other`` runs the same ops and allocates the same storages: the one
        rule of ``graph.layer_alike`` on ``layer_alike.block_evidence``."""
        return alike(block_evidence(self.nodes, self.storages), block_evidence(other.nodes, other.storages))


OpNames = Callable[[int, int], frozenset[str]]
"""``op_names(layer, k)``: the template's node names the k-th trade-off point recomputes
in that layer (an ``S<k>`` role)."""


class Template:
    """One rewrite of the template, cut into blocks, with every storage's reads.

    Raises:
        UnsupportedGraph: an op-level role without ``op_names``, or the rewrite breaks an
            assumption of ``layer_reuse`` (blocks out of order or in pieces).
    """

    def __init__(self, joint: JointGraph, stack: LayerStack, roles: tuple[str, ...], allocator: str,
                 op_names: OpNames | None = None):
        self.roles = roles
        schedule = schedule_of_roles(roles)
        ops = {j: op_option(r) for j, r in enumerate(roles) if op_option(r)}
        if ops and op_names is None:
            raise UnsupportedGraph(f"roles {roles} have op-level options but no op_names to build them")
        if ops:
            names = frozenset().union(*(op_names(j, k) for j, k in ops.items()))
            self.step = rewrite(joint, stack, op_level_partition(joint, stack, OpLevelChoice("op_optimal", names),
                                                                 schedule if schedule.groups else None))
        else:
            self.step = rewrite(joint, stack, schedule)
        # the formula table of op scratch, as ``analyze`` counts a step without weights
        self.iv = memory_intervals(self.step, MemoryModel.table_only(allocator))[0]
        self.nf = len(self.iv.fw_steps)
        self.block_of_step: list[Any] = []
        self.offset_of_step: list[int] = []
        self.blocks: dict[Any, list[int]] = {}
        self._cut()
        self.reads, self.to_end = self._reads()

    def step_phase(self, i: int) -> str:
        """``"forward"`` or ``"backward"``: the graph step ``i`` belongs to."""
        return "forward" if i < self.nf else "backward"

    def _cut(self) -> None:
        """The block of every step (``block_order``'s names), checked against that order."""
        step, steps = self.step, self.iv.steps
        seen_layer = {"forward": False, "backward": False}
        recomputed: set[int] = set()
        current: Any = None
        for i, n in enumerate(steps):
            phase = "forward" if i < self.nf else "backward"
            layer = step.layer_of.get(n.name)
            if layer is None:
                block: Any = {("forward", False): "pre", ("forward", True): "head_fw",
                              ("backward", False): "head_bw", ("backward", True): "post"}[(phase, seen_layer[phase])]
            else:
                seen_layer[phase] = True
                kind = step.kind_of.get(n.name, "forward")
                if kind == "recompute" and op_option(self.roles[layer]):
                    kind = "backward"  # just in time, inside the S<k> layer's own backward
                if kind == "recompute":
                    recomputed.add(layer)
                block = (kind, layer, 1 if kind == "backward" and layer in recomputed else 0)
            if block != current and block in self.blocks:
                raise UnsupportedGraph(f"the rewritten template runs block {block} in two pieces (outer ops "
                                       "between layer blocks?): layer reuse does not apply to this model")
            current = block
            self.blocks.setdefault(block, []).append(i)
            self.block_of_step.append(block)
            self.offset_of_step.append(len(self.blocks[block]) - 1)
        actual = list(self.blocks)
        expected = [b for b in block_order(self.roles) if b in self.blocks]
        if actual != expected or any(b not in self.blocks for b in block_order(self.roles)
                                     if isinstance(b, tuple) and b[0] == "forward"):
            raise UnsupportedGraph(f"the rewritten template runs its blocks as {actual}, not in the order "
                                   f"{expected}: layer reuse does not apply to this model")

    def _reads(self) -> tuple[dict[int, set[int]], set[int]]:
        """The steps that read each non-static storage, and the storages live to the end
        of the step (the loss, the gradients); checked against ``live_intervals``."""
        iv = self.iv
        reads: dict[int, set[int]] = {}

        def sids(x: Any) -> Iterable[int]:
            if isinstance(x, int):
                yield x
            elif isinstance(x, list):
                for e in x:
                    yield from sids(e)

        for i, n in enumerate(iv.steps):
            for a in n.all_input_nodes:
                for s in sids(iv.sid_of.get(a)):
                    reads.setdefault(s, set()).add(i)
        to_end = {sid for sid, st in enumerate(iv.storages) if st.kind in ("gradient", "output")}
        end = len(iv.steps) - 1
        saved = set(sids(iv.saved_sids))
        for sid, st in enumerate(iv.storages):
            if st.static:
                continue
            read = reads.get(sid, set())
            if sid in saved and not any(r >= self.nf for r in read):
                raise UnsupportedGraph(f"{st.name} is saved for backward but backward never reads it: "
                                       "layer reuse cannot follow it")
            # forward returns the saved values at its last step; backward reads them later
            last = end if sid in to_end else max(read | {st.first} | ({self.nf - 1} if sid in saved else set()))
            if last != st.last:
                raise UnsupportedGraph(f"storage of {st.name} is live to step {st.last} but read last at {last}: "
                                       "layer reuse cannot follow it")
        return reads, to_end

    def owned(self) -> dict[Any, list[int]]:
        """The non-static storages each block allocates, in a fixed order."""
        owned: dict[Any, list[int]] = {}
        for sid, st in enumerate(self.iv.storages):
            if not st.static:
                owned.setdefault(self.block_of_step[st.first], []).append(sid)
        for sids in owned.values():
            sids.sort(key=lambda s: (self.iv.storages[s].first, self.iv.storages[s].kind == "scratch", s))
        return owned

    def block_type(self, block: Any, sids: list[int]) -> BlockType:
        """The BlockType of ``block``, which allocates the storages ``sids`` (``owned``)."""
        idx, iv = self.blocks[block], self.iv
        recomputed = tuple(iv.steps[i] for i in idx if self.step.kind_of.get(iv.steps[i].name) == "recompute")
        return BlockType(self.step_phase(idx[0]), [iv.steps[i] for i in idx],
                         sum(int(node_flops(iv.steps[i])) for i in idx),
                         [(self.offset_of_step[iv.storages[s].first], iv.storages[s].nbytes,
                           iv.storages[s].kind == "scratch") for s in sids],
                         sum(int(node_flops(n)) for n in recomputed), recomputed)

    def storage_reads(self, block: Any, sid: int) -> dict[tuple, dict[Any, int]]:
        """The reads of storage ``sid``, allocated by ``block``, by context: for each
        context a block of that storage's layer can be in, the last step offset read in
        each block (outer blocks by name, a layer's as ``(kind, part)``).

        Contexts: of a layer's storage ``("self",)``, ``("outer", is first, is last)``,
        ``("prev", role)`` and ``("next", role)`` (the neighbours'); of an outer
        storage ``("outer",)`` and ``("layer", role, is first, is last)``.

        Raises:
            UnsupportedGraph: a layer's value is read by a layer other than a neighbour.
        """
        L = len(self.roles)
        seen: dict[tuple, dict[Any, int]] = {}
        if isinstance(block, str):
            seen[("outer",)] = {}
            for b in range(L):
                seen[("layer", self.roles[b], b == 0, b == L - 1)] = {}
        else:
            b = block[1]
            seen[("self",)] = {}
            seen[("outer", b == 0, b == L - 1)] = {}
            if b > 0:
                seen[("prev", self.roles[b - 1])] = {}
            if b < L - 1:
                seen[("next", self.roles[b + 1])] = {}
        for r in self.reads.get(sid, ()):
            rb, off = self.block_of_step[r], self.offset_of_step[r]
            if isinstance(rb, str):
                ctx: tuple = ("outer",) if isinstance(block, str) else ("outer", block[1] == 0, block[1] == L - 1)
                ref: Any = rb
            elif isinstance(block, str):
                ctx, ref = ("layer", self.roles[rb[1]], rb[1] == 0, rb[1] == L - 1), (rb[0], rb[2])
            else:
                delta = rb[1] - block[1]
                if abs(delta) > 1:
                    raise UnsupportedGraph(f"a value of layer {block[1]} is read by layer {rb[1]}: layer reuse "
                                           "needs each layer to read only its neighbours")
                ctx = ("self",) if delta == 0 else ("prev" if delta < 0 else "next", self.roles[rb[1]])
                ref = (rb[0], rb[2])
            reads = seen[ctx]
            reads[ref] = max(reads.get(ref, -1), off)
        return seen
