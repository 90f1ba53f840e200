"""The torch.compile backend: AOTAutograd with this project's partition, and a liveness
report for every compiled graph.

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
   stack (``optimized``: solved for this graph under ``budget_bytes`` by
   ``planner.Planner``) and rewrites (``rewrite.rewrite``). ``liveness.analyze`` predicts the graph's
   peak; the report is kept in ``RematBackend.reports``.
3. The forward and backward graphs are handed back in AOTAutograd's calling
   convention (``partitioners._extract_fwd_bwd_modules``): forward returns its outputs,
   then the saved tensors, then the saved SymInts; backward takes the saved SymInts,
   then the saved tensors, then the tangents (``graph_transforms.aot_graphs``). The primals that the rewritten backward
   reads (parameters, inputs) are returned by forward as saved tensors: saving a primal
   costs no activation memory.
4. They run as plain fx code (``compiler="eager"``: the ``aot_eager`` executor, which
   frees each value at its last use; gradients equal eager's bit for bit on CPU) or are
   compiled by Inductor (``compiler="inductor"``: ``compile_fx`` with this partition as
   ``torch._inductor.config.custom_partitioner_fn``, so Inductor's decompositions and
   joint-graph passes run first).

Inference graphs (``eval()`` models under ``no_grad``, or any graph with no input that
requires grad) are compiled without a partition: nothing is rewritten and no report is
made; their ids are listed in ``RematBackend.inference_graphs``.

Graph breaks: each graph gets its own layer mapping (layer indices are the stack's
child indices, the same in every graph). A recompute group cannot span a break: each
graph recomputes the part of a group it holds, from its own saved inputs, and the
tensors crossing the break are held by the next graph. When a second frame's graph is
compiled, a ``GraphBreakWarning`` lists the graphs, their layers, the layers split
across graphs, and the bytes that cross each break.

Dynamic shapes (Dynamo recompiles with a symbolic batch after a second shape): the
rewrite is shape-agnostic; the report's sizes are those of the example that triggered
the compile (``GraphReport.symbolic`` is True), evaluated with
``symbolic_shapes.optimization_hint``, which adds no guard.

Options are validated when the backend is made (``backend_options.BackendOptions``);
the calling-convention and size transforms are pure functions in
``graph_transforms.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import CompileContext

from . import schedule as schedules
from .backend_options import REPORT_DIR_ENV, BackendOptions, InvalidBackendOption, default_op_schedule
from .calibration import Calibrator
from .compiled_graphs import GraphReport, describe_graph_breaks, graph_markdown
from .errors import LayerStackNotFound, UnsupportedGraph
from .graph_transforms import (
    aot_graphs,
    boundary_bytes,
    concrete_step,
    dynamo_joint,
    is_symbolic_tensor,
    size_hint,
)
from .inspection import dump_step
from .liveness import MemoryReport, analyze
from .memory_model import MemoryModel
from .op_planner import CostModel, OpPlanner
from .partition import Partition
from .planner import Planner
from .policies import recompute_modules, save_policy
from .regions import LayerStack, assign_layers_to_graph, find_layer_stack_in_graph, forward_node_names
from .rewrite import rewrite
from .trace import JointGraph

__all__ = [
    "BackendOptions",
    "GraphBreakWarning",
    "GraphReport",
    "InvalidBackendOption",
    "NoLayerStackWarning",
    "RematBackend",
    "backend",
    "compile_remat",
    "registered_backend",
]


class GraphBreakWarning(UserWarning):
    """The compiled model is split into several graphs; recompute cannot span a break."""


class NoLayerStackWarning(UserWarning):
    """A training graph holds no layer of the stack; it was compiled with ``none``."""


# --------------------------------------------------------------------------- helpers


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


def _current_compile_id() -> tuple[str, int | None]:
    cid = CompileContext.current_compile_id()
    if cid is None:
        return "", None
    return str(cid), getattr(cid, "frame_id", None)


# --------------------------------------------------------------------------- backend


class RematBackend:
    """A torch.compile backend that applies a recompute schedule to every training graph.

    Use ``backend(...)`` to make one; pass it as ``torch.compile(model, backend=b)``.

    Attributes:
        options: the BackendOptions.
        reports: one GraphReport per compiled training graph, in compile order.
        inference_graphs: ids of graphs compiled without a backward (no rewrite).
        files: report files written (when a report folder is set).
    """

    def __init__(self, options: BackendOptions):
        self.options = options
        self.reports: list[GraphReport] = []
        self.inference_graphs: list[str] = []
        self.files: list[Path] = []
        self._current: CompileInfo | None = None  # the Dynamo graph being compiled
        self._partitioned = False  # whether its AOTAutograd partition ran (a training graph)
        self._count = 0
        self._seen_break = False
        self._calibrator: Calibrator | None = None
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
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Compile one Dynamo graph (the ``CompilerFn`` contract)."""
        graph_id, frame = _current_compile_id()
        if not graph_id:
            graph_id = f"graph{self._count}"
        self._count += 1
        labels = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        reason = getattr(gm, "compile_subgraph_reason", None)  # set by Dynamo's OutputGraph
        ends_at_break = bool(reason is not None and getattr(reason, "graph_break", False))
        where = ""
        if ends_at_break and getattr(reason, "user_stack", None):
            top = reason.user_stack[-1]
            where = f" at {os.path.basename(top.filename)}:{top.lineno}"
        self._current = CompileInfo(
            graph_id=graph_id, frame_id=frame, labels=tuple(labels),
            graph_break=(str(reason.reason).splitlines()[0] + where) if ends_at_break else None,
            partial=ends_at_break or self._seen_break,  # after a break, part of the stack
        )
        self._partitioned = False
        self._seen_break = self._seen_break or ends_at_break
        try:
            if self.options.compiler == "inductor":
                compiled = self._compile_inductor(gm, example_inputs)
            else:
                compiled = self._compile_eager(gm, example_inputs)
            if not self._partitioned:
                self.inference_graphs.append(graph_id)
        finally:
            self._current = None
        return compiled

    def _compile_eager(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        return aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=self.partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _compile_inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        backend = self

        class _Partitioner(CustomPartitionerFn):
            def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kw: Any):
                kw.pop("compiler", None)
                return backend.partition(joint, joint_inputs, **kw)

            def uuid(self) -> None:
                return None  # no caching: every compile must run the partition (and report)

        # The caches would key on the partitioner object (not picklable: it holds this
        # backend) and a hit would skip the partition, and with it the report.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(
                gm,
                example_inputs,
                config_patches={"custom_partitioner_fn": _Partitioner(), "fx_graph_cache": False},
            )

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
            InfeasibleBudget: ``optimized`` and no schedule fits the budget.
            UnsupportedGraph: RNG functionalization is on (seed / offset placeholders),
                or the joint mutates a value in place.
        """
        start = time.perf_counter()
        info = self._current or CompileInfo(f"graph{self._count}", None, (), None, self._seen_break)
        joint_graph, mutations = dynamo_joint(
            joint, num_fwd_outputs, kwargs.get("static_lifetime_input_indices") or (), info.labels, info.graph_id)
        stack = self._stack_for(joint_graph, info)
        devices = {v.device.type for v in joint_graph.primal_values if isinstance(v, torch.Tensor)}
        allocator = "cuda" if "cuda" in devices else "cpu"
        if self.options.op_level and stack.num_layers:
            sched: schedules.Schedule | Partition = self._op_level(joint_graph, stack, allocator, info)
        elif self.options.schedule == "optimized" and stack.num_layers:
            sched = self._optimized(joint_graph, stack, allocator, info)
        else:
            sched = self.options.make_schedule(stack.num_layers)
        step = rewrite(joint_graph, stack, sched)
        concrete, symbolic = concrete_step(step)
        fw, bw = aot_graphs(step, mutations)
        report = GraphReport(
            graph_id=info.graph_id,
            frame_id=info.frame_id,
            graph_break=info.graph_break,
            schedule=sched.provenance,
            layer_stack=stack.path if stack.num_layers else None,
            layers=tuple(sorted({i for i in stack.layer_of.values() if i is not None})),
            num_fwd_outputs=num_fwd_outputs,
            boundary_output_bytes=boundary_bytes(concrete),
            symbolic=symbolic,
            example_shapes=tuple(tuple(size_hint(d) for d in v.shape)
                                 for v, kind in zip(joint_graph.primal_values, joint_graph.primal_kinds)
                                 if kind == "input" and isinstance(v, torch.Tensor)),
            pass_time_s=time.perf_counter() - start,
            memory=analyze(concrete, memory=self._memory_model(concrete, allocator)),
            step=concrete,
        )
        self.reports.append(report)
        self._partitioned = True
        self._write(report)
        self._warn_graph_breaks()
        return fw, bw

    def _stack_for(self, joint: JointGraph, info: CompileInfo) -> LayerStack:
        """The graph's layer stack; after a graph break the stack may continue in another
        graph, so K / N may exceed the layers seen here (the stack is widened to K)."""
        stack = self._layer_stack(joint.gm, joint.num_fwd_outputs, info.graph_id)
        k = self.options.recompute_num_layers
        if info.partial and stack.num_layers and k and self.options.schedule in ("uniform", "block"):
            total = max(stack.num_layers, k)
            stack = dataclasses.replace(stack, child_names=tuple(str(i) for i in range(total)), num_layers=total)
        return stack

    def _optimized(self, joint: JointGraph, stack: LayerStack, allocator: str,
                   info: CompileInfo) -> schedules.Schedule:
        """The least-recompute schedule whose predicted peak fits ``budget_bytes``
        (``planner.Planner`` on this graph: chain-model solve, checked by liveness).

        A graph with symbolic sizes reuses the groups chosen for the latest concrete
        graph of its frame with the same number of layers.

        Raises:
            InfeasibleBudget: the budget is below the least feasible peak of the graph.
            UnsupportedGraph: a symbolic graph with no earlier concrete graph to follow.
        """
        symbolic = any(is_symbolic_tensor(n.meta.get("val")) for n in joint.gm.graph.nodes)
        if symbolic:
            for r in reversed(self.reports):
                s = r.step.schedule
                if r.frame_id == info.frame_id and not r.symbolic and s.num_layers == stack.num_layers:
                    return s
            raise UnsupportedGraph(
                f"graph {info.graph_id}: schedule='optimized' solves on concrete sizes and "
                "this graph's are symbolic with no earlier concrete graph of its frame; "
                "compile with dynamic=False (torch.compile(..., dynamic=False))"
            )
        def predict(schedule: schedules.Schedule) -> MemoryReport:
            concrete = concrete_step(rewrite(joint, stack, schedule))[0]
            return analyze(concrete, memory=self._memory_model(concrete, allocator))

        return Planner(joint, stack, predict).plan(int(self.options.budget_bytes)).schedule

    def _memory_model(self, step: Any, allocator: str) -> MemoryModel:
        """The memory model of a concrete step: op scratch calibrated on this CPU
        (``calibrate`` option; the table for a CUDA allocator), else the table only."""
        if not self.options.calibrate or allocator != "cpu":
            return MemoryModel.table_only(allocator)
        if self._calibrator is None:
            self._calibrator = Calibrator()
        return self._calibrator.memory_model([step], allocator)

    def _op_level(self, joint: JointGraph, stack: LayerStack, allocator: str, info: CompileInfo) -> Partition:
        """The op-level Partition of this graph: the op-level optimum under
        ``budget_bytes`` (``op_planner.OpPlanner``, concrete sizes only), or the
        recompute modules / save policy in the layers the schedule stores.

        Raises:
            InfeasibleBudget: the budget is below the graph's least feasible peak.
            UnsupportedGraph: the op-level optimum of a graph with symbolic sizes.
            InvalidSchedule: a module kind the graph's layers do not have, or a name
                of a save policy that is not in the graph.
        """
        o = self.options
        if o.schedule == "optimized":
            if any(is_symbolic_tensor(n.meta.get("val")) for n in joint.gm.graph.nodes):
                raise UnsupportedGraph(
                    f"graph {info.graph_id}: the op-level optimum solves on concrete sizes and this graph's "
                    "are symbolic; compile with dynamic=False (torch.compile(..., dynamic=False))")

            def predict(p: Partition) -> MemoryReport:
                step = concrete_step(rewrite(joint, stack, p))[0]
                return analyze(step, memory=self._memory_model(step, allocator))

            planner = OpPlanner(joint, stack, predict, CostModel(o.flops_per_byte), allocator)
            return planner.plan(int(o.budget_bytes)).partition
        groups = o.make_schedule(stack.num_layers)
        if o.recompute_modules:
            return recompute_modules(joint, stack, o.recompute_modules, dict(o.module_names), groups)
        return save_policy(joint, stack, o.policy, o.policy_names, groups)

    def _layer_stack(self, joint: fx.GraphModule, num_fwd_outputs: int, graph_id: str) -> LayerStack:
        try:
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

    def graph_breaks(self) -> str:
        """``compiled_graphs.describe_graph_breaks`` of the latest graph of every frame
        (empty when all training graphs come from one frame)."""
        return describe_graph_breaks(self.reports)

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
            per compiled graph; the least-recompute groups that fit are chosen per graph
            (``InfeasibleBudget``, carrying the least feasible peak, when none fits).
        compiler: ``"eager"`` (fx graphs as they are; gradients equal eager's on CPU)
            or ``"inductor"``.
        layers: the layer stack's module path (``"transformer.h"``) when it is not
            found automatically.
        report_dir: write each graph's report there (``graph_<frame>_<n>.json``,
            ``.md`` and ``.remat.json`` for ``remat-pass inspect --graph``); None:
            ``$REMAT_PASS_REPORT_DIR`` if set.
        calibrate: calibrate op scratch on this CPU for the predicted peaks (cached
            under ``~/.cache/remat-pass``); False: the ATen formula table only.
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
    if mode not in (None, "default"):
        raise InvalidBackendOption(
            f"mode={mode!r} is not supported by the remat backend; choose the compiler "
            "with options={'compiler': 'eager' | 'inductor'}"
        )
    return registered_backend(options)(gm, example_inputs)
