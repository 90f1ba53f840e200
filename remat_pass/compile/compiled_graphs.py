"""What the torch.compile backend reports per compiled graph: the GraphReport value,
its Markdown, and the description of graph breaks across the graphs of a step."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..formatting import fmt_bytes
from ..liveness.timeline import MemoryReport
from ..report.schedule_report import report_json, report_markdown
from ..recompute.rewrite import RewrittenStep


@dataclasses.dataclass(frozen=True)
class GraphReport:
    """The rewrite and the predicted memory of one compiled training graph.

    Attributes:
        graph_id: Dynamo's compile id, ``"<frame>/<recompile>"`` (``"0/0"``; a graph
            after a graph break has another frame, a recompile another second number).
        frame_id: the frame part of ``graph_id`` (None outside Dynamo).
        graph_break: why Dynamo ended this graph when a graph break did (reason and
            source line), else None.
        schedule: the applied schedule's provenance (``uniform(K=2)``).
        layer_stack: the stack's module path (``""``: the compiled module itself), None
            when the graph holds no layer.
        layers: layers of the stack with nodes in this graph.
        num_fwd_outputs: forward outputs of the graph (what crosses a graph break).
        boundary_output_bytes: bytes of those outputs (distinct storages).
        symbolic: sizes were symbolic; the report is at the example's sizes.
        example_shapes: shapes of the graph's tensor inputs that are not parameters.
        pass_time_s: seconds spent in the partition (find stack, rewrite, analyze).
        memory: the MemoryReport (``liveness.analyze`` of the rewritten step).
        step: the RewrittenStep (forward and backward graphs as rewritten, before the
            change of calling convention).
    """

    graph_id: str
    frame_id: int | None
    graph_break: str | None
    schedule: str
    layer_stack: str | None
    layers: tuple[int, ...]
    num_fwd_outputs: int
    boundary_output_bytes: int
    symbolic: bool
    example_shapes: tuple[tuple[int, ...], ...]
    pass_time_s: float
    memory: MemoryReport
    step: RewrittenStep = dataclasses.field(repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        """Predicted peak activation bytes of this graph's forward + backward."""
        return self.memory.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the graph's fields and ``memory`` (``report.report_json`` of
        the memory report and the rewritten step)."""
        return {
            "graph_id": self.graph_id,
            "frame_id": self.frame_id,
            "graph_break": self.graph_break,
            "schedule": self.schedule,
            "layer_stack": self.layer_stack,
            "layers": list(self.layers),
            "num_fwd_outputs": self.num_fwd_outputs,
            "boundary_output_bytes": self.boundary_output_bytes,
            "symbolic": self.symbolic,
            "example_shapes": [list(s) for s in self.example_shapes],
            "pass_time_s": self.pass_time_s,
            "memory": report_json(self.memory, self.step),
        }



def _layers_text(layers: Sequence[int]) -> str:
    if not layers:
        return "no layer"
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "layers " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def graph_markdown(report: GraphReport) -> str:
    """One compiled graph's report as Markdown: the graph's place, then
    ``report.report_markdown``."""
    head = (
        f"## remat-pass graph {report.graph_id}\n\n"
        f"- layer stack: `{report.layer_stack}`, {_layers_text(report.layers)}\n"
        f"- forward outputs: {report.num_fwd_outputs} ({fmt_bytes(report.boundary_output_bytes)})\n"
        + (f"- sizes at the example shapes {list(map(list, report.example_shapes))} (symbolic graph)\n"
           if report.symbolic else "")
        + "\n"
    )
    return head + report_markdown(report.memory, report.step) + "\n"



def describe_graph_breaks(reports: Sequence[GraphReport]) -> str:
    """A description of the graph breaks among the latest graph of every frame
    (empty when all training graphs come from one frame).

    Lists every graph (id, layers, forward outputs crossing the break, saved
    activations held until its backward) and the layers split across graphs.
    """
    latest: dict[Any, GraphReport] = {}
    for r in reports:
        latest[r.frame_id] = r
    if len(latest) < 2:
        return ""
    graphs = list(latest.values())
    lines = [
        f"remat-pass: the compiled model runs as {len(graphs)} training graphs (graph "
        "breaks); a recompute group cannot span a break, and the tensors crossing a "
        "break are held by the next graph:"
    ]
    owners: dict[int, list[str]] = {}
    for r in graphs:
        for i in r.layers:
            owners.setdefault(i, []).append(r.graph_id)
        lines.append(
            f"  graph {r.graph_id}"
            + (f" (ends at a graph break: {r.graph_break})" if r.graph_break else "")
            + (f": {_layers_text(r.layers)} of {r.layer_stack!r}, " if r.layers else ": no layer of the stack, ")
            + f"schedule {r.schedule}; {r.num_fwd_outputs} forward outputs "
            f"({fmt_bytes(r.boundary_output_bytes)}) leave the graph (held by what runs "
            f"next); saved activations {fmt_bytes(r.memory.saved_activation_bytes)} held "
            "until its backward; "
            f"predicted peak {fmt_bytes(r.memory.peak_bytes)}"
        )
    split = {i: ids for i, ids in sorted(owners.items()) if len(ids) > 1}
    for i, ids in split.items():
        lines.append(
            f"  layer {i} is split across graphs {', '.join(ids)}: each part is "
            "recomputed (or stored) on its own, from the tensors at the break"
        )
    groups = sorted({g for r in graphs for g in r.step.schedule.groups})
    for g in groups:
        ids = [r.graph_id for r in graphs if set(g) & set(r.layers)]
        if len(ids) > 1:
            lines.append(
                f"  recompute group [{g[0]}-{g[-1]}] spans graphs {', '.join(ids)}: "
                "each graph recomputes its part from its own saved inputs"
            )
    unmapped = [r.graph_id for r in graphs if not r.layers]
    if unmapped:
        lines.append(
            f"  graphs {', '.join(unmapped)} hold no layer of the stack (no module path "
            "under it is recorded: a graph outside the stack, or a frame rooted inside a "
            "layer, as Dynamo compiles a layer's forward on its own after a graph break "
            "in a loop over the layers); they are compiled with schedule none"
        )
    return "\n".join(lines)
