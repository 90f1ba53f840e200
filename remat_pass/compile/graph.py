"""One training graph of the torch.compile backend: what Dynamo says of it
(``CompileInfo``), its layer stack and GraphReport, the report files; the backend's
warnings. (Its state and transitions: ``graph_state``.)"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.fx as fx

from .options import REPORT_DIR_ENV, BackendOptions
from .compiled_graphs import GraphReport, graph_markdown
from ..errors import LayerStackNotFound
from .graph_schedule import GraphScheduler
from .graph_transforms import boundary_bytes
from ..liveness.symbolic_sizes import concrete_step, size_hint
from ..report.inspection import dump_step
from ..liveness.timeline import analyze
from ..graph.regions import LayerStack, assign_layers_in_graph, forward_node_names
from ..recompute.rewrite import RewrittenStep
from ..graph.trace import JointGraph


class GraphBreakWarning(UserWarning):
    """The compiled model is split into several graphs; recompute cannot span a break."""


class NoLayerStackWarning(UserWarning):
    """A training graph holds no layer of the stack; it was compiled with ``none``."""


class RematFallbackWarning(UserWarning):
    """``on_error="fallback"``: a graph runs un-rewritten because of the error named."""


@dataclasses.dataclass(frozen=True)
class CompileInfo:
    """What the backend knows of the Dynamo graph being compiled.

    Attributes:
        graph_id: Dynamo's compile id (``"0/0"``), or ``graphN`` outside Dynamo.
        frame_id: the frame part of it (None outside Dynamo).
        labels: the Dynamo graph's placeholder names (parameter and input labels).
        graph_break: why Dynamo ended this graph when a graph break did, else None.
        partial: the graph may hold only part of the stack (a break came before it, or
            ends it).
        made_inputs: the placeholders Dynamo makes a tensor of at every call (a Python
            float under dynamic shapes, passed as ``torch._as_tensor_fullprec(x)``:
            ``GraphArg.pass_arg_as_tensor``): allocated in the step, not by the caller.
    """

    graph_id: str
    frame_id: int | None
    labels: tuple[str, ...]
    graph_break: str | None
    partial: bool
    made_inputs: tuple[int, ...] = ()


def compile_info(gm: fx.GraphModule, graph_id: str, frame: int | None, seen_break: bool) -> CompileInfo:
    """The CompileInfo of the Dynamo graph ``gm`` (``graph_id``, ``frame``: its compile id;
    ``seen_break``: an earlier graph ended at a graph break)."""
    reason = getattr(gm, "compile_subgraph_reason", None)  # set by Dynamo's OutputGraph
    ends_at_break = bool(reason is not None and getattr(reason, "graph_break", False))
    where = ""
    if ends_at_break and getattr(reason, "user_stack", None):
        top = reason.user_stack[-1]
        where = f" at {os.path.basename(top.filename)}:{top.lineno}"
    return CompileInfo(
        graph_id=graph_id, frame_id=frame,
        labels=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        graph_break=(str(reason.reason).splitlines()[0] + where) if ends_at_break else None,
        partial=ends_at_break or seen_break,  # after a break, part of the stack
        made_inputs=tuple(i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                          if getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)),
    )


def graph_layer_stack(joint: JointGraph, info: CompileInfo, options: BackendOptions,
                      reports: Sequence[GraphReport]) -> LayerStack:
    """The graph's layer stack; after a graph break the stack may continue in another
    graph, so K / N may exceed the layers seen here (the stack is widened to K).

    Args:
        joint: the graph's JointGraph.
        info: what Dynamo says of the graph.
        options: the backend's options (``layers``, ``schedule``, K / N).
        reports: the GraphReports of the graphs compiled before it (the stack an
            earlier graph found is looked for first).

    Returns:
        The LayerStack; one of no layers (``NoLayerStackWarning`` while no graph has
        held a stack) when the graph holds none.
    """
    stack = _find_layer_stack(joint.gm, joint.num_fwd_outputs, info.graph_id, options, reports)
    k = options.recompute_num_layers
    if info.partial and stack.num_layers and k and options.schedule in ("uniform", "block"):
        stack = stack.widened(k)
    return stack


def _find_layer_stack(joint: fx.GraphModule, num_fwd_outputs: int, graph_id: str, options: BackendOptions,
                      reports: Sequence[GraphReport]) -> LayerStack:
    # after a break, a graph may hold a single layer of the stacks an earlier graph
    # found (one child is not enough for the search): those are looked for first
    earlier = [r.layer_stack for r in reports if r.layer_stack]
    try:
        return assign_layers_in_graph(joint, num_fwd_outputs, options.layers,
                                      known=earlier[-1].split(", ") if earlier else ())
    except LayerStackNotFound as e:
        # a graph outside the stack (the loss after a graph break) is expected once
        # another graph holds the stack; warn only while no graph has held it
        if options.schedule != "none" and not any(
            r.layer_stack is not None for r in reports
        ):
            warnings.warn(
                f"remat-pass: graph {graph_id} holds no layer of the stack, so it is "
                f"compiled with schedule none instead of {options.schedule}: {e}",
                NoLayerStackWarning,
                stacklevel=2,
            )
    fwd = forward_node_names(joint, num_fwd_outputs)
    return LayerStack(
        path="",
        child_names=(),
        num_layers=0,
        layer_of={n.name: None for n in joint.graph.nodes},
        forward_nodes=tuple(fwd),
    )


def graph_report(info: CompileInfo, step: RewrittenStep, stack: LayerStack, joint: JointGraph,
                 num_fwd_outputs: int, allocator: str, scheduler: GraphScheduler,
                 pass_time_s: float) -> GraphReport:
    """The GraphReport of one rewritten graph: its sizes at the compile-time example,
    its peak predicted with the scheduler's memory model for ``allocator``."""
    concrete, symbolic = concrete_step(step)
    return GraphReport(
        graph_id=info.graph_id,
        frame_id=info.frame_id,
        graph_break=info.graph_break,
        schedule=step.provenance,
        layer_stack=stack.path if stack.num_layers else None,
        layers=tuple(sorted({i for i in stack.layer_of.values() if i is not None})),
        num_fwd_outputs=num_fwd_outputs,
        boundary_output_bytes=boundary_bytes(concrete),
        symbolic=symbolic,
        example_shapes=tuple(tuple(size_hint(d) for d in v.shape)
                             for v, kind in zip(joint.primal_values, joint.primal_kinds)
                             if kind == "input" and isinstance(v, torch.Tensor)),
        pass_time_s=pass_time_s,
        memory=analyze(concrete, memory=scheduler.memory_model(concrete, allocator)),
        step=concrete,
    )


def report_folder(options: BackendOptions) -> Path | None:
    """Where reports are written: the option, else ``$REMAT_PASS_REPORT_DIR``, else None."""
    d = options.report_dir or os.environ.get(REPORT_DIR_ENV)
    return Path(d) if d else None


def write_graph_report(folder: Path, report: GraphReport) -> list[Path]:
    """Write ``report`` to ``folder`` (``graph_<id>.json``, ``.md`` and the
    ``remat-pass inspect --graph`` dump); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = "graph_" + report.graph_id.replace("/", "_")
    js = folder / f"{stem}.json"
    js.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    md = folder / f"{stem}.md"
    md.write_text(graph_markdown(report), encoding="utf-8")
    return [js, md, dump_step(report.step, report.memory, folder, stem,
                              meta={"graph_id": report.graph_id, "schedule": report.schedule})]
