"""One timeline from several: the phases of a step in the order they run, and every
tensor live from one place in them to another.

A training step that runs as several pieces (the graphs of a model split by
``torch.compile`` graph breaks; the microbatches' forwards and backwards on a pipeline
rank) is a sequence of *phases* (one graph's forward, another's backward, ...), each a
sequence of steps. A
tensor is live from a ``Place`` (phase, step) to a ``Place``, both inclusive, the
interval rule of ``liveness``: during an op its inputs and outputs coexist. Given the
phases in run order and the tensors, the composition lays the phases end to end and
runs the one sweep of ``liveness.live_timeline`` over them, so the step's live bytes,
its peak, the place of the peak and what is live there follow exactly as for one graph.

The composition knows nothing of graphs or of why a tensor lives where it does; the
caller decides that. It has two: ``step_flow`` for graph breaks (forward outputs held
by the frames between graphs, gradients passed back, zero tangents), and
``parallel.pipeline.rank_composition`` for pipeline microbatches (a phase per action of
the rank; saved values held until their backward, receive buffers, sends until they are
waited, the gradient accumulator). It is a pure function of:

- ``phases``: ``Phase(graph, kind, steps)`` in run order (``steps`` names what runs at
  each step: node names, lines of generated code);
- ``tensors``: ``SpanTensor(name, graph, kind, nbytes, start, end)``, where each
  per-graph liveness interval becomes one tensor (its first and last step mapped onto
  the graph's phases) and each tensor that crosses between phases carries the places
  where it is made and where it dies (a caller that has a phase's live bytes per step
  rather than its intervals gives them as the phase's ``live``). ``ComposedStep.
  live_bytes_by_kind`` splits a step's live bytes by the caller's kinds.

Sizes may be ints (bytes) or any values with ``+`` and ``-`` (``solvers.poly.Poly`` for
sizes symbolic in the shapes): ``compose_timeline`` then gives one value per step, of
which ``solvers.poly.pareto_max`` keeps the candidate peaks.

Example: a forward of 2 steps and its backward of 2 steps; a 4-byte activation made at
forward step 0 and read last at backward step 1, and an 8-byte gradient made at
backward step 0 and kept to the end.

>>> f = Phase("g0", "forward", ("mm", "relu"))
>>> b = Phase("g0", "backward", ("relu_bw", "mm_bw"))
>>> act = SpanTensor("relu", "g0", "saved", 4, Place(0, 0), Place(1, 1))
>>> grad = SpanTensor("mm_bw", "g0", "gradient", 8, Place(1, 0), Place(1, 1))
>>> step = compose_step([f, b], [act, grad])
>>> step.timeline, step.peak_bytes, step.peak_place.node
((4, 4, 12, 12), 12, 'relu_bw')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .intervals import Storage
from .timeline import live_timeline

PHASE_KINDS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One piece of a step that runs as a whole: a graph's forward or backward.

    Attributes:
        graph: the graph (or graph call, or microbatch) it belongs to, e.g. ``"0/0"``.
        kind: ``"forward"`` or ``"backward"``.
        steps: what runs at each step, in order (node names, generated-code lines). A
            phase with no step takes one slot in the timeline (named ``"(nothing)"``).
        layers: the layer of each step (None: outer), or empty when unknown.
        live: bytes live at each slot besides the tensors (empty: none), counted under
            kind ``live_kind`` and named by the slot's step: a caller that has the
            phase's live bytes per step rather than its intervals (as one tensor per
            step, without building them).
        live_kind: the kind of ``live``.
    """

    graph: str
    kind: str
    steps: tuple[str, ...]
    layers: tuple[int | None, ...] = ()
    live: tuple[Any, ...] = ()
    live_kind: str = ""

    @property
    def num_slots(self) -> int:
        """Steps this phase takes in the composed timeline (at least 1)."""
        return max(len(self.steps), 1)


@dataclasses.dataclass(frozen=True, order=True)
class Place:
    """A step of a composed timeline: step ``step`` of phase ``phase`` (indices into the
    phase list and into that phase's steps)."""

    phase: int
    step: int


@dataclasses.dataclass(frozen=True)
class SpanTensor:
    """A tensor live from ``start`` to ``end`` (inclusive).

    Attributes:
        name: the node (or buffer) that made it.
        graph: the graph it belongs to.
        kind: why it lives where it does (``"saved"``, ``"crossing"``, ``"gradient"``,
            ``"zero tangent"``, ... as the caller names it).
        nbytes: its size (bytes, or a polynomial in shape symbols).
        start, end: the places it is live from and to.
        layer: its layer (None: outer or unknown).
    """

    name: str
    graph: str
    kind: str
    nbytes: Any
    start: Place
    end: Place
    layer: int | None = None


@dataclasses.dataclass(frozen=True)
class StepPlace:
    """Where a global step of the composed timeline is: phase, graph, node, layer."""

    index: int
    phase: int
    graph: str
    kind: str
    node: str
    layer: int | None


@dataclasses.dataclass
class StepIntervals:
    """The composed tensors as ``intervals.Storage`` intervals over the global steps
    (what ``liveness.live_timeline`` sweeps)."""

    storages: list[Storage]
    num_steps: int


@dataclasses.dataclass(frozen=True)
class ComposedStep:
    """A step composed from phases and tensors (concrete sizes, bytes).

    Attributes:
        phases: the phases in run order.
        tensors: every tensor, with its places.
        offsets: the global index of each phase's first step.
        timeline: live bytes at every global step.
        peak_bytes: the largest of them (0 for an empty step).
        peak_place: where the (first) peak is.
    """

    phases: tuple[Phase, ...]
    tensors: tuple[SpanTensor, ...]
    offsets: tuple[int, ...]
    timeline: tuple[int, ...]
    peak_bytes: int
    peak_place: StepPlace

    def place(self, index: int) -> StepPlace:
        """The phase, graph, node and layer of global step ``index``."""
        return _place(self.phases, self.offsets, index)

    def live_at(self, index: int) -> list[SpanTensor]:
        """The tensors live at global step ``index``, largest first (then by name); a
        phase's ``live`` bytes there as one tensor of that step."""
        live = [t for t in self.tensors if _global(self.offsets, t.start) <= index <= _global(self.offsets, t.end)
                and t.nbytes]
        where = _place(self.phases, self.offsets, index)
        phase = self.phases[where.phase]
        j = index - self.offsets[where.phase]
        if j < len(phase.live) and phase.live[j]:
            live.append(SpanTensor(where.node, phase.graph, phase.live_kind, phase.live[j], Place(where.phase, j),
                                   Place(where.phase, j), where.layer))
        return sorted(live, key=lambda t: (-t.nbytes, t.graph, t.name))

    def live_bytes_by_kind(self, index: int) -> dict[str, int]:
        """Bytes of the tensors live at global step ``index``, summed by ``kind``."""
        out: dict[str, int] = {}
        for t in self.live_at(index):
            out[t.kind] = out.get(t.kind, 0) + t.nbytes
        return out

    def live_at_peak(self) -> list[SpanTensor]:
        """``live_at`` the peak."""
        return self.live_at(self.peak_place.index)

    def phase_peaks(self) -> list[int]:
        """The largest live bytes within each phase, in phase order."""
        return [max(self.timeline[a : a + p.num_slots]) for p, a in zip(self.phases, self.offsets)]


def _offsets(phases: Sequence[Phase]) -> tuple[int, ...]:
    out, pos = [], 0
    for p in phases:
        out.append(pos)
        pos += p.num_slots
    return tuple(out)


def _global(offsets: Sequence[int], place: Place) -> int:
    return offsets[place.phase] + place.step


def _place(phases: Sequence[Phase], offsets: Sequence[int], index: int) -> StepPlace:
    for i in reversed(range(len(phases))):
        if offsets[i] <= index:
            p = phases[i]
            j = index - offsets[i]
            node = p.steps[j] if j < len(p.steps) else "(nothing)"
            layer = p.layers[j] if j < len(p.layers) else None
            return StepPlace(index, i, p.graph, p.kind, node, layer)
    raise IndexError(f"step {index} is outside the composed step")


def step_intervals(phases: Sequence[Phase], tensors: Sequence[SpanTensor]) -> StepIntervals:
    """The tensors as intervals over the global steps of ``phases`` laid end to end.

    Raises:
        ValueError: a phase kind other than forward / backward, a place outside its
            phase, or a tensor that ends before it starts.
    """
    for p in phases:
        if p.kind not in PHASE_KINDS:
            raise ValueError(f"phase of graph {p.graph!r} has kind {p.kind!r}; kinds are {PHASE_KINDS}")
        if len(p.live) not in (0, p.num_slots):
            raise ValueError(f"phase of graph {p.graph!r}: live has {len(p.live)} values, not one per slot "
                             f"({p.num_slots}) or none")
    offsets = _offsets(phases)
    storages = []
    for t in tensors:
        for where in (t.start, t.end):
            if not (0 <= where.phase < len(phases) and 0 <= where.step < phases[where.phase].num_slots):
                raise ValueError(f"tensor {t.name!r} of graph {t.graph!r}: {where} is outside the "
                                 f"{len(phases)} phases (or outside that phase's steps)")
        first, last = _global(offsets, t.start), _global(offsets, t.end)
        if last < first:
            raise ValueError(f"tensor {t.name!r} of graph {t.graph!r} ends ({t.end}) before it starts ({t.start})")
        storages.append(Storage(t.nbytes, first, last, t.name, t.layer, t.kind, False))
    return StepIntervals(storages, sum(p.num_slots for p in phases))


def compose_timeline(phases: Sequence[Phase], tensors: Sequence[SpanTensor], zero: Any = 0) -> list[Any]:
    """Live size at every global step (``liveness.live_timeline`` over the composed
    intervals, plus each phase's ``live``); sizes may be polynomials
    (``zero=solvers.poly.Poly()``).

    Raises:
        ValueError: as ``step_intervals``.
    """
    out = live_timeline(step_intervals(phases, tensors), zero=zero)
    for p, start in zip(phases, _offsets(phases)):
        for j, b in enumerate(p.live):
            out[start + j] = out[start + j] + b
    return out


def compose_step(phases: Sequence[Phase], tensors: Sequence[SpanTensor]) -> ComposedStep:
    """Compose ``phases`` (in run order) and ``tensors`` (int sizes, bytes) into one step.

    Args:
        phases: the phases in the order they run.
        tensors: every tensor with the places it is live from and to.

    Returns:
        The ComposedStep: timeline, peak, the place of the peak.

    Raises:
        ValueError: as ``step_intervals``.
    """
    phases, tensors = tuple(phases), tuple(tensors)
    timeline = tuple(int(v) for v in compose_timeline(phases, tensors))
    offsets = _offsets(phases)
    peak_index = max(range(len(timeline)), key=lambda i: (timeline[i], -i)) if timeline else 0
    peak_place = (_place(phases, offsets, peak_index) if timeline
                  else StepPlace(0, 0, "", "forward", "(nothing)", None))
    return ComposedStep(phases, tensors, offsets, timeline, timeline[peak_index] if timeline else 0, peak_place)
