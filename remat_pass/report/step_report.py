"""The step-level report of a model compiled into several graphs: the graphs' timelines
composed with what crosses between them (``step_flow``, ``composition``), the
peak, its place (graph, phase, node) and what is live there; as a value, Markdown and
versioned JSON (kind ``remat-pass-step-report`` of ``report_schema.json``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..formatting import fmt_bytes, markdown_table, mib
from .schedule_report import SCHEMA_VERSION
from ..liveness.composition import ComposedStep, SpanTensor, compose_step
from ..liveness.step_flow import EagerOps, GraphCall, step_flow

# kinds of tensors that exist because the step runs as several graphs (step_flow rules)
CROSSING_KINDS = ("crossing", "passed gradient", "zero tangent")
STEP_REPORT_KIND = "remat-pass-step-report"


@dataclasses.dataclass(frozen=True)
class CallSummary:
    """One graph call of the step, as the report shows it.

    Attributes:
        label: the call's name in the step (the graph id).
        graph_id: the compiled graph.
        schedule: its schedule's provenance.
        layers: its layers of the stack.
        shapes: the shapes of its non-parameter inputs in this step.
        graph_peak_bytes: the graph's own predicted peak (one graph alone, its outputs
            and gradients held to the end), for comparison.
    """

    label: str
    graph_id: str
    schedule: str
    layers: tuple[int, ...]
    shapes: tuple[Any, ...]
    graph_peak_bytes: int


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Predicted memory of one training step that runs as several compiled graphs.

    Attributes:
        step_index: the recorded step it was composed from.
        model: what each graph's timeline comes from: ``"fx"`` (the rewritten graphs
            run as fx code) or ``"inductor"`` (Inductor's generated code).
        calls: the graph calls, in forward order.
        backward_order: labels of the calls whose backward ran, in run order.
        composed: the composed timeline (``composition.ComposedStep``).
        notes: what the composition does not model in this step (empty: all of it).
    """

    step_index: int
    model: str
    calls: tuple[CallSummary, ...]
    backward_order: tuple[str, ...]
    composed: ComposedStep
    notes: tuple[str, ...]

    @property
    def peak_bytes(self) -> int:
        """Predicted peak activation bytes of the step (static memory excluded)."""
        return self.composed.peak_bytes

    @property
    def exact(self) -> bool:
        """Whether the composition models the whole step (no note)."""
        return not self.notes

    def live_at_peak(self) -> list[SpanTensor]:
        """The tensors live at the peak, largest first."""
        return self.composed.live_at_peak()

    def crossing(self) -> list[SpanTensor]:
        """The tensors that cross between graphs (activations held across a break,
        gradients passed back, zero tangents), in graph order."""
        return [t for t in self.composed.tensors if t.kind in CROSSING_KINDS]

    @property
    def break_cost_bytes(self) -> int:
        """Bytes live at the peak that exist because the step runs as several graphs:
        activations held across a break, gradients passed back, zero tangents."""
        return sum(t.nbytes for t in self.live_at_peak() if t.kind in CROSSING_KINDS)

    def where(self, t: SpanTensor) -> str:
        """``0/0 forward add_3 .. 1/0 backward mm_2``: the places a tensor lives between."""
        a, b = (self.composed.place(self.composed.offsets[p.phase] + p.step) for p in (t.start, t.end))
        return f"{a.graph} {a.kind} {a.node} .. {b.graph} {b.kind} {b.node}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of kind ``remat-pass-step-report`` (``report_schema.json``)."""
        peak = self.composed.peak_place
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": STEP_REPORT_KIND,
            "step_index": self.step_index,
            "model": self.model,
            "peak_bytes": self.peak_bytes,
            "peak": {"graph": peak.graph, "phase": peak.kind, "node": peak.node, "layer": peak.layer},
            "break_cost_bytes": self.break_cost_bytes,
            "calls": [{"label": c.label, "graph_id": c.graph_id, "schedule": c.schedule,
                       "layers": list(c.layers), "shapes": [list(s) if isinstance(s, tuple) else s for s in c.shapes],
                       "graph_peak_bytes": c.graph_peak_bytes} for c in self.calls],
            "phases": [{"graph": p.graph, "phase": p.kind, "num_steps": len(p.steps), "peak_bytes": pk}
                       for p, pk in zip(self.composed.phases, self.composed.phase_peaks())],
            "backward_order": list(self.backward_order),
            "live_at_peak": [_tensor_json(t) for t in self.live_at_peak()],
            "crossing": [dict(_tensor_json(t), where=self.where(t)) for t in self.crossing()],
            "notes": list(self.notes),
        }


def _tensor_json(t: SpanTensor) -> dict[str, Any]:
    return {"name": t.name, "graph": t.graph, "kind": t.kind, "layer": t.layer, "bytes": int(t.nbytes)}


def build_step_report(step_index: int, model: str, calls: Sequence[GraphCall],
                      summaries: Sequence[CallSummary], backward_order: Sequence[int],
                      notes: Sequence[str] = (), held: Sequence[tuple[int, int]] = (),
                      eager: EagerOps | None = None) -> StepReport:
    """Compose a step's graph calls (concrete sizes) into its StepReport.

    Args:
        step_index: the recorded step's number.
        model: ``"fx"`` or ``"inductor"``.
        calls: the GraphCalls, in forward order.
        summaries: one CallSummary per call.
        backward_order: indices of the calls whose backward ran, in run order.
        notes: what the caller already knows is not modelled (eager inputs, ...).
        held: ``(call, output)`` the caller still held after backward (``step_flow``).
        eager: the eager ops recorded around the graphs (``step_flow.EagerOps``).

    Raises:
        ValueError: as ``step_flow.step_flow`` / ``composition.compose_step``.
    """
    flow = step_flow(calls, backward_order, held=held, eager=eager)
    composed = compose_step(flow.phases, flow.tensors)
    return StepReport(step_index, model, tuple(summaries), tuple(calls[c].label for c in backward_order),
                      composed, tuple(notes) + flow.notes)


def step_markdown(report: StepReport, top: int = 12) -> str:
    """The step report as Markdown: the peak and its place, the graphs, what crosses
    between them, what is live at the peak."""
    peak = report.composed.peak_place
    lines = [
        f"## remat-pass step (step {report.step_index}, {len(report.calls)} graph calls, "
        f"{'Inductor code' if report.model == 'inductor' else 'fx graphs'})\n",
        f"- predicted step peak: **{fmt_bytes(report.peak_bytes)}** at {peak.graph} {peak.kind}, "
        f"node `{peak.node}`" + (f" (layer {peak.layer})" if peak.layer is not None else ""),
        f"- live at the peak because the step runs as several graphs: {fmt_bytes(report.break_cost_bytes)}",
        f"- backward order: {', '.join(report.backward_order) or 'none ran'}",
    ]
    for n in report.notes:
        lines.append(f"- not modelled: {n}")
    lines.append("")
    rows = [[c.label, c.schedule, _layers(c.layers), _shapes(c.shapes), mib(c.graph_peak_bytes), mib(pk_f), mib(pk_b)]
            for c, pk_f, pk_b in zip(report.calls, *_phase_peaks(report))]
    lines.append(markdown_table(["graph", "schedule", "layers", "input shapes", "graph alone MiB",
                                 "forward peak MiB", "backward peak MiB"], rows))
    crossing = report.crossing()
    if crossing:
        lines.append("\n### Crossing between graphs\n")
        lines.append(markdown_table(["tensor", "graph", "kind", "MiB", "live from .. to"],
                                    [[t.name, t.graph, t.kind, mib(t.nbytes), report.where(t)] for t in crossing[:top]]))
    lines.append("\n### Live at the peak\n")
    lines.append(markdown_table(["tensor", "graph", "kind", "layer", "MiB"],
                                [[t.name, t.graph, t.kind, "outer" if t.layer is None else t.layer, mib(t.nbytes)]
                                 for t in report.live_at_peak()[:top]]))
    return "\n".join(lines) + "\n"


def _phase_peaks(report: StepReport) -> tuple[list[int], list[int]]:
    fw = {p.graph: pk for p, pk in zip(report.composed.phases, report.composed.phase_peaks()) if p.kind == "forward"}
    bw = {p.graph: pk for p, pk in zip(report.composed.phases, report.composed.phase_peaks()) if p.kind == "backward"}
    return [fw.get(c.label, 0) for c in report.calls], [bw.get(c.label, 0) for c in report.calls]


def _layers(layers: Sequence[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else (str(layers[0]) if layers else "-")


def _shapes(shapes: Sequence[Any]) -> str:
    return " ".join(str(list(s)) for s in shapes if isinstance(s, tuple)) or "-"


def break_text(report: StepReport) -> str:
    """One paragraph for the GraphBreakWarning: the step's peak and the bytes a break
    costs there."""
    peak = report.composed.peak_place
    kinds: dict[str, int] = {}
    for t in report.live_at_peak():
        if t.kind in CROSSING_KINDS:
            kinds[t.kind] = kinds.get(t.kind, 0) + t.nbytes
    parts = ", ".join(f"{fmt_bytes(b)} {k}" for k, b in sorted(kinds.items())) or "nothing"
    return (f"the step (composed from its {len(report.calls)} graph calls) peaks at "
            f"{fmt_bytes(report.peak_bytes)} in {peak.graph} {peak.kind} (node {peak.node}); the graph "
            f"breaks cost {fmt_bytes(report.break_cost_bytes)} there ({parts}: tensors crossing "
            "between graphs, held by the frames between them, passed back as gradients, or "
            "zero tangents for outputs that get no gradient)")
