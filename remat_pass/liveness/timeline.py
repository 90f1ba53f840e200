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

- Op scratch: the bytes an op allocates and frees inside itself (workspaces, per-thread
  buffers, upcasts) are live during that op's step only; real output storages larger
  than the FakeTensor's (``mse_loss(mean)``) are live as long as the output. Both come
  from the ``memory_model.MemoryModel`` (calibrated on this machine, else the ATen
  formula table); ``MemoryReport.peak_scratch`` names the op at the peak and whether its
  figure was calibrated.

Ignored: allocator fragmentation and caching, non-tensor values, memory that is not a
c10 allocation (MKL's and oneDNN's own buffers, ``std::vector`` in kernels), and
allocations on OpenMP worker threads (the CPU profiler does not see them either).

Functional collectives (a tensor-parallel rank's graph) follow their run-time rules
(``costs.COLLECTIVE_RULES``): ``wait_tensor``'s output is the collective's output
storage (``costs.run_alias_of``); an all-gather or reduce-scatter keeps its input alive
until its wait; backend scratch held from the call to the wait is a storage of kind
``"scratch"`` over those steps (``held_scratch_of`` of ``intervals.live_intervals``).

``intervals`` builds the live intervals of this model (``live_intervals``,
``memory_intervals``); ``live_timeline`` here is the one sweep over them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

from ..graph.costs import node_flops
from .intervals import memory_intervals
from ..memory.memory_model import SOURCES, MemoryModel, NodeMemory
from ..recompute.rewrite import RewrittenStep
from ..recompute.schedule import recompute_fraction


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
        peak_scratch: the op running at the peak step and its scratch (bytes, and
            whether calibrated, from the table, or unknown); None when no op runs there.
        peak_could_move_bytes: 0 when the op at the peak has a calibrated figure; else
            an estimate of how far the peak could move if its real scratch differs
            (``MemoryModel.could_move_bytes``).
        ops_by_source: the distinct ops of the step (by name, sorted) whose scratch
            figure is ``"calibrated"``, from the ``"table"``, or unknown (``"none"``).
        threads: the intra-op thread count the prediction is for.
        memory: the MemoryModel the report was computed with.
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
    peak_scratch: NodeMemory | None = None
    peak_could_move_bytes: int = 0
    ops_by_source: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    threads: int = 1
    memory: MemoryModel | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def recompute_fraction(self) -> float:
        """Recompute FLOPs as a fraction of forward FLOPs (0 when forward has none)."""
        return recompute_fraction(self.recompute_flops, self.forward_flops)


class SweepIntervals(Protocol):
    """What ``live_timeline`` reads: storages with ``nbytes``, ``first``, ``last`` and
    ``static`` (``intervals.Storage`` or any object with those fields) over ``num_steps``
    steps. ``intervals.Intervals`` is one; ``composition.StepIntervals`` (several graphs composed
    into one step) is another."""

    storages: Sequence[Any]

    @property
    def num_steps(self) -> int: ...


def live_timeline(iv: SweepIntervals, select: Callable[[Any], bool] | None = None, zero: Any = 0) -> list[Any]:
    """Activation bytes live at every step: the one sweep every view of liveness uses.

    Args:
        iv: ``intervals.live_intervals`` output (or any ``SweepIntervals``, e.g. a composed step).
        select: count only the storages it accepts (e.g. one layer's); default: all.
        zero: the additive zero of the sizes (``0``, or ``solvers.poly.Poly()`` for
            polynomial sizes); sizes need only ``+`` and ``-``.

    Returns:
        One value per step (forward steps then backward steps): the sum of the sizes of
        the non-static storages live there, scratch included.
    """
    n = iv.num_steps
    delta = [zero] * (n + 1)
    for s in iv.storages:
        if s.static or not s.nbytes or (select is not None and not select(s)):
            continue
        delta[s.first] = delta[s.first] + s.nbytes
        delta[s.last + 1] = delta[s.last + 1] - s.nbytes
    live, out = zero, []
    for i in range(n):
        live = live + delta[i]
        out.append(live)
    return out


def analyze(step: RewrittenStep, allocator: str | None = None, memory: MemoryModel | None = None) -> MemoryReport:
    """Liveness of ``step``: timeline, peak, what is live at the peak, saved bytes.

    Args:
        step: the rewritten step (``rewrite.rewrite``).
        allocator: "cpu" (exact bytes) or "cuda" (blocks rounded up to 512 bytes);
            default: ``memory``'s, else "cpu".
        memory: the memory model (storage sizes, op scratch); default:
            ``MemoryModel.table_only(allocator)``, the ATen formula table at the current
            thread count, nothing calibrated (``calibration.Calibrator`` calibrates).

    Returns:
        The MemoryReport; all sizes in bytes.

    Raises:
        ValueError: unknown allocator, an allocator other than ``memory``'s, or a
            symbolic (non-integer) size; use the symbolic model for dynamic shapes.

    Example:
        Eight ``Linear(256, 256)`` layers, batch 137, fp32, ``none``: the peak is the
        saved inputs plus the gradients live when backward ends; see
        ``tests/liveness/test_liveness.py`` for the hand count.
    """
    if memory is None:
        memory = MemoryModel.table_only(allocator or "cpu")
    elif allocator is not None and allocator != memory.allocator:
        raise ValueError(f"allocator {allocator!r} differs from the memory model's ({memory.allocator!r})")
    iv, node_memory = memory_intervals(step, memory)
    nsteps = iv.num_steps
    timeline = [
        TimelineStep("forward" if i < len(iv.fw_steps) else "backward", node.name, step.layer_of.get(node.name), live)
        for i, (node, live) in enumerate(zip(iv.steps, live_timeline(iv)))
    ]
    peak_step = max(range(nsteps), key=lambda i: (timeline[i].live_bytes, -i)) if nsteps else 0
    peak = timeline[peak_step] if timeline else TimelineStep("forward", "", None, 0)
    at_peak = _live_at(iv.storages, peak_step)
    saved = _saved_tensors(iv.storages, iv.saved_sids)
    at_peak_op = node_memory[peak_step] if nsteps else None
    return MemoryReport(
        schedule=step.provenance,
        allocator=memory.allocator,
        peak_bytes=peak.live_bytes,
        peak_step=peak_step,
        peak_phase=peak.phase,
        peak_node=peak.node,
        peak_layer=peak.layer,
        live_at_peak=at_peak,
        live_at_peak_by_layer=bytes_by_layer(at_peak),
        saved_activation_bytes=sum(t.nbytes for t in saved),
        saved=saved,
        static_bytes=sum(s.nbytes for s in iv.storages if s.static),
        timeline=tuple(timeline),
        forward_flops=sum(node_flops(n) for n in iv.fw_steps),
        recompute_flops=sum(node_flops(n) for n in iv.bw_steps if step.kind_of.get(n.name) == "recompute"),
        peak_scratch=at_peak_op,
        peak_could_move_bytes=memory.could_move_bytes(iv.steps[peak_step], at_peak_op) if nsteps else 0,
        ops_by_source=_ops_by_source(node_memory),
        threads=memory.threads,
        memory=memory,
    )


def _live_at(storages: Sequence[Any], at: int) -> tuple[LiveTensor, ...]:
    """The activation storages (scratch left out) live at step ``at``, largest first."""
    return tuple(sorted(
        (
            LiveTensor(s.name, s.layer, s.nbytes, s.kind)
            for s in storages
            if not s.static and s.kind != "scratch" and s.nbytes and s.first <= at <= s.last
        ),
        key=lambda t: (-t.nbytes, t.name),
    ))


def bytes_by_layer(tensors: Sequence[LiveTensor]) -> dict[str, int]:
    """Bytes of ``tensors`` per layer (``"outer"`` for None), in first-seen order."""
    by_layer: dict[str, int] = {}
    for t in tensors:
        key = "outer" if t.layer is None else str(t.layer)
        by_layer[key] = by_layer.get(key, 0) + t.nbytes
    return by_layer


def _saved_tensors(storages: Sequence[Any], saved_sids: Sequence[Any]) -> tuple[LiveTensor, ...]:
    """The distinct non-static storages forward saves for backward, in storage order."""
    saved_unique = sorted({s for s in saved_sids if isinstance(s, int) and not storages[s].static})
    return tuple(
        LiveTensor(storages[s].name, storages[s].layer, storages[s].nbytes, "saved")
        for s in saved_unique
    )


def _ops_by_source(node_memory: Sequence[NodeMemory | None]) -> dict[str, tuple[str, ...]]:
    """The distinct ops of the steps (sorted) by the source of their scratch figure."""
    ops_by_source: dict[str, set[str]] = {source: set() for source in SOURCES}
    for m in node_memory:
        if m is not None:
            ops_by_source[m.source].add(m.op)
    return {k: tuple(sorted(v)) for k, v in ops_by_source.items()}
