"""Identical layers analysed once: the exact liveness of an L-layer stack from a few
rewrites of a short template of the same model.

A transformer's layers are the same ops on the same shapes, so the rewritten step of an
L-layer stack is made of a few kinds of blocks: the forward, recompute and backward
steps of one layer, which depend only on the layer's *role* in the schedule (``S``
stored, ``G1`` a group of one, ``F`` / ``M`` / ``E`` first / middle / last of a larger
group; the top layer of a group has its backward split in two parts around the group's
recompute), and the outer steps (``pre``, ``head_fw``, ``head_bw``, ``post``). The
blocks come in the order the rewrite runs them (``rewrite.py``): ``pre``, the forward
of layers 0..L-1, ``head_fw``, ``head_bw``, then from layer L-1 down to 0 the layer's
backward, with its group's recompute (layers in order) inside the top layer's backward;
``post``.

A storage lives from the step that allocates it to the last step that reads it
(``liveness``). A storage of layer j is read by layer j's blocks, by its neighbours
j-1 and j+1, by the outer blocks (when j is the first or last layer), or at the end of
the step (gradients); where it is read depends only on the roles of j and of the
neighbour. An outer storage is read by the blocks of every layer, where depending on
that layer's role and on whether it is the first or the last. So one table, collected
from a few rewrites of a template of ``layer_roles.TEMPLATE_LAYERS`` layers whose
schedules together show every (role, neighbour's role) pair the L-layer schedule has,
gives every storage's interval in the L-layer step, and ``liveness.live_timeline`` (the
one sweep) gives the exact timeline and peak. Nothing of size L is traced or rewritten:
the Llama-2-70B stack (80 layers) costs the trace of 4 layers and a few rewrites of it.

Every assumption is checked, not trusted: the template's blocks of one role must have
the same ops and storages in every layer and schedule, every read must be of the layer
itself or a neighbour, the read table must be consistent across observations, each
template's own intervals must be reproduced exactly, and ``tests/liveness/test_layer_reuse.py``
compares the result with the full rewrite of L-layer traces for every Megatron
schedule. A model that breaks one (heterogeneous layers, outer ops between layer
blocks) raises ``UnsupportedGraph``; analyse it in full instead. Layers past the
template's are never seen here, so a stack whose layers differ only beyond
``TEMPLATE_LAYERS`` (Gemma 3's sliding / full pattern) must be caught by the caller:
``workload`` reuses layers only when ``configs.differing_layer`` finds them all alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.fx as fx

from solvers.poly import Poly

from ..recompute import schedule as schedules
from ..graph.costs import tensor_val
from ..errors import UnsupportedGraph
from .intervals import Intervals, Storage, storage_bytes
from .layer_roles import block_order, block_type, requirements, roles_of, template_role_strings
from .layer_template import BlockType, OpNames, Template
from .timeline import LiveTensor, MemoryReport, TimelineStep, bytes_by_layer, live_timeline
from ..graph.regions import LayerStack
from ..recompute.schedule import Schedule
from ..memory.static_memory import StaticTensor
from .symbolic import SymbolicModel, SymbolicStep
from .symbolic_sizes import SizeConverter
from ..graph.trace import JointGraph


@dataclasses.dataclass
class Layout:
    """The blocks of an L-layer rewritten step: run order, first step of each, steps.

    Attributes:
        roles: the role of every layer.
        order: the blocks in run order (zero-length ones left out).
        start: block -> index of its first step.
        steps: the template node each step runs (forward steps, then backward).
        num_forward_steps: how many of ``steps`` are forward steps.
        block_of_step: the block of every step.
    """

    roles: tuple[str, ...]
    order: list[Any]
    start: dict[Any, int]
    steps: list[fx.Node]
    num_forward_steps: int
    block_of_step: list[Any]


class ReusedLayers:
    """The liveness of a stack of ``num_layers`` identical layers, assembled from
    rewrites of a template of the same model with fewer layers (module docstring).

    Args:
        template: the traced step of the model with ``layer_roles.TEMPLATE_LAYERS`` (or more) layers.
        stack: its layer stack.
        num_layers: L, the layers of the model to analyse.
        allocator: ``"cpu"`` or ``"cuda"`` (as ``liveness.analyze``).
        op_names: for op-level plans, the template's node names the k-th trade-off
            point recomputes in a layer (``layer_template.OpNames``; roles ``S<k>``).

    Raises:
        UnsupportedGraph: the template has fewer than 3 layers, its layers differ, or its
            rewritten steps break an assumption of the module docstring.
    """

    def __init__(self, template: JointGraph, stack: LayerStack, num_layers: int, allocator: str = "cpu",
                 op_names: OpNames | None = None):
        if stack.num_layers < 3:
            raise UnsupportedGraph(f"a template needs 3 or more layers, this one has {stack.num_layers}")
        self.template, self.stack, self.num_layers, self.allocator = template, stack, num_layers, allocator
        self.op_names = op_names
        self.block_types: dict[Any, BlockType] = {}
        self.layer_reads: dict[tuple, dict[tuple, dict[Any, int]]] = {}
        self.outer_reads: dict[tuple, dict[tuple, dict[Any, int]]] = {}
        self.to_end: dict[tuple, bool] = {}
        self.covered: set[tuple] = set()
        self.templates: dict[tuple[str, ...], Template] = {}
        self._static: tuple[int, int, int] | None = None
        self._plans: dict[tuple, list[tuple]] = {}

    # ------------------------------------------------------------ tables

    def ensure(self, roles: Sequence[str]) -> None:
        """Rewrite template schedules until every pair and end role of ``roles`` was seen."""
        need = requirements(roles) - self.covered
        if need:
            for t_roles in template_role_strings(need, self.stack.num_layers):
                self.add_template(t_roles)

    def add_template(self, roles: Sequence[str]) -> Template:
        """Rewrite the template under the schedule of ``roles`` and add what it shows.

        Raises:
            UnsupportedGraph: it contradicts what earlier templates showed.
        """
        roles = tuple(roles)
        if roles in self.templates:
            return self.templates[roles]
        t = Template(self.template, self.stack, roles, self.allocator, self.op_names)
        owned = t.owned()
        for block in t.blocks:
            btype = block_type(block, roles)
            sids = owned.get(block, [])
            sig = t.block_type(block, sids)
            known = self.block_types.setdefault(btype, sig)
            if known is not sig and not known.matches(sig):
                raise UnsupportedGraph(f"two {btype} blocks of the template differ: the layers are not identical")
            for ordinal, sid in enumerate(sids):
                self._record(t, block, btype, ordinal, sid)
        self.templates[roles] = t
        self.covered |= requirements(roles)
        return t

    def _record(self, t: Template, block: Any, btype: Any, ordinal: int, sid: int) -> None:
        """Add the reads of one storage of ``t`` to the tables, by context.

        Raises:
            UnsupportedGraph: a layer reads a value of a layer that is not its neighbour
                (``Template.storage_reads``), or the reads, or whether it lives to the end,
                differ from an earlier template's.
        """
        table = self.outer_reads if isinstance(block, str) else self.layer_reads
        key = (btype, ordinal)
        seen = t.storage_reads(block, sid)
        entry = table.setdefault(key, {})
        for ctx, reads in seen.items():
            if entry.setdefault(ctx, reads) != reads:
                raise UnsupportedGraph(f"a storage of block {btype} is read differently in two templates "
                                       f"({ctx}: {entry[ctx]} vs {reads}): layer reuse does not apply")
        to_end = sid in t.to_end
        if self.to_end.setdefault(key, to_end) != to_end:
            raise UnsupportedGraph(f"a storage of block {btype} lives to the end in one template only")

    # ------------------------------------------------------------ assembly

    def layout(self, schedule: Schedule, options: Sequence[int] = ()) -> Layout:
        """The blocks of the L-layer rewritten step of ``schedule``, in run order; with
        op-level ``options`` (per layer, k > 0: the stored layer recomputes the k-th
        trade-off point, needs ``op_names``).

        Raises:
            ValueError: ``schedule`` is for another number of layers, or ``options`` are
                not one per layer of a stored layer (``layer_roles.roles_of``).
        """
        if schedule.num_layers != self.num_layers:
            raise ValueError(f"{schedule.provenance} is for L={schedule.num_layers}, not {self.num_layers}")
        roles = roles_of(schedule, options)
        self.ensure(roles)
        order, start, steps, block_of_step = [], {}, [], []
        nf = 0
        for b in block_order(roles):
            bt = self.block_types.get(block_type(b, roles))
            if bt is None or not bt.nodes:
                continue
            order.append(b)
            start[b] = len(steps)
            steps += bt.nodes
            block_of_step += [b] * len(bt.nodes)
            if bt.phase == "forward":
                nf = len(steps)
        return Layout(roles, order, start, steps, nf, block_of_step)

    def intervals(self, schedule: Schedule, options: Sequence[int] = ()) -> tuple[Intervals, Layout]:
        """The L-layer step's storages and their live intervals (as
        ``intervals.live_intervals`` would give for the full rewrite), and its layout
        (``options`` as ``layout``).

        Raises:
            UnsupportedGraph: a read the templates did not cover (a bug: ``ensure`` makes
                them cover every context of ``schedule``).
        """
        lay = self.layout(schedule, options)
        roles, start, L = lay.roles, lay.start, len(lay.roles)
        end, nf = len(lay.steps) - 1, lay.num_forward_steps
        storages: list[Storage] = []
        for b in lay.order:
            btype = block_type(b, roles)
            if isinstance(b, str):
                plan, j, resolve = self._outer_plan(btype, roles), None, None
            else:
                j = b[1]
                sig = (roles[j - 1] if j else None, roles[j + 1] if j < L - 1 else None, j == 0, j == L - 1)
                plan, resolve = self._layer_plan(btype, sig), j
            base = start[b]
            for off, nbytes, name, label, to_end, reads in plan:
                first = base + off
                if to_end:
                    last = end
                else:
                    last = first
                    for ref, read_off in reads:
                        pos = start.get(ref if resolve is None or isinstance(ref, str)
                                        else (ref[0], resolve + ref[1], ref[2]))
                        if pos is None:
                            raise UnsupportedGraph(f"{schedule.provenance}: a read of block {ref}, which this step "
                                                   "does not have")
                        if pos + read_off > last:
                            last = pos + read_off
                kind = label if label else ("saved" if last >= nf else "forward")
                storages.append(Storage(nbytes, first, last, name, j, kind, False))
        iv = Intervals(storages, lay.steps[:nf], lay.steps[nf:], [])
        return iv, lay

    def _layer_plan(self, btype: Any, sig: tuple) -> list[tuple]:
        """For each storage of a layer block of type ``btype`` whose neighbours have
        roles ``sig[:2]`` (None: no neighbour) and whose layer is first / last
        (``sig[2:]``): ``(offset, bytes, name, kind or None, lives to the end, reads)``,
        reads as ``((kind, layer delta, part) or outer block, offset)`` (cached)."""
        key = (btype, sig)
        if key not in self._plans:
            prev, nxt, first, last = sig
            bt = self.block_types[btype]
            plan = []
            for ordinal, (off, nbytes, is_scratch) in enumerate(bt.storages):
                entry = self.layer_reads[(btype, ordinal)]
                reads: list[tuple[Any, int]] = list(self._lookup(entry, ("outer", first, last), btype).items())
                reads += [((k, 0, p), o) for (k, p), o in entry[("self",)].items()]
                if prev is not None:
                    reads += [((k, -1, p), o) for (k, p), o in self._lookup(entry, ("prev", prev), btype).items()]
                if nxt is not None:
                    reads += [((k, 1, p), o) for (k, p), o in self._lookup(entry, ("next", nxt), btype).items()]
                to_end = self.to_end[(btype, ordinal)]
                plan.append((off, nbytes, bt.nodes[off].name, self._label(bt, btype, is_scratch, to_end, off), to_end,
                             tuple(reads)))
            self._plans[key] = plan
        return self._plans[key]

    def _outer_plan(self, name: str, roles: Sequence[str]) -> list[tuple]:
        """``_layer_plan`` for an outer block: reads resolved to every layer of ``roles``."""
        L = len(roles)
        bt = self.block_types[name]
        plan = []
        for ordinal, (off, nbytes, is_scratch) in enumerate(bt.storages):
            entry = self.outer_reads[(name, ordinal)]
            reads: list[tuple[Any, int]] = list(entry[("outer",)].items())
            per_layer: dict[tuple, dict[Any, int]] = {}
            for j in range(L):
                ctx = ("layer", roles[j], j == 0, j == L - 1)
                if ctx not in per_layer:
                    per_layer[ctx] = self._lookup(entry, ctx, name)
                reads += [((k, j, p), o) for (k, p), o in per_layer[ctx].items()]
            to_end = self.to_end[(name, ordinal)]
            plan.append((off, nbytes, bt.nodes[off].name, self._label(bt, name, is_scratch, to_end, off), to_end,
                         tuple(reads)))
        return plan

    @staticmethod
    def _lookup(entry: dict[tuple, dict[Any, int]], ctx: tuple, btype: Any) -> dict[Any, int]:
        if ctx not in entry:
            raise UnsupportedGraph(f"no template showed a storage of block {btype} in context {ctx}")
        return entry[ctx]

    @staticmethod
    def _label(bt: BlockType, btype: Any, is_scratch: bool, to_end: bool, off: int) -> str | None:
        """The kind of the storage step ``off`` of ``bt`` allocates, as ``liveness`` names
        it; None for a forward storage, which is "saved" when backward reads it and
        "forward" otherwise."""
        if is_scratch:
            return "scratch"
        if to_end:
            return "output" if bt.phase == "forward" else "gradient"
        if bt.phase == "forward":
            return None
        recomputed = not isinstance(btype, str) and btype[0] == "recompute" or bt.nodes[off] in bt.recomputed
        return "recompute" if recomputed else "backward"

    # ------------------------------------------------------------ results

    def report(self, schedule: Schedule, with_timeline: bool = False, options: Sequence[int] = (),
               provenance: str | None = None) -> MemoryReport:
        """The MemoryReport of ``schedule`` on the L-layer stack, equal to
        ``liveness.analyze`` of its full rewrite (``timeline`` is empty unless
        ``with_timeline``: 10^4 steps per report add up over a sweep); with op-level
        ``options`` (``layout``), of the op-level partition they make, named
        ``provenance``. Node names are the template's, with the L-layer layer index.
        """
        iv, lay = self.intervals(schedule, options)
        live = live_timeline(iv)
        nf = lay.num_forward_steps
        peak_step = max(range(len(live)), key=lambda i: (live[i], -i)) if live else 0
        peak_block = lay.block_of_step[peak_step]
        peak_layer = None if isinstance(peak_block, str) else peak_block[1]
        at_peak = sorted((LiveTensor(s.name, s.layer, s.nbytes, s.kind) for s in iv.storages
                          if s.kind != "scratch" and s.nbytes and s.first <= peak_step <= s.last),
                         key=lambda t: (-t.nbytes, t.name, -1 if t.layer is None else t.layer))
        saved = tuple(LiveTensor(s.name, s.layer, s.nbytes, "saved") for s in iv.storages if s.kind == "saved")
        timeline: tuple[TimelineStep, ...] = ()
        if with_timeline:
            timeline = tuple(
                TimelineStep("forward" if i < nf else "backward", n.name, _layer(b), v)
                for i, (n, b, v) in enumerate(zip(lay.steps, lay.block_of_step, live)))
        fw_flops = rc_flops = 0
        for b in lay.order:
            bt = self.block_types[block_type(b, lay.roles)]
            if bt.phase == "forward":
                fw_flops += bt.flops
            elif not isinstance(b, str) and b[0] == "recompute":
                rc_flops += bt.flops
            else:
                rc_flops += bt.recompute_flops
        return MemoryReport(
            schedule=provenance or schedule.provenance, allocator=self.allocator, peak_bytes=live[peak_step] if live else 0,
            peak_step=peak_step, peak_phase="forward" if peak_step < nf else "backward",
            peak_node=lay.steps[peak_step].name if live else "", peak_layer=peak_layer,
            live_at_peak=tuple(at_peak), live_at_peak_by_layer=bytes_by_layer(at_peak),
            saved_activation_bytes=sum(t.nbytes for t in saved), saved=saved,
            static_bytes=self.static_bytes(), timeline=timeline,
            forward_flops=fw_flops, recompute_flops=rc_flops)

    def profile(self, schedule: Schedule, options: Sequence[int] = ()) -> SymbolicStep:
        """``symbolic.profile_step`` of the L-layer step (constant polynomials), for the
        chain model of ``ReusedLayersModel`` (``options`` as ``layout``)."""
        iv, lay = self.intervals(schedule, options)
        live = live_timeline(iv)
        nf = lay.num_forward_steps
        saved: dict[int | None, Poly] = {}
        for s in iv.storages:
            if s.kind == "saved":
                saved[s.layer] = saved.get(s.layer, Poly()) + Poly.constant(int(s.nbytes), 0)
        fw: dict[int | None, Poly] = {}
        rc: dict[int | None, Poly] = {}
        for b in lay.order:
            bt = self.block_types[block_type(b, lay.roles)]
            is_rc = not isinstance(b, str) and b[0] == "recompute"
            target = fw if bt.phase == "forward" else rc if is_rc or bt.recompute_flops else None
            flops = bt.flops if bt.phase == "forward" or is_rc else bt.recompute_flops
            if target is not None and flops:
                target[_layer(b)] = target.get(_layer(b), Poly()) + Poly.constant(flops, 0)
        kinds = ["forward" if i < nf else ("recompute" if not isinstance(b, str) and b[0] == "recompute"
                                           else "backward") for i, b in enumerate(lay.block_of_step)]
        return SymbolicStep(
            gens=(), phases=["forward" if i < nf else "backward" for i in range(len(live))],
            nodes=[n.name for n in lay.steps], layers=[_layer(b) for b in lay.block_of_step], kinds=kinds,
            live=[Poly.constant(int(v), 0) for v in live], saved_by_layer=saved,
            recompute_flops_by_layer=rc, forward_flops_by_layer=fw)

    def static_bytes(self) -> int:
        """Static bytes of the L-layer step as ``liveness.analyze`` counts them (primals,
        tangents, graph constants), from the template: outer ones once, one layer's
        per layer."""
        if self._static is None:
            self._static = self._static_parts()
        outer, per_layer, constants = self._static
        return outer + per_layer * self.num_layers + constants

    def static_tensors(self) -> list[StaticTensor]:
        """The L-layer model's primals for ``static_memory`` (a layer's parameters once,
        with ``count`` L)."""
        j = self.template
        prefix = _layer_prefixes(self.stack)
        out = []
        for v, kind, label in zip(j.primal_values, j.primal_kinds, j.primal_labels):
            layer = _layer_of_label(label, prefix)
            if layer is None:
                out.append(StaticTensor(kind, int(v.numel()), v.dtype, int(v.untyped_storage().nbytes())))
            elif layer == 1:
                out.append(StaticTensor(kind, int(v.numel()), v.dtype, int(v.untyped_storage().nbytes()),
                                        count=self.num_layers))
        return out

    def _static_parts(self) -> tuple[int, int, int]:
        """(outer primal and tangent bytes, one layer's primal bytes, graph-constant
        bytes of the L-layer step of ``none``)."""
        t = self.add_template(("S",) * self.stack.num_layers)
        prefix = _layer_prefixes(self.stack)
        index = {name: i for i, name in enumerate(self.template.primals)}
        by_layer: dict[int | None, int] = {}
        for st in t.iv.storages:
            if st.static and st.name in index:
                layer = _layer_of_label(self.template.primal_labels[index[st.name]], prefix)
                by_layer[layer] = by_layer.get(layer, 0) + int(st.nbytes)
            elif st.static and st.name in self.template.tangents:
                by_layer[None] = by_layer.get(None, 0) + int(st.nbytes)
        layers = {by_layer.get(i, 0) for i in range(self.stack.num_layers)}
        if len(layers) != 1:
            raise UnsupportedGraph(f"the template's layers hold different parameter bytes {sorted(layers)}")
        constants = 0
        lay = self.layout(schedules.none(self.num_layers))
        for b in lay.order:
            for n in self.block_types[block_type(b, lay.roles)].nodes:
                if n.op == "get_attr" and tensor_val(n) is not None:
                    constants += storage_bytes(tensor_val(n), self.allocator)
        return by_layer.get(None, 0), layers.pop(), constants


def _layer(block: Any) -> int | None:
    return None if isinstance(block, str) else block[1]


def _layer_prefixes(stack: LayerStack) -> dict[str, int]:
    base = f"{stack.path}." if stack.path else ""
    return {f"{base}{c}.": i for i, c in enumerate(stack.child_names)}


def _layer_of_label(label: str, prefixes: dict[str, int]) -> int | None:
    for p, i in prefixes.items():
        if label.startswith(p):
            return i
    return None


@dataclasses.dataclass
class ReusedLayersModel(SymbolicModel):
    """The symbolic model of an L-layer stack analysed by ``ReusedLayers`` (concrete
    shapes), for the planner's chain calibration (``plan.chain_calibration``)."""

    reuse: ReusedLayers | None = None

    @classmethod
    def create(cls, reuse: ReusedLayers) -> "ReusedLayersModel":
        """The model of ``reuse``'s stack."""
        return cls(reuse.template, reuse.stack, {}, SizeConverter(reuse.template), reuse=reuse)

    @property
    def num_layers(self) -> int:
        """L of the analysed stack (not the template's)."""
        assert self.reuse is not None
        return self.reuse.num_layers

    @property
    def layers_per_stack(self) -> tuple[int, ...]:
        """The analysed stack's L (one stack)."""
        return (self.reuse.num_layers,)

    def profile(self, schedule: Schedule) -> SymbolicStep:
        """The L-layer step's profile (cached)."""
        assert self.reuse is not None
        if schedule not in self._profiles:
            self._profiles[schedule] = self.reuse.profile(schedule)
        return self._profiles[schedule]
