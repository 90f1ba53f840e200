"""The torch.compile backend: AOTAutograd with this project's partition, and a liveness
report for every compiled graph.

``torch.compile(model, backend=remat_pass.backend(schedule="uniform", num_layers=2))``,
or through the ``torch_dynamo_backends`` entry point
``torch.compile(model, backend="remat", options={"schedule": "uniform", "num_layers": 2})``.

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
   ``symbolic.Planner``) and rewrites (``rewrite.rewrite``). ``liveness.analyze`` predicts the graph's
   peak; the report is kept in ``RematBackend.reports``.
3. The forward and backward graphs are handed back in AOTAutograd's calling
   convention (``partitioners._extract_fwd_bwd_modules``): forward returns its outputs,
   then the saved tensors, then the saved SymInts; backward takes the saved SymInts,
   then the saved tensors, then the tangents. The primals that the rewritten backward
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
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from . import schedule as schedules
from .errors import InvalidSchedule, LayerStackNotFound, RematError, UnsupportedGraph
from .liveness import MemoryReport, analyze
from .regions import (
    LayerStack,
    assign_layers_to_graph,
    find_layer_stack_in_graph,
    forward_node_names,
)
from .rewrite import RewrittenStep, rewrite
from .trace import JointGraph

SCHEDULES = ("none", "uniform", "block", "optimized")
COMPILERS = ("eager", "inductor")
OPTION_KEYS = ("schedule", "num_layers", "budget_bytes", "compiler", "layers", "report_dir")
REPORT_DIR_ENV = "REMAT_PASS_REPORT_DIR"


class InvalidBackendOption(RematError, ValueError):
    """A backend option other than the schedule (compiler, layers, report_dir, an
    unknown key) is not one the backend accepts."""


class GraphBreakWarning(UserWarning):
    """The compiled model is split into several graphs; recompute cannot span a break."""


class NoLayerStackWarning(UserWarning):
    """A training graph holds no layer of the stack; it was compiled with ``none``."""


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Options of the remat backend (the keys of ``torch.compile(options=...)``).

    Attributes:
        schedule: ``"none"``, ``"uniform"`` or ``"block"`` (Megatron-LM's
            ``--recompute-method``), or ``"optimized"``: per compiled graph, the
            least-recompute groups whose predicted peak fits ``budget_bytes``
            (``symbolic.Planner``: the chain-model solver, checked by liveness).
        num_layers: K for uniform (1..L), N for block (0..L); ignored for none. L, the
            number of layers of the stack, is checked when a graph is compiled.
        budget_bytes: for ``optimized``: the peak activation bytes allowed per compiled
            graph (static memory excluded, as ``MemoryReport.peak_bytes``).
        compiler: ``"eager"`` (run the fx graphs) or ``"inductor"``.
        layers: module path of the layer stack relative to the compiled module
            (``"transformer.h"``); None to find it.
        report_dir: folder to write every graph's report to (JSON, Markdown and a
            ``remat-pass inspect`` dump); None reads ``$REMAT_PASS_REPORT_DIR``
            (unset: nothing is written).

    Raises:
        InvalidSchedule: unknown schedule, K / N not an integer in range, a budget
            without ``optimized``, ``optimized`` without a positive budget, or the solver
            cannot be imported.
        InvalidBackendOption: unknown compiler, or ``layers`` / ``report_dir`` of the
            wrong type.
    """

    schedule: str = "uniform"
    num_layers: int | None = 4
    budget_bytes: int | None = None
    compiler: str = "eager"
    layers: str | None = None
    report_dir: str | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InvalidSchedule(
                f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}"
            )
        k = self.num_layers
        if self.schedule in ("uniform", "block"):
            low = 1 if self.schedule == "uniform" else 0
            name = "K" if self.schedule == "uniform" else "N"
            if not isinstance(k, int) or isinstance(k, bool) or k < low:
                raise InvalidSchedule(
                    f"{self.schedule} needs num_layers={name}, an integer in {low}..L "
                    f"(L: the layers of the stack); got {k!r}"
                )
        if self.budget_bytes is not None and self.schedule != "optimized":
            raise InvalidSchedule(
                f"budget_bytes={self.budget_bytes!r} applies only to schedule='optimized'; "
                f"schedule={self.schedule!r} takes num_layers"
            )
        if self.schedule == "optimized":
            b = self.budget_bytes
            if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
                raise InvalidSchedule(
                    "schedule='optimized' needs budget_bytes, the peak activation bytes "
                    f"allowed per compiled graph, an integer > 0; got {b!r}"
                )
            try:
                from .symbolic import Planner  # noqa: F401
            except ImportError as e:
                raise InvalidSchedule(
                    "schedule='optimized' needs the solver (remat_pass.symbolic, solvers/), "
                    "which cannot be imported here; use none, uniform or block"
                ) from e
        if self.compiler not in COMPILERS:
            raise InvalidBackendOption(
                f"compiler={self.compiler!r} is not one of {', '.join(COMPILERS)}"
            )
        if self.layers is not None and not isinstance(self.layers, str):
            raise InvalidBackendOption(
                f"layers must be a module path such as 'transformer.h', got {self.layers!r}"
            )
        if self.report_dir is not None and not isinstance(self.report_dir, (str, os.PathLike)):
            raise InvalidBackendOption(f"report_dir must be a folder path, got {self.report_dir!r}")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "BackendOptions":
        """From ``torch.compile(options=...)``.

        Raises:
            InvalidBackendOption: a key outside ``OPTION_KEYS``.
            InvalidSchedule: as the constructor.
        """
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise InvalidBackendOption(
                f"unknown remat backend option(s) {unknown}; the options are {', '.join(OPTION_KEYS)}"
            )
        return cls(**options)

    def make_schedule(self, num_layers: int) -> schedules.Schedule:
        """The Schedule for a stack of ``num_layers`` layers (not for ``optimized``,
        which the backend solves per graph).

        Raises:
            InvalidSchedule: K / N outside the range L allows (the message names L).
        """
        if num_layers == 0 or self.schedule in ("none", "optimized"):
            return schedules.none(num_layers)
        return schedules.make(self.schedule, self.num_layers, num_layers)


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
        """A JSON-ready dict: the graph's fields and ``memory`` (``MemoryReport.to_dict``)."""
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
            "memory": self.memory.to_dict(),
        }


# --------------------------------------------------------------------------- helpers


def _is_sym(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _is_symbolic_tensor(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and any(
        not isinstance(d, int) for d in (*val.shape, *val.stride(), val.storage_offset())
    )


def _hint(x: Any) -> int:
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return int(optimization_hint(x, fallback=1))


def _concrete_step(step: RewrittenStep) -> tuple[RewrittenStep, bool]:
    """``step`` with symbolic sizes replaced by their hints (meta tensors), aliasing kept.

    Returns ``(step, False)`` unchanged when every size is an int. Adds no guard.
    """
    graphs = (step.forward.graph, step.backward.graph)
    if not any(_is_symbolic_tensor(n.meta.get("val")) for g in graphs for n in g.nodes):
        return step, False
    bases: dict[int, torch.Tensor] = {}

    def concrete(val: Any) -> Any:
        if isinstance(val, (tuple, list)):
            return type(val)(concrete(v) for v in val)
        if not isinstance(val, torch.Tensor):
            return val
        storage = val.untyped_storage()
        key = storage._cdata
        if key not in bases:
            bases[key] = torch.empty(_hint(storage.nbytes()), dtype=torch.uint8, device="meta")
        out = torch.empty((), dtype=val.dtype, device="meta")
        out.set_(
            bases[key].untyped_storage(),
            _hint(val.storage_offset()),
            [_hint(d) for d in val.shape],
            [_hint(s) for s in val.stride()],
        )
        return out

    def copy(gm: fx.GraphModule) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        out = g.graph_copy(gm.graph, env)
        g.output(out)
        for old, new in env.items():
            new.meta = dict(old.meta)
            if "val" in old.meta:
                new.meta["val"] = concrete(old.meta["val"])
        return fx.GraphModule(gm, g, class_name=type(gm).__name__)

    return dataclasses.replace(step, forward=copy(step.forward), backward=copy(step.backward)), True


def split_input_mutations(
    joint: fx.GraphModule, primals: Sequence[str]
) -> tuple[fx.GraphModule, list[tuple[str, str]]]:
    """The joint graph without its input-mutation epilogue, and that epilogue.

    AOTAutograd keeps a mutation of a primal (BatchNorm's running statistics in train
    mode) in the joint as ``aten.copy_(primal, new_value)`` with no users, at the end
    of forward. The rewrite refuses in-place ops, so they are taken out here and put
    back at the end of the forward graph by ``aot_graphs``.

    Returns:
        ``(joint without those copy_ nodes, [(primal name, new value's node name)])``;
        ``joint`` itself is not modified.
    """
    primal_set = set(primals)
    drop = [
        n for n in joint.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
        and isinstance(n.args[0], fx.Node) and n.args[0].name in primal_set and not n.users
    ]
    if not drop:
        return joint, []
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    dropped = set(drop)
    for n in joint.graph.nodes:
        if n in dropped:
            continue
        if n.op == "output":
            g.output(fx.node.map_arg(n.args[0], env.__getitem__))
            continue
        env[n] = g.node_copy(n, env.__getitem__)
        env[n].meta = dict(n.meta)
    g.lint()
    return fx.GraphModule(joint, g), [(n.args[0].name, n.args[1].name) for n in drop]


def aot_graphs(
    step: RewrittenStep, mutations: Sequence[tuple[str, str]] = ()
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``step``'s graphs in AOTAutograd's calling convention.

    ``forward(*primals) -> (*fwd_outputs, *saved_tensors, *saved_symints)`` and
    ``backward(*saved_symints, *saved_tensors, *tangents) -> one gradient per primal``,
    as ``torch._functorch.partitioners._extract_fwd_bwd_modules`` builds them. The
    primals backward reads (``step.backward_primal_indices``) are saved tensors (or
    SymInts) returned by forward. ``step`` is not modified.

    ``mutations`` (``split_input_mutations``): each ``(primal, value)`` becomes
    ``aten.copy_(primal, value)`` at the end of forward, as AOTAutograd placed it. A
    recomputed node that reads a mutated primal must see the value forward saw: forward
    saves a clone of the primal taken before the mutation, and the recompute reads it
    (backward nodes read the primal itself, as under AOTAutograd's own partition).
    """
    fw = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_args = fw.graph_copy(step.forward.graph, env)
    k = step.num_fwd_outputs
    fwd_outs, saved_outs = list(out_args[:k]), list(out_args[k:])
    placeholders = {n.name: n for n in fw.nodes if n.op == "placeholder"}
    by_name = {n.name: n for n in fw.nodes}
    bw_src = [n for n in step.backward.graph.nodes if n.op == "placeholder"]
    n_saved = len(step.saved)
    bw_primals = bw_src[n_saved : n_saved + len(step.backward_primal_indices)]
    tangents = bw_src[n_saved + len(bw_primals) :]
    saved_fw = saved_outs + [placeholders[p.name] for p in bw_primals]
    saved_bw: list[Any] = bw_src[: n_saved + len(bw_primals)]

    # pre-mutation clones for recomputed readers of a mutated primal
    stale: dict[str, fx.Node] = {}  # primal name -> its pre-mutation clone (forward)
    recompute_readers = {
        a.name
        for n in step.backward.graph.nodes
        if step.kind_of.get(n.name) == "recompute"
        for a in n.all_input_nodes
        if a.op == "placeholder"
    }
    last_placeholder = [n for n in fw.nodes if n.op == "placeholder"][-1]
    for dst, src in mutations:
        if dst in recompute_readers:
            with fw.inserting_after(last_placeholder):
                pre = fw.create_node("call_function", torch.ops.aten.clone.default,
                                     (placeholders[dst],), name=f"{dst}_before_mutation")
            pre.meta = dict(placeholders[dst].meta)
            stale[dst] = pre
            saved_fw.append(pre)
            saved_bw.append(pre)  # stands in for its backward placeholder
    sym = [i for i, n in enumerate(saved_fw) if _is_sym(n)]
    tensors = [i for i in range(len(saved_fw)) if i not in set(sym)]
    for dst, src in mutations:
        fw.call_function(torch.ops.aten.copy_.default, (placeholders[dst], by_name[src]))
    fw.output([*fwd_outs, *(saved_fw[i] for i in tensors), *(saved_fw[i] for i in sym)])
    fw.lint()

    bw = fx.Graph()
    benv: dict[Any, fx.Node] = {}
    for src in [*(saved_bw[i] for i in sym), *(saved_bw[i] for i in tensors), *tangents]:
        ph = bw.placeholder(src.name)
        ph.meta = dict(src.meta)
        benv[src] = ph
    clone_ph = {dst: benv[pre] for dst, pre in stale.items()}
    for n in step.backward.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            bw.output(fx.node.map_arg(n.args[0], benv.__getitem__))
            continue
        if step.kind_of.get(n.name) == "recompute" and stale:
            def lookup(a: fx.Node) -> fx.Node:
                if a.op == "placeholder" and a.name in clone_ph:
                    return clone_ph[a.name]
                return benv[a]

            benv[n] = bw.node_copy(n, lookup)
        else:
            benv[n] = bw.node_copy(n, benv.__getitem__)
    bw.lint()
    return (
        fx.GraphModule(step.forward, fw, class_name="RematForward"),
        fx.GraphModule(step.backward, bw, class_name="RematBackward"),
    )


def _current_compile_id() -> tuple[str, int | None]:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is None:
        return "", None
    frame = getattr(cid, "frame_id", None)
    return str(cid), frame


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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _markdown(report: GraphReport) -> str:
    head = (
        f"## remat-pass graph {report.graph_id}\n\n"
        f"- layer stack: `{report.layer_stack}`, {_layers_text(report.layers)}\n"
        f"- forward outputs: {report.num_fwd_outputs} ({_mib(report.boundary_output_bytes)})\n"
        + (f"- sizes at the example shapes {list(map(list, report.example_shapes))} (symbolic graph)\n"
           if report.symbolic else "")
        + "\n"
    )
    try:
        from .report import report_markdown
    except ImportError:  # pragma: no cover - report.py without report_markdown
        m = report.memory
        return head + (
            f"schedule `{m.schedule}`: predicted peak {_mib(m.peak_bytes)} "
            f"({m.peak_phase}, node `{m.peak_node}`, layer {m.peak_layer}); saved "
            f"activations {_mib(m.saved_activation_bytes)}; static {_mib(m.static_bytes)}\n"
        )
    return head + report_markdown(report.memory, report.step) + "\n"


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
        self._current: dict[str, Any] = {}
        self._count = 0
        self._seen_break = False
        self.__name__ = "remat"

    def __repr__(self) -> str:
        o = self.options
        return (f"RematBackend(schedule={o.schedule!r}, num_layers={o.num_layers!r}, "
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
        self._current = {"graph_id": graph_id, "frame": frame, "labels": labels,
                         "partitioned": False,
                         "break": (str(reason.reason).splitlines()[0] + where) if ends_at_break else None,
                         # after a break, a graph may hold only part of the stack
                         "partial": ends_at_break or self._seen_break}
        self._seen_break = self._seen_break or ends_at_break
        try:
            if self.options.compiler == "inductor":
                compiled = self._compile_inductor(gm, example_inputs)
            else:
                compiled = self._compile_eager(gm, example_inputs)
            if not self._current["partitioned"]:
                self.inference_graphs.append(graph_id)
        finally:
            self._current = {}
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
        info = self._current or {"graph_id": f"graph{self._count}", "frame": None,
                                 "labels": [], "break": None, "partial": self._seen_break}
        placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
        primals = [n.name for n in placeholders if n.name.startswith("primals")]
        tangents = [n.name for n in placeholders if n.name.startswith("tangents")]
        other = [n.name for n in placeholders if n.name not in primals and n.name not in tangents]
        if other:
            raise UnsupportedGraph(
                f"graph {info['graph_id']}: joint placeholders {other} are neither primals "
                "nor tangents (RNG functionalization, torch._functorch.config."
                "functionalize_rng_ops, is on?); the remat backend replays RNG state itself: "
                "turn that option off"
            )
        joint, mutations = split_input_mutations(joint, primals)
        stack = self._layer_stack(joint, num_fwd_outputs, info["graph_id"])
        if (info.get("partial") and stack.num_layers and self.options.num_layers
                and self.options.schedule in ("uniform", "block")):
            # the stack continues in another graph: K / N may exceed the layers seen here
            total = max(stack.num_layers, self.options.num_layers)
            stack = dataclasses.replace(
                stack, child_names=tuple(str(i) for i in range(total)), num_layers=total
            )
        sched = self.options.make_schedule(stack.num_layers)
        static = set(kwargs.get("static_lifetime_input_indices") or ())
        labels = info["labels"] if len(info["labels"]) == len(primals) else primals
        vals = {n.name: n.meta.get("val") for n in placeholders}
        joint_graph = JointGraph(
            gm=joint,
            primals=primals,
            tangents=tangents,
            num_fwd_outputs=num_fwd_outputs,
            primal_values=[vals[p] for p in primals],
            primal_kinds=["param" if i in static else "input" for i in range(len(primals))],
            primal_labels=list(labels),
            tangent_values=[vals[t] for t in tangents],
            model=None,  # type: ignore[arg-type]
        )
        for attr, value in (("shape_env", None), ("symbols", {})):
            if not hasattr(joint_graph, attr):  # symbolic.SymbolicModel reads them
                setattr(joint_graph, attr, value)
        devices = {v.device.type for v in vals.values() if isinstance(v, torch.Tensor)}
        allocator = "cuda" if "cuda" in devices else "cpu"
        if self.options.schedule == "optimized" and stack.num_layers:
            sched = self._optimized(joint_graph, stack, allocator, info)
        step = rewrite(joint_graph, stack, sched)
        concrete, symbolic = _concrete_step(step)
        memory = analyze(concrete, allocator=allocator)
        fw, bw = aot_graphs(step, mutations)

        boundary = _boundary_bytes(concrete)
        layers = tuple(sorted({i for i in stack.layer_of.values() if i is not None}))
        shapes = tuple(
            tuple(_hint(d) for d in v.shape)
            for i, p in enumerate(primals)
            if i not in static and isinstance(v := vals[p], torch.Tensor)
        )
        report = GraphReport(
            graph_id=info["graph_id"],
            frame_id=info["frame"],
            graph_break=info.get("break"),
            schedule=sched.provenance,
            layer_stack=stack.path if stack.num_layers else None,
            layers=layers,
            num_fwd_outputs=num_fwd_outputs,
            boundary_output_bytes=boundary,
            symbolic=symbolic,
            example_shapes=shapes,
            pass_time_s=time.perf_counter() - start,
            memory=memory,
            step=concrete,
        )
        self.reports.append(report)
        if self._current:
            self._current["partitioned"] = True
        self._write(report)
        self._warn_graph_breaks()
        return fw, bw

    def _optimized(self, joint: JointGraph, stack: LayerStack, allocator: str,
                   info: dict[str, Any]) -> schedules.Schedule:
        """The least-recompute schedule whose predicted peak fits ``budget_bytes``
        (``symbolic.Planner`` on this graph: chain-model solve, checked by liveness).

        A graph with symbolic sizes reuses the groups chosen for the latest concrete
        graph of its frame with the same number of layers.

        Raises:
            InfeasibleBudget: the budget is below the least feasible peak of the graph.
            UnsupportedGraph: a symbolic graph with no earlier concrete graph to follow.
        """
        symbolic = any(_is_symbolic_tensor(n.meta.get("val")) for n in joint.gm.graph.nodes)
        if symbolic:
            for r in reversed(self.reports):
                s = r.step.schedule
                if r.frame_id == info["frame"] and not r.symbolic and s.num_layers == stack.num_layers:
                    return s
            raise UnsupportedGraph(
                f"graph {info['graph_id']}: schedule='optimized' solves on concrete sizes and "
                "this graph's are symbolic with no earlier concrete graph of its frame; "
                "compile with dynamic=False (torch.compile(..., dynamic=False))"
            )
        from .symbolic import Planner

        planner = Planner(_GraphSession(joint, stack, allocator))
        return planner.plan(int(self.options.budget_bytes)).schedule

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
        import json

        folder.mkdir(parents=True, exist_ok=True)
        stem = "graph_" + report.graph_id.replace("/", "_")
        payload = report.to_dict()
        try:
            from .report import report_json

            payload["memory"] = report_json(report.memory, report.step)
        except ImportError:  # pragma: no cover - older report.py
            pass
        js = folder / f"{stem}.json"
        js.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        md = folder / f"{stem}.md"
        md.write_text(_markdown(report), encoding="utf-8")
        self.files += [js, md]
        try:
            from .inspection import dump_step
        except ImportError:  # pragma: no cover - no inspection module
            return
        self.files.append(dump_step(report.step, report.memory, folder, stem,
                                    meta={"graph_id": report.graph_id, "schedule": report.schedule}))

    def graph_breaks(self) -> str:
        """A description of the graph breaks among the latest graph of every frame
        (empty when all training graphs come from one frame).

        Lists every graph (id, layers, forward outputs crossing the break, saved
        activations held until its backward) and the layers split across graphs.
        """
        latest: dict[Any, GraphReport] = {}
        for r in self.reports:
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
                f"({_mib(r.boundary_output_bytes)}) leave the graph (held by what runs "
                f"next); saved activations {_mib(r.memory.saved_activation_bytes)} held "
                "until its backward; "
                f"predicted peak {_mib(r.memory.peak_bytes)}"
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

    def _warn_graph_breaks(self) -> None:
        text = self.graph_breaks()
        if text:
            warnings.warn(text, GraphBreakWarning, stacklevel=2)


class _GraphSession:
    """What ``symbolic.Planner`` reads of a ``sweep.Session``, for one compiled graph:
    ``joint``, ``stack`` and ``prepare(schedule) -> (step, report, seconds)``."""

    def __init__(self, joint: JointGraph, stack: LayerStack, allocator: str):
        self.joint, self.stack, self.allocator = joint, stack, allocator

    def prepare(self, schedule: schedules.Schedule) -> tuple[RewrittenStep, MemoryReport, float]:
        start = time.perf_counter()
        step = rewrite(self.joint, self.stack, schedule)
        report = analyze(_concrete_step(step)[0], allocator=self.allocator)
        return step, report, time.perf_counter() - start


def _boundary_bytes(step: RewrittenStep) -> int:
    """Bytes of the distinct storages of the forward graph's outputs (not its inputs)."""
    out = step.forward.graph.output_node()
    placeholders = {n for n in step.forward.graph.nodes if n.op == "placeholder"}
    inputs = {n.meta["val"].untyped_storage()._cdata for n in placeholders
              if isinstance(n.meta.get("val"), torch.Tensor)}
    seen: set[int] = set()
    total = 0
    for a in out.args[0][: step.num_fwd_outputs]:
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(val, torch.Tensor):
            key = val.untyped_storage()._cdata
            if key not in seen and key not in inputs:
                seen.add(key)
                total += int(val.untyped_storage().nbytes())
    return total


def backend(
    schedule: str = "uniform",
    num_layers: int | None = 4,
    budget_bytes: int | None = None,
    compiler: str = "eager",
    layers: str | None = None,
    report_dir: str | os.PathLike | None = None,
) -> RematBackend:
    """A torch.compile backend that recomputes layers by a Megatron-LM schedule.

    Args:
        schedule: ``"none"``, ``"uniform"`` (``--recompute-method uniform``) or
            ``"block"`` (``--recompute-method block``).
        num_layers: K (uniform, 1..L) or N (block, 0..L), as
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

    Returns:
        A RematBackend; its ``reports`` fill as graphs compile (on the first call).

    Raises:
        InvalidSchedule, InvalidBackendOption: see BackendOptions.

    Example:
        >>> import remat_pass, torch
        >>> from remat_pass.models import TinyGPT
        >>> b = remat_pass.backend(schedule="uniform", num_layers=2)
        >>> model = TinyGPT(vocab=64, hidden=32, heads=2, layers=4, seq=16)
        >>> ids = torch.randint(0, 64, (2, 16))
        >>> torch.compile(model, backend=b)(ids).sum().backward()
        >>> r = b.reports[0]
        >>> r.graph_id, r.schedule, r.layer_stack, r.layers, [s.layers for s in r.step.segments]
        ('0/0', 'uniform(K=2)', 'blocks', (0, 1, 2, 3), [(2, 3), (0, 1)])
    """
    return RematBackend(BackendOptions(
        schedule=schedule,
        num_layers=num_layers,
        budget_bytes=budget_bytes,
        compiler=compiler,
        layers=layers,
        report_dir=None if report_dir is None else str(report_dir),
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
