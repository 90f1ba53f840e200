"""The torch.compile backend: AOTAutograd with this project's partition, a liveness
report for every compiled graph, and a report of the whole step.

``torch.compile(model, backend=remat_pass.backend(schedule="uniform", recompute_num_layers=2))``,
or through the ``torch_dynamo_backends`` entry point
``torch.compile(model, backend="remat", options={"schedule": "uniform", "recompute_num_layers": 2})``.

For every graph Dynamo hands over:

1. AOTAutograd (``torch._dynamo.backends.common.aot_autograd``, which calls
   ``aot_module_simplified``) traces the joint forward+backward graph and calls this
   module's partition function instead of its own (``default_partition`` /
   ``min_cut_rematerialization_partition``).
2. The partition finds the layer stack from the module paths Dynamo recorded on the
   nodes (``nn_module_stack``; AOTAutograd copies the forward node's onto its backward
   nodes as ``fwd_nn_module_stack``), gives every node its layer
   (``regions.assign_layers_to_graph``), builds the Schedule for the layers of the
   stack (``optimized``: ``planner.Planner`` under ``budget_bytes``) and rewrites
   (``rewrite.rewrite``). ``liveness.analyze`` predicts the graph's peak; the report is
   kept in ``RematBackend.reports``.
3. The forward and backward graphs are handed back in AOTAutograd's calling
   convention (``graph_transforms.aot_graphs``).
4. They run as plain fx code (``compiler="eager"``: the ``aot_eager`` executor, which
   frees each value at its last use; gradients equal eager's bit for bit on CPU) or are
   compiled by Inductor (``compiler="inductor"``: ``compile_fx`` with this partition as
   ``custom_partitioner_fn``; ``inductor_hooks`` keeps each graph's generated code and
   keeps Inductor from fusing kernels of different layers).
5. The callable handed back to Dynamo records each call (``step_recorder``): which
   graphs ran in a step, in which order, and which graph's output each input is.

The step. When a step ends (every backward it started has run), its graph calls are
composed into one timeline (``step_flow``, ``step_composition``): the forward outputs
held across a break, the gradients passed back, the zero tangents, the loss and its
tangent, the parameter gradients. ``RematBackend.step_report()`` returns it
(``step_report(shape)``: the latest step whose input had that shape; each step is
logged in ``RematBackend.step_log`` with the peak of the shapes that ran). With
``compiler="inductor"`` the graphs' timelines come from Inductor's generated code
(``inductor_memory``). The first step's report is written to ``report_dir`` and its
break cost is given by a ``GraphBreakWarning``.

Budgets bound the step. With ``schedule="optimized"``, each graph is planned when it
compiles against ``budget_bytes`` alone (the other graphs are not known yet); after the
first step, the schedules of all graphs are chosen together so that the composed step
fits (``step_planning``; with ``granularity="op"``, the op-level choices,
``step_op_planning``), and the graphs whose schedule changed are recompiled: from the
second step on, the step's peak is within the budget. A budget below the least
feasible step peak raises ``InfeasibleBudget`` at the end of the first step.

Dynamic shapes: the rewrite is shape-agnostic; the GraphReport's sizes are those of
the example that triggered the compile (``GraphReport.symbolic``), and the step report
evaluates every size at the shapes of the step that ran.

Inference graphs (``eval()`` models under ``no_grad``, or any graph with no input that
requires grad) are compiled without a partition and not recorded; their ids are listed
in ``RematBackend.inference_graphs``.

Errors (``on_error``): ``"raise"`` raises at compile time (a schedule the graph does
not allow, an unsupported graph) or at the end of the first step (a step that cannot
be composed, an infeasible step budget). ``"fallback"`` warns
(``RematFallbackWarning``) and runs the graphs concerned un-rewritten (AOTAutograd's or
Inductor's own partition) instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import CompileContext, TracingContext

from solvers.errors import infeasible

from . import schedule as schedules
from .backend_options import (
    REPORT_DIR_ENV,
    BackendOptions,
    InvalidBackendOption,
    check_compile_kwargs,
    default_op_schedule,
)
from .compiled_graphs import GraphReport, describe_graph_breaks, graph_markdown
from .costs import storage_nbytes
from .errors import LayerStackNotFound, RematError, StepNotComposable
from .formatting import fmt_bytes
from .graph_transforms import (
    aot_graphs,
    boundary_bytes,
    concrete_step,
    dynamo_joint,
    evaluate_size,
    output_roles,
    size_hint,
    symbol_sources,
    symbolic_size,
)
from .inductor_hooks import capture_inner_compile
from .inductor_memory import code_liveness
from .graph_schedule import GraphScheduler
from .inspection import dump_step
from .intervals import storage_bytes
from .liveness import analyze
from .module_paths import find_layer_stack_in_graph
from .regions import LayerStack, assign_layers_to_graph, forward_node_names
from .report import write_report
from .partition import Partition
from .rewrite import RewrittenStep, rewrite
from .step_flow import GraphCall, GraphLiveness, graph_liveness
from .step_op_planning import OpPlannedGraph, plan_step_op_level
from .step_planning import PlannedGraph, plan_step
from .step_recorder import RecordedGraph, RecordedStep, StepRecorder
from .step_report import CallSummary, StepReport, break_text, build_step_report, step_markdown
from .trace import JointGraph

__all__ = [
    "BackendOptions",
    "GraphBreakWarning",
    "GraphReport",
    "InvalidBackendOption",
    "NoLayerStackWarning",
    "RematBackend",
    "RematFallbackWarning",
    "StepLogEntry",
    "backend",
    "compile_remat",
    "registered_backend",
]

logger = logging.getLogger(__name__)


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
    """

    graph_id: str
    frame_id: int | None
    labels: tuple[str, ...]
    graph_break: str | None
    partial: bool


@dataclasses.dataclass(frozen=True)
class StepLogEntry:
    """One training step as logged: its number, the shapes of its first graph's
    non-parameter inputs, and the predicted peak of the step at those shapes (None:
    not composed, see ``note``)."""

    index: int
    input_shapes: tuple[Any, ...]
    peak_bytes: int | None
    note: str = ""


@dataclasses.dataclass
class _Graph:
    """The backend's state of one compiled training graph (what a recompile, the step
    composition and the Inductor model need)."""

    info: CompileInfo
    gm: fx.GraphModule
    example_inputs: list[Any]
    joint: JointGraph | None = None
    stack: LayerStack | None = None
    step: RewrittenStep | None = None  # as rewritten (sizes may be symbolic)
    report: GraphReport | None = None
    allocator: str = "cpu"
    param_indices: tuple[int, ...] = ()
    output_joint: tuple[int | None, ...] = ()
    output_tangent: tuple[int | None, ...] = ()
    symbols: tuple[tuple[int, int | None, Any], ...] = ()
    hints: dict[Any, int] = dataclasses.field(default_factory=dict)
    code: dict[str, str] = dataclasses.field(default_factory=dict)  # "forward" / "backward" -> Inductor code
    schedule: schedules.Schedule | Partition | None = None  # forced by the step planner
    plain: str | None = None  # why it runs un-rewritten (on_error="fallback")
    recorded: RecordedGraph | None = None
    liveness: dict[str, GraphLiveness] = dataclasses.field(default_factory=dict)

    @property
    def graph_id(self) -> str:
        return self.info.graph_id


def _current_compile_id() -> tuple[str, int | None]:
    cid = CompileContext.current_compile_id()
    if cid is None:
        return "", None
    return str(cid), getattr(cid, "frame_id", None)


def _compile_info(gm: fx.GraphModule, graph_id: str, frame: int | None, seen_break: bool) -> CompileInfo:
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
    )


class RematBackend:
    """A torch.compile backend that applies a recompute schedule to every training graph.

    Use ``backend(...)`` to make one; pass it as ``torch.compile(model, backend=b)``.

    Attributes:
        options: the BackendOptions.
        reports: one GraphReport per compiled training graph, in compile order (a graph
            recompiled by the step planner appears again).
        inference_graphs: ids of graphs compiled without a backward (no rewrite).
        step_log: one StepLogEntry per training step run.
        files: report files written (when a report folder is set).
    """

    def __init__(self, options: BackendOptions):
        self.options = options
        self.reports: list[GraphReport] = []
        self.inference_graphs: list[str] = []
        self.step_log: list[StepLogEntry] = []
        self.files: list[Path] = []
        self._graphs: dict[str, _Graph] = {}
        self._building: _Graph | None = None  # the graph being compiled
        self._recorder = StepRecorder(self._step_ended, self._not_composable)
        self._steps: dict[tuple, StepReport] = {}  # by RecordedStep.signature()
        self._signatures: list[tuple] = []  # per step_log entry
        self._first_step: StepReport | None = None
        self._count = 0
        self._seen_break = False
        self._scheduler = GraphScheduler(options)
        self.__name__ = "remat"

    def __repr__(self) -> str:
        o = self.options
        return (f"RematBackend(schedule={o.schedule!r}, recompute_num_layers={o.recompute_num_layers!r}, "
                f"compiler={o.compiler!r}, graphs={len(self.reports)})")

    @property
    def report_dir(self) -> Path | None:
        """Where reports are written: the option, else ``$REMAT_PASS_REPORT_DIR``, else None."""
        d = self.options.report_dir or os.environ.get(REPORT_DIR_ENV)
        return Path(d) if d else None

    # -- Dynamo entry point
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """Compile one Dynamo graph (the ``CompilerFn`` contract).

        Raises:
            InvalidBackendOption: ``torch.compile`` passed a ``mode`` other than
                ``"default"`` or ``options`` (give them to ``remat_pass.backend``).
        """
        check_compile_kwargs(kwargs, given_to="remat_pass.backend(...)")
        graph_id, frame = _current_compile_id()
        if not graph_id:
            graph_id = f"graph{self._count}"
        self._count += 1
        info = _compile_info(gm, graph_id, frame, self._seen_break)
        self._seen_break = self._seen_break or info.graph_break is not None
        g = _Graph(info, gm, list(example_inputs))
        compiled = self._compile(g)
        if g.report is None and g.plain is None:
            self.inference_graphs.append(graph_id)
            return compiled
        self._graphs[graph_id] = g
        g.recorded = self._recorder.wrap(graph_id, compiled, g.param_indices)
        return g.recorded

    def _compile(self, g: _Graph) -> Callable[..., Any]:
        """Compile ``g`` rewritten; on a RematError, un-rewritten when ``on_error`` says so."""
        self._building = g
        try:
            return self._compile_inductor(g) if self.options.compiler == "inductor" else self._compile_eager(g)
        except RematError as e:
            if self.options.on_error != "fallback":
                raise
            self._fallback_warning(g, e)
            return self._compile_plain(g)
        finally:
            self._building = None

    def _note_forward(self, g: _Graph, num_fwd_outputs: int, num_tangents: int) -> None:
        """Read AOTAutograd's output metadata while the forward compiles."""
        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is not None or not g.output_joint:
            g.output_joint, g.output_tangent = output_roles(meta, num_fwd_outputs, num_tangents)

    def _compile_eager(self, g: _Graph) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        def forward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            if g.step is not None:
                self._note_forward(g, g.step.num_fwd_outputs, len(g.joint.tangents))
            return boxed_nop(gm, example_inputs)

        return aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=boxed_nop,
            partition_fn=self.partition,
            keep_inference_input_mutations=True,
        )(g.gm, g.example_inputs)

    def _compile_inductor(self, g: _Graph) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        backend = self

        class _Partitioner(CustomPartitionerFn):
            def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kw: Any):
                kw.pop("compiler", None)
                return backend.partition(joint, joint_inputs, **kw)

            def uuid(self) -> None:
                return None  # no caching: every compile must run the partition (and report)

        def on_code(kind: str, code: str) -> None:
            if g.step is None:
                return  # an inference graph
            g.code[kind] = code
            g.liveness.pop("inductor", None)
            if kind == "forward":
                self._note_forward(g, g.step.num_fwd_outputs, len(g.joint.tangents))

        # The caches would key on the partitioner object (not picklable: it holds this
        # backend) and a hit would skip the partition, and with it the report.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(
                g.gm, g.example_inputs, inner_compile=capture_inner_compile(on_code),
                config_patches={"custom_partitioner_fn": _Partitioner(), "fx_graph_cache": False},
            )

    def _compile_plain(self, g: _Graph) -> Callable[..., Any]:
        """``g`` compiled without this pass (AOTAutograd's or Inductor's own partition)."""
        if g.plain is None:
            g.plain = "un-rewritten"
        if self.options.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(g.gm, g.example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                            keep_inference_input_mutations=True)(g.gm, g.example_inputs)

    def _fallback_warning(self, g: _Graph, error: Exception) -> None:
        g.plain = f"{type(error).__name__}: {error}"
        warnings.warn(f"remat-pass: graph {g.graph_id} runs un-rewritten (on_error='fallback') because "
                      f"of {g.plain}", RematFallbackWarning, stacklevel=3)

    # -- AOTAutograd partition
    def partition(
        self,
        joint: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        **kwargs: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd's ``partition_fn``: the joint graph -> (forward, backward).

        Args:
            joint: AOTAutograd's joint graph (``primals_*`` then ``tangents_*``).
            joint_inputs: its example inputs (unused).
            num_fwd_outputs: forward outputs among the joint's outputs.
            kwargs: ``static_lifetime_input_indices`` (parameters; used only for labels).

        Returns:
            ``(forward, backward)`` in AOTAutograd's calling convention (``aot_graphs``).

        Raises:
            InvalidSchedule: K / N outside the range of the graph's layer stack.
            InfeasibleBudget: ``optimized`` and no schedule fits the budget (a graph
                that holds the whole step; otherwise decided after the first step).
            UnsupportedGraph: RNG functionalization is on (seed / offset placeholders),
                or the joint mutates a value in place.
        """
        start = time.perf_counter()
        g = self._building or _Graph(CompileInfo(f"graph{self._count}", None, (), None, self._seen_break),
                                     joint, [])
        info = g.info
        static = tuple(kwargs.get("static_lifetime_input_indices") or ())
        joint_graph, mutations = dynamo_joint(joint, num_fwd_outputs, static, info.labels, info.graph_id)
        stack = self._stack_for(joint_graph, info)
        devices = {v.device.type for v in joint_graph.primal_values if isinstance(v, torch.Tensor)}
        g.allocator = "cuda" if "cuda" in devices else "cpu"
        if g.schedule is not None:
            sched = g.schedule
        elif self.options.op_level and stack.num_layers:
            sched = self._scheduler.op_level(joint_graph, stack, g.allocator, info.graph_id, info.partial)
        elif self.options.schedule == "optimized" and stack.num_layers:
            sched = self._scheduler.optimized(joint_graph, stack, info.graph_id, info.frame_id, info.partial,
                                              g.allocator, self.reports)
        else:
            sched = self.options.make_schedule(stack.num_layers)
        step = rewrite(joint_graph, stack, sched)
        fw, bw = aot_graphs(step, mutations)
        for gm in (fw, bw):  # the layer of every node, for Inductor's fusion choices
            for n in gm.graph.nodes:
                n.meta["remat_layer"] = step.layer_of.get(n.name)
        g.joint, g.stack, g.step, g.param_indices = joint_graph, stack, step, static
        g.symbols = symbol_sources(joint_graph.primal_values)
        g.hints = _hints(joint_graph)
        g.liveness.clear()
        g.report = self._graph_report(info, step, stack, joint_graph, num_fwd_outputs, g.allocator,
                                      time.perf_counter() - start)
        self.reports.append(g.report)
        self._write(g.report)
        self._warn_graph_breaks()
        return fw, bw

    def _graph_report(self, info: CompileInfo, step: RewrittenStep, stack: LayerStack, joint: JointGraph,
                      num_fwd_outputs: int, allocator: str, pass_time_s: float) -> GraphReport:
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
            memory=analyze(concrete, memory=self._scheduler.memory_model(concrete, allocator)),
            step=concrete,
        )

    def _stack_for(self, joint: JointGraph, info: CompileInfo) -> LayerStack:
        """The graph's layer stack; after a graph break the stack may continue in another
        graph, so K / N may exceed the layers seen here (the stack is widened to K)."""
        stack = self._layer_stack(joint.gm, joint.num_fwd_outputs, info.graph_id)
        k = self.options.recompute_num_layers
        if info.partial and stack.num_layers and k and self.options.schedule in ("uniform", "block"):
            total = max(stack.num_layers, k)
            stack = dataclasses.replace(stack, child_names=tuple(str(i) for i in range(total)), num_layers=total)
        return stack

    def _layer_stack(self, joint: fx.GraphModule, num_fwd_outputs: int, graph_id: str) -> LayerStack:
        # after a break, a graph may hold a single layer of the stack an earlier graph
        # found (one child is not enough for the search): look for that path first
        earlier = [r.layer_stack for r in self.reports if r.layer_stack]
        try:
            if self.options.layers is None and earlier:
                try:
                    path, children = find_layer_stack_in_graph(joint, earlier[-1])
                    return assign_layers_to_graph(joint, num_fwd_outputs, path, children)
                except LayerStackNotFound:
                    pass
            path, children = find_layer_stack_in_graph(joint, self.options.layers)
            return assign_layers_to_graph(joint, num_fwd_outputs, path, children)
        except LayerStackNotFound as e:
            # a graph outside the stack (the loss after a graph break) is expected once
            # another graph holds the stack; warn only while no graph has held it
            if self.options.schedule != "none" and not any(
                r.layer_stack is not None for r in self.reports
            ):
                warnings.warn(
                    f"remat-pass: graph {graph_id} holds no layer of the stack, so it is "
                    f"compiled with schedule none instead of {self.options.schedule}: {e}",
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

    # -- the step
    def step_report(self, shape: Sequence[int] | None = None) -> StepReport | None:
        """The composed report of the latest training step (None before a step has
        ended, or when its graphs run un-rewritten).

        Args:
            shape: the shape of the step's first non-parameter input (``ids.shape``):
                the latest step that ran with it (under dynamic shapes, the report of
                that shape). None: the latest step.

        Raises:
            KeyError: no step ran with ``shape`` (the message lists the shapes seen).
        """
        want = None if shape is None else tuple(shape)
        for entry, sig in zip(reversed(self.step_log), reversed(self._signatures)):
            if want is None or (entry.input_shapes and entry.input_shapes[0] == want):
                return self._steps.get(sig)
        if want is None:
            return None
        seen = sorted({e.input_shapes[0] for e in self.step_log if e.input_shapes})
        raise KeyError(f"no step ran with input shape {list(want)}; shapes seen: {[list(s) for s in seen]}")

    def _step_ended(self, rec: RecordedStep) -> None:
        """A step ended: compose it, log it; after the first, re-plan and warn."""
        sig = rec.signature()
        first = rec.calls[0] if rec.calls else None
        shapes = tuple(s for s in (first.shapes if first else ()) if isinstance(s, tuple))
        report, note = self._steps.get(sig), ""
        if rec.problems:
            note = "; ".join(rec.problems)
            self._not_composable(note)
        elif report is None:
            plain = [g.graph_id for g in self._graphs.values() if g.plain]
            missing = [c.graph_id for c in rec.calls if c.graph_id not in self._graphs]
            if plain or missing:
                note = f"graphs {plain or missing} run un-rewritten or were not recorded"
            else:
                report = self._compose(rec)
                self._steps[sig] = report
        self.step_log.append(StepLogEntry(rec.index, shapes, report.peak_bytes if report else None, note))
        self._signatures.append(sig)
        if report is not None:
            logger.info("remat-pass step %d, input shapes %s: predicted step peak %s", rec.index,
                        [list(s) for s in shapes], fmt_bytes(report.peak_bytes))
        if report is not None and self._first_step is None:
            self._first_step = report
            self._after_first_step(rec, report)

    def _not_composable(self, why: str) -> None:
        error = StepNotComposable(
            f"the training step cannot be composed into one timeline: {why}. The backend models "
            "one forward of every graph, then one loss.backward() running their backwards in "
            "reverse (autograd's order); call backward once per step on one loss, or compile with "
            "on_error='fallback' to run the graphs un-rewritten")
        if self.options.on_error != "fallback":
            raise error
        for g in self._graphs.values():
            if g.plain is None and g.recorded is not None:
                self._fallback_warning(g, error)
                # a training graph, recompiled from inside a backward, where grad mode is
                # off (AOTAutograd would compile an inference graph)
                with torch.enable_grad():
                    g.recorded.replace(self._compile_plain(g))
        self._steps.clear()  # no step of these graphs is composed any more

    def _binding(self, g: _Graph, shapes: Sequence[Any]) -> dict[Any, int]:
        values = {}
        for i, dim, sym in g.symbols:
            s = shapes[i] if i < len(shapes) else None
            if dim is None and isinstance(s, int):
                values[sym] = s
            elif dim is not None and isinstance(s, tuple) and dim < len(s):
                values[sym] = s[dim]
        return values

    def _liveness(self, g: _Graph, step: RewrittenStep | None = None) -> GraphLiveness:
        """The graph's liveness for the step (sizes symbolic where the graph's are):
        from Inductor's code when it was captured, else from the fx graphs; ``step``:
        another rewrite of the graph (the step planner's candidates, fx)."""
        if step is not None:
            # op scratch as the per-graph reports count it (calibrated where the sizes are
            # concrete; a node with symbolic sizes falls back to the memory model's rule)
            memory = self._scheduler.memory_model(concrete_step(step)[0], g.allocator)

            def scratch_of(n: fx.Node) -> Any:
                m = memory.node_memory(n)
                return symbolic_size(0 if m is None else m.scratch_bytes)

            return graph_liveness(g.graph_id, step, lambda v: symbolic_size(_storage_size(v, g.allocator)),
                                  scratch_of)
        model = "inductor" if self.options.compiler == "inductor" and "backward" in g.code else "fx"
        if model not in g.liveness:
            fx_model = g.liveness.get("fx") or self._liveness(g, g.step)
            g.liveness["fx"] = fx_model
            if model == "inductor":
                dtypes = {n.name: n.meta["val"].dtype for gm in (g.step.forward, g.step.backward)
                          for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
                g.liveness[model] = code_liveness(
                    g.graph_id, g.code["forward"], g.code["backward"], g.step.num_fwd_outputs,
                    fx_model.tangent_nbytes, dtypes, {str(sym): sym for sym in g.hints}, len(g.joint.primals))
        return g.liveness[model]

    def _compose(self, rec: RecordedStep, steps: dict[str, RewrittenStep] | None = None) -> StepReport:
        """The StepReport of a recorded step; ``steps`` replaces graphs' rewrites."""
        steps = steps or {}
        kept = rec.grad_kept_in_order()
        calls, summaries, seen = [], [], {}
        for c, k in zip(rec.calls, kept):
            g = self._graphs[c.graph_id]
            seen[c.graph_id] = seen.get(c.graph_id, 0) + 1
            label = c.graph_id if seen[c.graph_id] == 1 else f"{c.graph_id}#{seen[c.graph_id]}"
            values = self._binding(g, c.shapes)
            live = self._liveness(g, steps.get(c.graph_id)).map_sizes(lambda b: evaluate_size(b, values, g.hints))
            calls.append(GraphCall(live, label, c.inputs_from, g.output_joint, g.output_tangent, k))
            summaries.append(CallSummary(label, g.graph_id, g.report.schedule, g.report.layers, c.shapes,
                                         g.report.peak_bytes))
        model = "inductor" if self.options.compiler == "inductor" else "fx"
        notes = [f"eager code between graphs ({', '.join(rec.eager_inputs)})"] if rec.eager_inputs else []
        if model == "inductor" and (steps or any("backward" not in self._graphs[c.graph_id].code
                                                 for c in rec.calls)):
            model = "fx"
            if not steps:
                notes.append("Inductor's code was not captured; the fx graphs are used")
        return build_step_report(rec.index, model, calls, summaries, rec.backward_order, notes)

    def _after_first_step(self, rec: RecordedStep, report: StepReport) -> None:
        if self.options.schedule == "optimized":
            report = self._replan_op_level(rec, report) if self.options.op_level else self._replan(rec, report)
        self._write_step(report)
        if len(rec.calls) > 1:
            warnings.warn(self.graph_breaks(), GraphBreakWarning, stacklevel=2)

    def _replan(self, rec: RecordedStep, report: StepReport) -> StepReport:
        """Choose every graph's schedule against the composed step (``step_planning``,
        on the fx graphs) and recompile the graphs whose schedule changed.

        Raises:
            InfeasibleBudget: the budget is below the least feasible step peak
                (``on_error="fallback"``: warned, and the least feasible schedules run).
        """
        graphs = {c.graph_id: self._graphs[c.graph_id] for c in rec.calls}
        planned = [PlannedGraph(gid, g.joint, g.stack, g.step.schedule) for gid, g in graphs.items()
                   if g.stack is not None and g.stack.num_layers and g.plain is None]
        if not planned:
            return report

        def step_peak(chosen: dict[str, schedules.Schedule]) -> int:
            steps = {gid: rewrite(graphs[gid].joint, graphs[gid].stack, s) for gid, s in chosen.items()
                     if s != graphs[gid].step.schedule}
            return self._compose(rec, steps).peak_bytes

        budget = int(self.options.budget_bytes)
        plan = plan_step(planned, step_peak, budget,
                         lambda p, s: self._scheduler.predict(p.joint, p.stack, s, graphs[p.graph_id].allocator))
        least = ", ".join(f"{gid}: {s.provenance}" for gid, s in plan.least_feasible.items())
        changed = {gid: s for gid, s in plan.schedules.items() if s != graphs[gid].step.schedule}
        return self._apply_step_plan(rec, changed, plan.feasible, plan.least_feasible_peak_bytes, least)

    def _replan_op_level(self, rec: RecordedStep, report: StepReport) -> StepReport:
        """``granularity="op"``: every graph's op-level choice picked against the composed
        step (``step_op_planning``, on the fx graphs); the graphs whose choice changed
        are recompiled.

        Raises:
            InfeasibleBudget: as ``_replan``.
        """
        graphs = {c.graph_id: self._graphs[c.graph_id] for c in rec.calls}
        planned = [OpPlannedGraph(gid, *self._scheduler.op_plans[gid]) for gid, g in graphs.items()
                   if gid in self._scheduler.op_plans and g.plain is None and g.schedule is None]
        if not planned:
            return report
        plan = plan_step_op_level(planned, lambda steps: self._compose(rec, steps).peak_bytes,
                                  int(self.options.budget_bytes))
        least = ", ".join(f"{gid}: op-level options {s.options or 'all 0'}, groups {list(s.groups)}"
                          for gid, s in plan.least_feasible.items())
        changed = {p.graph_id: plan.partitions[p.graph_id] for p in planned
                   if plan.solutions[p.graph_id] != p.solution}
        return self._apply_step_plan(rec, changed, plan.feasible, plan.least_feasible_peak_bytes, least)

    def _apply_step_plan(self, rec: RecordedStep, changed: dict[str, schedules.Schedule | Partition],
                         feasible: bool, least_peak_bytes: int, least: str) -> StepReport:
        """Raise (or warn) when the step plan does not fit, recompile the graphs whose
        schedule ``changed``, and return the composed report of ``rec`` with them."""
        if not feasible:
            error = infeasible(int(self.options.budget_bytes), least_peak_bytes, f"the step with {least}")
            if self.options.on_error != "fallback":
                raise error
            warnings.warn(f"remat-pass: {error}; running the least feasible schedules (on_error='fallback')",
                          RematFallbackWarning, stacklevel=4)
        for gid, sched in changed.items():
            g = self._graphs[gid]
            g.schedule = sched
            with torch.enable_grad():  # a training graph, recompiled at the end of a backward
                g.recorded.replace(self._compile(g))
        self._steps.clear()  # the graphs changed: compose the next steps anew
        return self._compose(rec)

    # -- reports
    def _write(self, report: GraphReport) -> None:
        folder = self.report_dir
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        stem = "graph_" + report.graph_id.replace("/", "_")
        js = folder / f"{stem}.json"
        js.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        md = folder / f"{stem}.md"
        md.write_text(graph_markdown(report), encoding="utf-8")
        self.files += [js, md]
        self.files.append(dump_step(report.step, report.memory, folder, stem,
                                    meta={"graph_id": report.graph_id, "schedule": report.schedule}))

    def _write_step(self, report: StepReport) -> None:
        folder = self.report_dir
        if folder is None:
            return
        js, md = folder / "step.json", folder / "step.md"
        write_report(js, report.to_dict())
        md.write_text(step_markdown(report), encoding="utf-8")
        self.files += [js, md]

    def graph_breaks(self) -> str:
        """``compiled_graphs.describe_graph_breaks`` of the latest graph of every frame
        (empty when all training graphs come from one frame), and once a step has run,
        the step's peak and the bytes the breaks cost there."""
        text = describe_graph_breaks(self.reports)
        if text and self._first_step is not None:
            text += "\n  " + break_text(self._first_step)
        return text

    def _warn_graph_breaks(self) -> None:
        text = self.graph_breaks()
        if text:
            warnings.warn(text, GraphBreakWarning, stacklevel=2)


def _storage_size(val: torch.Tensor, allocator: str) -> Any:
    """Bytes of ``val``'s storage (a SymInt under dynamic shapes), rounded as the CUDA
    allocator does for ``allocator="cuda"`` when concrete."""
    n = storage_nbytes(val)
    return storage_bytes(val, allocator) if isinstance(n, int) else n


def _hints(joint: JointGraph) -> dict[Any, int]:
    """The example value of every shape symbol of the graph (its compile-time hints)."""
    for v in joint.primal_values:
        env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
        if env is None and isinstance(v, torch.SymInt):
            env = v.node.shape_env
        if env is not None:
            hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
            return {s: int(h) for s, h in hints.items()}
    return {}


def backend(
    schedule: str | None = None,
    recompute_num_layers: int | None = 4,
    budget_bytes: int | None = None,
    compiler: str = "eager",
    layers: str | None = None,
    report_dir: str | os.PathLike | None = None,
    *,
    calibrate: bool = True,
    on_error: str = "raise",
    num_layers: int | None = None,
    granularity: str = "layer",
    recompute_modules: Sequence[str] = (),
    policy: str | None = None,
    policy_names: Sequence[str] = (),
    module_names: dict[str, Sequence[str]] | None = None,
    flops_per_byte: int = 8,
) -> RematBackend:
    """A torch.compile backend that recomputes layers by a Megatron-LM schedule.

    Args:
        schedule: ``"none"``, ``"uniform"`` (``--recompute-method uniform``) or
            ``"block"`` (``--recompute-method block``), or ``"optimized"``. Default:
            ``"uniform"``; with ``granularity="op"``, ``"optimized"`` when a budget is
            given, else ``"none"``.
        recompute_num_layers: K (uniform, 1..L) or N (block, 0..L), as
            ``--recompute-num-layers``; L is checked per compiled graph.
        budget_bytes: with ``schedule="optimized"``, the peak activation bytes allowed
            for the training step (an int, or a size with a unit such as ``"80MiB"``);
            every graph is planned alone when it compiles, then, after the first step,
            all graphs together against the composed step (``InfeasibleBudget``,
            carrying the least feasible step peak, when none fits).
        compiler: ``"eager"`` (fx graphs as they are; gradients equal eager's on CPU)
            or ``"inductor"``.
        layers: the layer stack's module path (``"transformer.h"``) when it is not
            found automatically.
        report_dir: write each graph's report there (``graph_<frame>_<n>.json``,
            ``.md`` and ``.remat.json`` for ``remat-pass inspect --graph``) and the
            first step's report (``step.json``, ``step.md``: ``step_report()``); None:
            ``$REMAT_PASS_REPORT_DIR`` if set.
        calibrate: calibrate op scratch on this CPU for the predicted peaks (cached
            under ``~/.cache/remat-pass``); False: the ATen formula table only.
        on_error: ``"raise"`` (default) or ``"fallback"``: run a graph the pass cannot
            handle (or every graph of a step that cannot be composed) un-rewritten,
            with a ``RematFallbackWarning``.
        num_layers: the old name of ``recompute_num_layers`` (deprecated: it is K or N,
            not the number of layers L).
        granularity: ``"layer"`` or ``"op"`` (see ``BackendOptions``): op-level
            partitions, the optimum under ``budget_bytes``, or
            ``recompute_modules=["core_attn"]`` (Megatron-LM's selective recompute),
            or ``policy="dots_saveable"`` (JAX's save policies; ``policy_names`` for
            the ``*_names`` ones), in the layers the schedule stores.
        module_names: ``{kind: module paths inside a layer}`` for module kinds that
            are not recognised.
        flops_per_byte: the op-level cost model's machine balance.

    Returns:
        A RematBackend; its ``reports`` fill as graphs compile (on the first call).

    Raises:
        InvalidSchedule, InvalidBackendOption: see BackendOptions.

    Example:
        >>> import remat_pass, torch
        >>> from remat_pass.models import TinyGPT
        >>> b = remat_pass.backend(schedule="uniform", recompute_num_layers=2)
        >>> model = TinyGPT(vocab=64, hidden=32, heads=2, layers=4, seq=16)
        >>> ids = torch.randint(0, 64, (2, 16))
        >>> torch.compile(model, backend=b)(ids).sum().backward()
        >>> r = b.reports[0]
        >>> r.schedule, r.layer_stack, r.layers, [s.layers for s in r.step.segments]
        ('uniform(K=2)', 'blocks', (0, 1, 2, 3), [(2, 3), (0, 1)])
    """
    if num_layers is not None:
        warnings.warn("remat_pass.backend(num_layers=) is deprecated (it is K or N, not the number of layers L); "
                      "use recompute_num_layers=", DeprecationWarning, stacklevel=2)
        recompute_num_layers = num_layers
    if schedule is None:
        schedule = default_op_schedule(budget_bytes) if granularity == "op" else "uniform"
    return RematBackend(BackendOptions(
        schedule=schedule,
        recompute_num_layers=recompute_num_layers,
        budget_bytes=budget_bytes,
        compiler=compiler,
        layers=layers,
        report_dir=None if report_dir is None else str(report_dir),
        calibrate=calibrate,
        granularity=granularity,
        recompute_modules=tuple(recompute_modules),
        policy=policy,
        policy_names=tuple(policy_names),
        module_names=tuple((k, tuple(v)) for k, v in (module_names or {}).items()),
        flops_per_byte=flops_per_byte,
        on_error=on_error,
    ))


_REGISTERED: dict[BackendOptions, RematBackend] = {}


def registered_backend(options: dict[str, Any] | None = None) -> RematBackend:
    """The RematBackend that ``torch.compile(backend="remat", options=options)`` uses
    (one per distinct options, kept for the process), to read its ``reports``.

    Raises:
        InvalidBackendOption, InvalidSchedule: see BackendOptions.
    """
    opts = BackendOptions.from_dict(options)
    if opts not in _REGISTERED:
        _REGISTERED[opts] = RematBackend(opts)
    return _REGISTERED[opts]


def compile_remat(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``remat`` entry of ``torch_dynamo_backends``: torch.compile calls it as
    ``compile_remat(gm, example_inputs, options=...)``.

    Raises:
        InvalidBackendOption: a ``mode`` was given (use ``options={"compiler": ...}``) or
            an unknown option key.
        InvalidSchedule: see BackendOptions.
    """
    check_compile_kwargs({"mode": mode}, given_to="options={...}")
    return registered_backend(options)(gm, example_inputs)
