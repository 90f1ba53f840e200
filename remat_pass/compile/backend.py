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
composed into one timeline (``backend_steps``; ``step_flow``, ``step_composition``):
the forward outputs held across a break, the gradients passed back, the zero tangents,
the loss and its tangent, the parameter gradients. ``RematBackend.step_report()`` returns it
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

import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import CompileContext, TracingContext

from .graph import (
    BackendGraph,
    CompileInfo,
    GraphBreakWarning,
    NoLayerStackWarning,
    RematFallbackWarning,
    compile_info,
    fallback_warning,
    graph_layer_stack,
    graph_report,
    report_folder,
    write_graph_report,
)
from .options import (  # noqa: F401 - REPORT_DIR_ENV: part of the backend's public names
    REPORT_DIR_ENV,
    BackendOptions,
    InvalidBackendOption,
    check_compile_kwargs,
    default_op_schedule,
)
from .steps import BackendSteps, StepLogEntry
from .compiled_graphs import GraphReport
from ..errors import RematError
from .graph_schedule import GraphScheduler
from .graph_transforms import aot_graphs, dynamo_joint, output_roles
from ..liveness.symbolic_sizes import shape_hints, symbol_sources
from .inductor_hooks import capture_inner_compile
from ..recompute.rewrite import rewrite
from .step_recorder import StepRecorder
from ..report.step_report import StepReport

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

def _current_compile_id() -> tuple[str, int | None]:
    cid = CompileContext.current_compile_id()
    if cid is None:
        return "", None
    return str(cid), getattr(cid, "frame_id", None)


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
        self.files: list[Path] = []
        self._graphs: dict[str, BackendGraph] = {}
        self._building: BackendGraph | None = None  # the graph being compiled
        self._count = 0
        self._seen_break = False
        self._scheduler = GraphScheduler(options)
        self._steps = BackendSteps(options, self._scheduler, self._graphs, self.reports, self.files,
                                   self._compile, self._compile_plain)
        self._recorder = StepRecorder(self._steps.step_ended, self._steps.not_composable)
        self.__name__ = "remat"

    def __repr__(self) -> str:
        o = self.options
        return (f"RematBackend(schedule={o.schedule!r}, recompute_num_layers={o.recompute_num_layers!r}, "
                f"compiler={o.compiler!r}, graphs={len(self.reports)})")

    @property
    def report_dir(self) -> Path | None:
        """Where reports are written: the option, else ``$REMAT_PASS_REPORT_DIR``, else None."""
        return report_folder(self.options)

    @property
    def step_log(self) -> list[StepLogEntry]:
        """One StepLogEntry per training step run."""
        return self._steps.log

    # -- Dynamo entry point
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """Compile one Dynamo graph (the ``CompilerFn`` contract).

        Raises:
            InvalidBackendOption: ``torch.compile`` passed a ``mode`` other than
                ``"default"`` or ``options`` (give them to ``remat_pass.compile.backend``).
        """
        check_compile_kwargs(kwargs, given_to="remat_pass.backend(...)")
        graph_id, frame = _current_compile_id()
        if not graph_id:
            graph_id = f"graph{self._count}"
        self._count += 1
        info = compile_info(gm, graph_id, frame, self._seen_break)
        self._seen_break = self._seen_break or info.graph_break is not None
        g = BackendGraph(info, gm, list(example_inputs))
        compiled = self._compile(g)
        if g.report is None and g.plain is None:
            self.inference_graphs.append(graph_id)
            return compiled
        self._graphs[graph_id] = g
        g.recorded = self._recorder.wrap(graph_id, compiled, g.param_indices)
        return g.recorded

    def _compile(self, g: BackendGraph) -> Callable[..., Any]:
        """Compile ``g`` rewritten; on a RematError, un-rewritten when ``on_error`` says so."""
        self._building = g
        try:
            return self._compile_inductor(g) if self.options.compiler == "inductor" else self._compile_eager(g)
        except RematError as e:
            if self.options.on_error != "fallback":
                raise
            fallback_warning(g, e)
            return self._compile_plain(g)
        finally:
            self._building = None

    def _note_forward(self, g: BackendGraph, num_fwd_outputs: int, num_tangents: int) -> None:
        """Read AOTAutograd's output metadata while the forward compiles."""
        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is not None or not g.output_joint:
            g.output_joint, g.output_tangent = output_roles(meta, num_fwd_outputs, num_tangents)

    def _compile_eager(self, g: BackendGraph) -> Callable[..., Any]:
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

    def _compile_inductor(self, g: BackendGraph) -> Callable[..., Any]:
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

    def _compile_plain(self, g: BackendGraph) -> Callable[..., Any]:
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
        g = self._building or BackendGraph(CompileInfo(f"graph{self._count}", None, (), None, self._seen_break),
                                           joint, [])
        info = g.info
        static = tuple(kwargs.get("static_lifetime_input_indices") or ())
        joint_graph, mutations = dynamo_joint(joint, num_fwd_outputs, static, info.labels, info.graph_id)
        stack = graph_layer_stack(joint_graph, info, self.options, self.reports)
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
        g.hints = shape_hints(joint_graph)
        g.liveness.clear()
        g.report = graph_report(info, step, stack, joint_graph, num_fwd_outputs, g.allocator, self._scheduler,
                                time.perf_counter() - start)
        self.reports.append(g.report)
        folder = self.report_dir
        if folder is not None:
            self.files += write_graph_report(folder, g.report)
        self._warn_graph_breaks()
        return fw, bw

    # -- the step
    def step_report(self, shape: Sequence[int] | None = None) -> StepReport | None:
        """The composed report of the latest training step (None before a step has
        ended, or when its graphs run un-rewritten); ``BackendSteps.step_report``.

        Args:
            shape: the shape of the step's first non-parameter input (``ids.shape``):
                the latest step that ran with it (under dynamic shapes, the report of
                that shape). None: the latest step.

        Raises:
            KeyError: no step ran with ``shape`` (the message lists the shapes seen).
        """
        return self._steps.step_report(shape)

    def graph_breaks(self) -> str:
        """``compiled_graphs.describe_graph_breaks`` of the latest graph of every frame
        and, once a step has run, the bytes the breaks cost there
        (``BackendSteps.graph_breaks``)."""
        return self._steps.graph_breaks()

    def _warn_graph_breaks(self) -> None:
        text = self.graph_breaks()
        if text:
            warnings.warn(text, GraphBreakWarning, stacklevel=2)


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
        schedule: ``"none"``, ``"uniform"`` or ``"block"`` (``--recompute-method``), or
            ``"optimized"``. Default: ``"uniform"``; with ``granularity="op"``,
            ``"optimized"`` when a budget is given, else ``"none"``.
        recompute_num_layers: K (uniform, 1..L) or N (block, 0..L), as
            ``--recompute-num-layers``; L is checked per compiled graph.
        budget_bytes: with ``schedule="optimized"``, the peak activation bytes allowed
            for the training step (an int, or a size with a unit such as ``"80MiB"``);
            each graph is planned alone when it compiles, all together after the first
            step (``InfeasibleBudget``, with the least feasible step peak, if none fits).
        compiler: ``"eager"`` (the fx graphs; gradients equal eager's on CPU) or ``"inductor"``.
        layers: the layer stack's module path (``"transformer.h"``); None: found automatically.
        report_dir: write each graph's report there (``graph_<frame>_<n>.json``, ``.md``,
            ``.remat.json`` for ``remat-pass inspect --graph``) and the first step's
            (``step.json``, ``step.md``); None: ``$REMAT_PASS_REPORT_DIR`` if set.
        calibrate: calibrate op scratch on this CPU for the predicted peaks (cached
            under ``~/.cache/remat-pass``); False: the ATen formula table only.
        on_error: ``"raise"`` (default) or ``"fallback"``: run a graph the pass cannot
            handle (or all graphs of a step that cannot be composed) un-rewritten, with
            a ``RematFallbackWarning``.
        num_layers: deprecated name of ``recompute_num_layers`` (it is K or N, not L).
        granularity: ``"layer"`` or ``"op"`` (see ``BackendOptions``): op-level
            partitions, the optimum under ``budget_bytes``, or
            ``recompute_modules=["core_attn"]`` (Megatron-LM's selective recompute),
            or ``policy="dots_saveable"`` (JAX's save policies; ``policy_names`` for
            the ``*_names`` ones), in the layers the schedule stores.
        module_names: ``{kind: module paths inside a layer}`` for kinds not recognised.
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
        schedule=schedule, recompute_num_layers=recompute_num_layers, budget_bytes=budget_bytes,
        compiler=compiler, layers=layers, report_dir=None if report_dir is None else str(report_dir),
        calibrate=calibrate, granularity=granularity, recompute_modules=tuple(recompute_modules),
        policy=policy, policy_names=tuple(policy_names),
        module_names=tuple((k, tuple(v)) for k, v in (module_names or {}).items()),
        flops_per_byte=flops_per_byte, on_error=on_error,
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
