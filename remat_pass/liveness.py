"""Liveness analysis of a rewritten step: live bytes at every step, the peak, what is live.

Memory model (DESIGN.md, Memory accounting):

- Steps are the call_function nodes of the forward graph, then of the backward graph,
  executed in graph order by an executor that drops each value after its last use
  (``measure.run_graph``).
- Sizes are the bytes of each value's untyped storage (FakeTensor ``meta["val"]``).
  Views and other aliases (same fake storage as an input) share their base's storage
  and are counted once.
- A storage is live from the step that allocates it to the last use of any alias of it,
  inclusive: during an op its inputs and outputs coexist. A multi-output op's results
  stay live while the tuple is (until its last ``getitem``). Saved values stay live from
  forward into backward until their last backward use; the loss and the gradients stay
  live until the step ends.
- Static memory (primals: parameters, buffers, batch; tangents) exists before the step
  and is reported apart from activation memory. The peak is activation bytes.
- Allocator: ``"cpu"`` counts exact bytes; ``"cuda"`` rounds every block up to a
  multiple of 512 bytes as the CUDA caching allocator does (``kMinBlockSize``).

Scratch buffers an op allocates and frees inside itself are modelled only where known
(``costs.transient_bytes``: CPU dropout and the RNG-replay wrapper); other ops'
workspace, allocator fragmentation and caching, and non-tensor values are ignored.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .costs import node_flops, same_storage, storage_nbytes, tensor_val, transient_bytes
from .rewrite import RewrittenStep

ALLOCATORS = ("cpu", "cuda")
CUDA_BLOCK_BYTES = 512


@dataclasses.dataclass(frozen=True)
class LiveTensor:
    """A storage live at some step.

    Attributes:
        name: the node that allocated it (forward or backward graph name).
        layer: its layer, None for outer.
        nbytes: its size in bytes (after allocator rounding).
        kind: "saved" (saved activation), "forward", "recompute", "backward",
            "gradient" (a gradient output) or "output" (the loss).
    """

    name: str
    layer: int | None
    nbytes: int
    kind: str


@dataclasses.dataclass(frozen=True)
class TimelineStep:
    """Live activation bytes during one step (inputs and outputs of the op included)."""

    phase: str
    node: str
    layer: int | None
    live_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Predicted memory of one training step.

    Attributes:
        schedule: the schedule's provenance (``uniform(K=4)``).
        allocator: "cpu" or "cuda".
        peak_bytes: peak activation bytes (static memory excluded).
        peak_step: index into ``timeline`` of the (first) peak step.
        peak_phase: "forward" or "backward".
        peak_node: the node running at the peak.
        peak_layer: that node's layer (None: outer).
        live_at_peak: storages live at the peak, largest first.
        live_at_peak_by_layer: bytes live at the peak per layer ("outer" for None).
        saved_activation_bytes: bytes of the storages forward saves for backward.
        saved: the saved storages (name, layer, bytes).
        static_bytes: parameters, buffers, batch and tangents.
        timeline: live bytes at every step of forward then backward.
        forward_flops: FLOPs of the forward graph (torch.utils.flop_counter formulas).
        recompute_flops: FLOPs of the recompute segments in backward.
    """

    schedule: str
    allocator: str
    peak_bytes: int
    peak_step: int
    peak_phase: str
    peak_node: str
    peak_layer: int | None
    live_at_peak: tuple[LiveTensor, ...]
    live_at_peak_by_layer: dict[str, int]
    saved_activation_bytes: int
    saved: tuple[LiveTensor, ...]
    static_bytes: int
    timeline: tuple[TimelineStep, ...]
    forward_flops: int
    recompute_flops: int

    @property
    def recompute_fraction(self) -> float:
        """Recompute FLOPs as a fraction of forward FLOPs (0 when forward has none)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; the per-step timeline only when ``timeline``."""
        d = dataclasses.asdict(self)
        if not timeline:
            d.pop("timeline")
        return d


@dataclasses.dataclass
class _Storage:
    nbytes: Any
    first: int
    last: int
    name: str
    layer: int | None
    kind: str
    static: bool


def _round(nbytes: int, allocator: str) -> int:
    if allocator == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


@dataclasses.dataclass
class Intervals:
    """The storages of a rewritten step and the steps they are live at.

    Attributes:
        storages: every storage (static ones with ``first == -1``); ``nbytes`` is what
            the ``size_of`` function of ``live_intervals`` returned (bytes: an int, or a
            sympy expression for symbolic shapes); live at steps ``first..last``.
        fw_steps, bw_steps: the nodes run as steps, forward then backward; step ``i``
            is ``(fw_steps + bw_steps)[i]``.
        saved_sids: index into ``storages`` of each saved value (None: not a tensor).
    """

    storages: list[_Storage]
    fw_steps: list[fx.Node]
    bw_steps: list[fx.Node]
    saved_sids: list[Any]


def live_intervals(step: RewrittenStep, size_of: Any) -> Intervals:
    """Storages of ``step`` with their live intervals (the memory model above).

    Args:
        step: the rewritten step.
        size_of: ``size_of(fake tensor) -> bytes`` of its storage; the interval
            computation never looks at sizes, so they may be sympy expressions.

    Returns:
        The Intervals. The steps and intervals depend only on the graphs, not on sizes.
    """
    storages: list[_Storage] = []
    fw_nodes = list(step.forward.graph.nodes)
    bw_nodes = list(step.backward.graph.nodes)
    fw_steps = [n for n in fw_nodes if n.op not in ("placeholder", "output")]
    bw_steps = [n for n in bw_nodes if n.op not in ("placeholder", "output")]
    step_of: dict[fx.Node, int] = {}
    for i, n in enumerate(fw_steps + bw_steps):
        step_of[n] = i
    end = len(fw_steps) + len(bw_steps) - 1
    fw_end = len(fw_steps) - 1
    saved_set = set(step.saved)

    def new_storage(val: torch.Tensor, node: fx.Node, static: bool, kind: str) -> int:
        first = -1 if static else step_of[node]
        storages.append(
            _Storage(size_of(val), first, first, node.name, step.layer_of.get(node.name), kind, static)
        )
        return len(storages) - 1

    def touch(sid: int, at: int) -> None:
        if storages[sid].last < at:
            storages[sid].last = at

    def last_use(node: fx.Node, graph_end: int) -> int:
        uses = [step_of[u] for u in node.users if u.op != "output"]
        if any(u.op == "output" for u in node.users):
            uses.append(graph_end)
        return max(uses) if uses else step_of.get(node, -1)

    # storage ids per node: an int for a tensor, a list for a tuple, None otherwise
    sid_of: dict[fx.Node, Any] = {}
    primal_sid: dict[str, int] = {}

    def alias_of(val: torch.Tensor, node: fx.Node) -> int | None:
        for a in node.all_input_nodes:
            s = sid_of.get(a)
            av = a.meta.get("val")
            if isinstance(s, int) and isinstance(av, torch.Tensor) and same_storage(val, av):
                return s
            if isinstance(s, list) and isinstance(av, (tuple, list)):
                for si, ev in zip(s, av):
                    if si is not None and isinstance(ev, torch.Tensor) and same_storage(val, ev):
                        return si
        return None

    def touch_tree(sids: Any, at: int) -> None:
        if isinstance(sids, int):
            touch(sids, at)
        elif isinstance(sids, list):
            for e in sids:
                touch_tree(e, at)

    def alloc_tree(val: Any, node: fx.Node, kind: str) -> Any:
        if isinstance(val, torch.Tensor):
            s = alias_of(val, node)
            return new_storage(val, node, False, kind) if s is None else s
        if isinstance(val, (tuple, list)):
            return [alloc_tree(e, node, kind) for e in val]
        return None

    def visit(node: fx.Node, graph_end: int, kind: str) -> None:
        parent = node.args[0] if node.args else None
        if node.op == "get_attr":  # a constant of the graph module: exists before the step
            val = tensor_val(node)
            sid_of[node] = None if val is None else new_storage(val, node, True, "static")
        elif node.target is operator.getitem and isinstance(sid_of.get(parent), list):
            sid_of[node] = sid_of[parent][node.args[1]]
        else:
            # a tuple result holds its elements until its last getitem
            sid_of[node] = alloc_tree(node.meta.get("val"), node, kind)
        touch_tree(sid_of[node], last_use(node, graph_end))

    # forward
    for n in fw_nodes:
        if n.op == "placeholder":
            val = tensor_val(n)
            if val is not None:
                sid_of[n] = primal_sid[n.name] = new_storage(val, n, True, "static")
        elif n.op != "output":
            visit(n, fw_end, "forward")
    fw_output = fw_nodes[-1]
    fw_outs = list(fw_output.args[0])
    for out in fw_outs[: step.num_fwd_outputs]:  # the loss lives until the step ends
        if isinstance(out, fx.Node) and isinstance(sid_of.get(out), int):
            touch(sid_of[out], end)
            if not storages[sid_of[out]].static:
                storages[sid_of[out]].kind = "output"
    saved_sids = []
    for out in fw_outs[step.num_fwd_outputs :]:
        s = sid_of.get(out)
        saved_sids.append(s)
        if isinstance(s, int) and not storages[s].static:
            storages[s].kind = "saved"

    # backward: placeholders continue forward storages
    bw_placeholders = [n for n in bw_nodes if n.op == "placeholder"]
    n_saved = len(step.saved)
    for i, ph in enumerate(bw_placeholders):
        if i < n_saved:
            sid_of[ph] = saved_sids[i]
        elif ph.name in primal_sid:
            sid_of[ph] = primal_sid[ph.name]
        else:  # tangents
            val = tensor_val(ph)
            if val is not None:
                sid_of[ph] = new_storage(val, ph, True, "static")
        if isinstance(sid_of.get(ph), int):
            touch(sid_of[ph], last_use(ph, end))
    for n in bw_steps:
        visit(n, end, step.kind_of.get(n.name, "backward"))
    bw_output = bw_nodes[-1]
    for g in bw_output.args[0]:
        if isinstance(g, fx.Node) and isinstance(sid_of.get(g), int):
            s = storages[sid_of[g]]
            touch(sid_of[g], end)
            if not s.static:
                s.kind = "gradient"

    return Intervals(storages, fw_steps, bw_steps, saved_sids)


def analyze(step: RewrittenStep, allocator: str = "cpu") -> MemoryReport:
    """Liveness of ``step``: timeline, peak, what is live at the peak, saved bytes.

    Args:
        step: the rewritten step (``rewrite.rewrite``).
        allocator: "cpu" (exact bytes) or "cuda" (blocks rounded up to 512 bytes).

    Returns:
        The MemoryReport; all sizes in bytes.

    Raises:
        ValueError: unknown allocator, or a symbolic (non-integer) size; use the
            symbolic model for dynamic shapes.

    Example:
        Eight ``Linear(256, 256)`` layers, batch 137, fp32, ``none``: the peak is the
        saved inputs plus the gradients live when backward ends; see
        ``tests/test_liveness.py`` for the hand count.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r} is not one of {ALLOCATORS}")

    def size(val: torch.Tensor) -> int:
        nbytes = storage_nbytes(val)
        if not isinstance(nbytes, int):
            try:
                nbytes = int(nbytes)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"storage size {nbytes} is symbolic; concrete liveness needs concrete "
                    "shapes (use the symbolic model)"
                ) from e
        return _round(nbytes, allocator)

    iv = live_intervals(step, size)
    storages, fw_steps, bw_steps, saved_sids = iv.storages, iv.fw_steps, iv.bw_steps, iv.saved_sids
    end = len(fw_steps) + len(bw_steps) - 1
    fw_end = len(fw_steps) - 1

    # sweep
    nsteps = end + 1
    delta = [0] * (nsteps + 1)
    for s in storages:
        if s.static or s.nbytes == 0:
            continue
        delta[s.first] += s.nbytes
        delta[s.last + 1] -= s.nbytes
    for i, n in enumerate(fw_steps + bw_steps):
        scratch = transient_bytes(n) if allocator == "cpu" else 0
        if scratch:  # live during this op only
            delta[i] += scratch
            delta[i + 1] -= scratch
    timeline: list[TimelineStep] = []
    live = 0
    all_steps = fw_steps + bw_steps
    for i in range(nsteps):
        live += delta[i]
        node = all_steps[i]
        timeline.append(
            TimelineStep(
                "forward" if i <= fw_end else "backward",
                node.name,
                step.layer_of.get(node.name),
                live,
            )
        )
    peak_step = max(range(nsteps), key=lambda i: (timeline[i].live_bytes, -i)) if nsteps else 0
    peak = timeline[peak_step] if timeline else TimelineStep("forward", "", None, 0)
    at_peak = sorted(
        (
            LiveTensor(s.name, s.layer, s.nbytes, s.kind)
            for s in storages
            if not s.static and s.nbytes and s.first <= peak_step <= s.last
        ),
        key=lambda t: (-t.nbytes, t.name),
    )
    by_layer: dict[str, int] = {}
    for t in at_peak:
        key = "outer" if t.layer is None else str(t.layer)
        by_layer[key] = by_layer.get(key, 0) + t.nbytes
    saved_unique = sorted({s for s in saved_sids if isinstance(s, int) and not storages[s].static})
    saved = tuple(
        LiveTensor(storages[s].name, storages[s].layer, storages[s].nbytes, "saved")
        for s in saved_unique
    )
    static_bytes = sum(s.nbytes for s in storages if s.static)
    forward_flops = sum(node_flops(n) for n in fw_steps)
    recompute_flops = sum(node_flops(n) for n in bw_steps if step.kind_of.get(n.name) == "recompute")
    return MemoryReport(
        schedule=step.schedule.provenance,
        allocator=allocator,
        peak_bytes=peak.live_bytes,
        peak_step=peak_step,
        peak_phase=peak.phase,
        peak_node=peak.node,
        peak_layer=peak.layer,
        live_at_peak=tuple(at_peak),
        live_at_peak_by_layer=by_layer,
        saved_activation_bytes=sum(t.nbytes for t in saved),
        saved=saved,
        static_bytes=static_bytes,
        timeline=tuple(timeline),
        forward_flops=forward_flops,
        recompute_flops=recompute_flops,
    )
