"""The torch.compile backend: AOTAutograd with this project's partition, a liveness
report for every compiled graph, and a report of the whole step.

``torch.compile(model, backend=remat_pass.backend(schedule="uniform", recompute_num_layers=2))``,
or through the ``torch_dynamo_backends`` entry point
``torch.compile(model, backend="remat", options={"schedule": "uniform", "recompute_num_layers": 2})``.

``RematBackend`` holds the current state of every training graph (``graph_state``) and
the step records (``steps.StepRecords``); each event moves them by a transition:

1. Dynamo hands over a graph (``RematBackend.__call__``): ``graph_state.capture``, then
   ``graph_compile.compile_graph``: AOTAutograd traces the joint forward+backward graph
   and calls this project's partition instead of its own; the partition
   (``graph_state.plan``) finds the layer stack from the module paths Dynamo recorded on
   the nodes (``nn_module_stack``; AOTAutograd copies the forward node's onto its
   backward nodes as ``fwd_nn_module_stack``), gives every node its layer
   (``regions.assign_layers_in_graph``), builds the Schedule for the layers of the
   stacks (``optimized``: ``planner.Planner`` under ``budget_bytes``) and rewrites
   (``rewrite.rewrite``); ``liveness.analyze`` predicts the graph's peak. The graphs
   run as plain fx code (``compiler="eager"``: gradients equal eager's bit for bit on
   CPU) or are compiled by Inductor (``compiler="inductor"``). The report is kept in
   ``RematBackend.reports`` (and written to ``report_dir``).
2. The callable handed back to Dynamo records each call (``step_recorder``): which
   graphs ran in a step, in which order, and which graph's output each input is.
3. A step ends (every backward it started has run): ``steps.end_step`` records its
   graphs (``graph_state.record``: their liveness) and composes its graph calls into one
   timeline (``step_flow``, ``composition``): the forward outputs held across a
   break, the gradients passed back, the zero tangents, the loss and its tangent, the
   parameter gradients. ``RematBackend.step_report()`` returns it (``step_report(shape)``:
   the latest step whose input had that shape; each step is logged in
   ``RematBackend.step_log`` with the peak of the shapes that ran). With
   ``compiler="inductor"`` the graphs' timelines come from Inductor's generated code
   (``inductor_memory``). The first step's report is written to ``report_dir`` and its
   break cost is given by a ``GraphBreakWarning``.
4. After the first step, with ``schedule="optimized"``, ``steps.replan_step``: each graph
   was planned when it compiled against ``budget_bytes`` alone (the other graphs were
   not known yet); now the schedules of all graphs are chosen together so that the
   composed step fits (``step_planning``; with ``granularity="op"``, the op-level
   choices, the same step planner), and the graphs whose schedule changed are compiled
   again (``graph_state.replan``): from the second step on, the step's peak is within
   the budget. A budget below the least feasible step peak raises ``InfeasibleBudget``
   at the end of the first step. With ``compiler="inductor"`` the step planner's fx
   model is shifted by what Inductor's code saved on the first step (a graph is never
   refused at compile: its code may fit where its fx graph does not), and the plan is
   checked on the next step of the same shapes, read from its code: above the budget,
   the first step's compiled graphs run again (``steps.check_replan``).

Dynamic shapes: the rewrite is shape-agnostic; the GraphReport's sizes are those of
the example that triggered the compile (``GraphReport.symbolic``), and the step report
evaluates every size at the shapes of the step that ran (``symbolic_sizes.evaluate_size``).

Inference graphs (``eval()`` models under ``no_grad``, or any graph with no input that
requires grad) are compiled without a partition and not recorded; their ids are listed
in ``RematBackend.inference_graphs``.

Errors (``on_error``): ``"raise"`` raises at compile time (a schedule the graph does
not allow, an unsupported graph) or at the end of the first step (a step that cannot
be composed, an infeasible step budget). ``"fallback"`` warns
(``RematFallbackWarning``) and runs the graphs concerned un-rewritten (AOTAutograd's or
Inductor's own partition) instead (``graph_compile.fall_back``, ``steps.not_composable``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch._guards import CompileContext

from .compiled_graphs import GraphReport, describe_graph_breaks
from .graph import (
    GraphBreakWarning,
    NoLayerStackWarning,
    RematFallbackWarning,
    report_folder,
    write_graph_report,
)
from .graph_compile import CompileResult, compile_graph
from .graph_schedule import GraphScheduler
from .graph_state import Compiled, GraphState, Inference, Plain, capture
from .options import (  # noqa: F401 - REPORT_DIR_ENV: part of the backend's public names
    REPORT_DIR_ENV,
    BackendOptions,
    InvalidBackendOption,
    check_compile_kwargs,
    default_op_schedule,
)
from .step_recorder import RecordedGraph, RecordedStep, StepRecorder
from .steps import (INDUCTOR_ROUNDS, PendingCheck, StepLogEntry, StepRecords, check_replan, eager_unrecorded,
                    end_step, not_composable, replan_step, write_step)
from ..errors import LayerStackNotFound
from ..report.step_report import StepReport, break_text

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
    It holds the current state of every training graph and the step records, and moves
    them by the transitions of ``graph_state`` and ``steps`` (see the module docstring).

    Attributes:
        options: the BackendOptions.
        reports: one GraphReport per compiled training graph, in compile order (a graph
            recompiled by the step planner appears again).
        inference_graphs: ids of graphs compiled without a backward (no rewrite).
        graph_states: the current state of every training graph, by id.
        step_log: one StepLogEntry per training step run.
        files: report files written (when a report folder is set).
    """

    def __init__(self, options: BackendOptions):
        self.options = options
        self.reports: list[GraphReport] = []
        self.inference_graphs: list[str] = []
        self.files: list[Path] = []
        self._scheduler = GraphScheduler(options)
        self._graphs: dict[str, GraphState] = {}  # every training graph's current state
        self._callables: dict[str, RecordedGraph] = {}  # what Dynamo calls, per graph
        self._records = StepRecords()
        self._recorder = StepRecorder(self._step_ended, self._not_composable, record_eager=True)
        self._count = 0
        self._seen_break = False
        self._pending: PendingCheck | None = None  # an Inductor step plan not yet run
        self._deferred = False  # the step plan waits for the step that records the eager ops
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
        return list(self._records.log)

    @property
    def graph_states(self) -> dict[str, GraphState]:
        """The current state of every training graph, by graph id (``graph_state``:
        Compiled, Recorded once a step of it ran, Plain when it runs un-rewritten)."""
        return dict(self._graphs)

    # -- Dynamo entry point
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """Compile one Dynamo graph (the ``CompilerFn`` contract): captured, compiled
        (``graph_compile.compile_graph``), and, for a training graph, wrapped to record
        its calls.

        Raises:
            InvalidBackendOption: ``torch.compile`` passed a ``mode`` other than
                ``"default"`` or ``options`` (give them to ``remat_pass.compile.backend``).
            RematError: as ``graph_state.plan``, with ``on_error="raise"``.
        """
        check_compile_kwargs(kwargs, given_to="remat_pass.backend(...)")
        graph_id, frame = _current_compile_id()
        if not graph_id:
            graph_id = f"graph{self._count}"
        self._count += 1
        captured = capture(gm, example_inputs, graph_id, frame, self._seen_break)
        self._seen_break = self._seen_break or captured.info.graph_break is not None
        state = self._compiled(compile_graph(captured, self._scheduler, tuple(self.reports), example_inputs))
        if isinstance(state, Inference):
            self.inference_graphs.append(graph_id)
            return state.run
        self._graphs[graph_id] = state
        params = state.planned.param_indices if isinstance(state, Compiled) else ()
        self._callables[graph_id] = self._recorder.wrap(graph_id, state.run, params)
        return self._callables[graph_id]

    def _compiled(self, result: CompileResult) -> Compiled | Plain | Inference:
        """Take a compile's reports (``reports``, their files, the graph-break warning)
        and return the state it ended in."""
        self._take_reports(result.reports)
        return result.state

    def _take_reports(self, reports: Sequence[GraphReport]) -> None:
        folder = self.report_dir
        for r in reports:
            self.reports.append(r)
            if folder is not None:
                self.files += write_graph_report(folder, r)
            self._warn_graph_breaks()

    def _install(self, states: dict[str, GraphState]) -> None:
        """Make ``states`` the graphs' current ones; Dynamo's callable of each graph
        whose compile changed runs the new one from its next call."""
        for gid, state in states.items():
            if state.run is not self._graphs[gid].run:
                self._callables[gid].replace(state.run)
            self._graphs[gid] = state

    # -- the step
    def _step_ended(self, rec: RecordedStep) -> None:
        """The recorder's event: a step ended (``steps.end_step``); after the first
        composed step, re-planned (``steps.replan_step``), written and warned of."""
        if rec.problems:
            self._not_composable("; ".join(rec.problems))
        ended = end_step(self._records, self._graphs, rec, self._scheduler)
        self._records = ended.records
        self._install(ended.recorded)
        rec = ended.step or rec
        if not ended.first:
            if ended.new_eager and ended.report is not None and self._deferred:
                self._deferred = False
                self._replan(rec, ended.report, 1)  # the step plan, with the step's eager ops
                return
            self._check_pending(rec, ended.report)
            return
        self._check_named_stack(rec)
        report = ended.report
        if self.options.schedule == "optimized":
            if eager_unrecorded(rec):  # planned on the next step, which records them
                self._deferred = True
            else:
                report = self._replan(rec, report, 1)
        folder = self.report_dir
        if folder is not None:
            self.files += write_step(folder, report)
        if len(rec.calls) > 1:
            warnings.warn(self.graph_breaks(), GraphBreakWarning, stacklevel=2)

    def _replan(self, rec: RecordedStep, report: StepReport, rounds: int) -> StepReport:
        """``steps.replan_step`` of the step ``rec`` ran (``report``): the new states
        installed, their reports taken, an Inductor plan's check kept; the step's report
        with the new graphs."""
        replanned = replan_step(self._graphs, rec, report, self._scheduler, tuple(self.reports), rounds)
        self._install(replanned.states)
        if replanned.planned:  # the graphs may have changed: compose the next steps anew
            self._records = dataclasses.replace(self._records, composed={})
        self._take_reports(replanned.reports)
        self._pending = replanned.pending
        return replanned.report

    def _check_pending(self, rec: RecordedStep, report: StepReport | None) -> None:
        """The first step of the signature an Inductor step plan was made against
        (``steps.check_replan``): above the budget, the graphs go back to the schedules
        before it (their compiled code) and the next steps are composed anew; within
        it, planned again from there (``steps.INDUCTOR_ROUNDS`` plans at most)."""
        if self._pending is None or report is None or rec.signature() != self._pending.signature:
            return
        pending, self._pending = self._pending, None
        previous = check_replan(pending, rec, report, int(self.options.budget_bytes), self.options.on_error)
        if previous is not None:
            self._install(previous)
            self._records = dataclasses.replace(self._records, composed={})
        elif report.peak_bytes <= int(self.options.budget_bytes) and pending.rounds < INDUCTOR_ROUNDS:
            self._replan(rec, report, pending.rounds + 1)

    def _check_named_stack(self, rec: RecordedStep) -> None:
        """After the first step: a ``layers=`` path that no graph of the step holds (a
        typo, or a path outside the compiled module) ran the whole step without
        recompute; raise ``LayerStackNotFound`` (``on_error="fallback"``: warn with
        ``RematFallbackWarning``) rather than train on silently."""
        if self.options.layers is None or self.options.schedule == "none":
            return
        if any(r.layer_stack for r in self.reports):
            return
        why = (f"layers={self.options.layers!r} names no layer stack in any of the {len(rec.calls)} graph(s) "
               "of the training step, so nothing was recomputed; give the module path of the stack relative "
               "to the compiled module (e.g. 'transformer.h'), or layers=None to find it")
        if self.options.on_error == "fallback":
            warnings.warn(f"remat-pass: {why}", RematFallbackWarning, stacklevel=2)
            return
        raise LayerStackNotFound(why)

    def _not_composable(self, why: str) -> None:
        """The recorder's (or a step's) event: a step cannot be composed (``why``);
        ``steps.not_composable`` raises or every graph falls back."""
        self._install(not_composable(self._graphs, why, self.options))
        self._records = dataclasses.replace(self._records, composed={})  # no step of these graphs is composed any more

    def step_report(self, shape: Sequence[int] | None = None) -> StepReport | None:
        """The composed report of the latest training step (None before a step has
        ended, or when its graphs run un-rewritten); ``StepRecords.step_report``.

        Args:
            shape: the shape of the step's first non-parameter input (``ids.shape``):
                the latest step that ran with it (under dynamic shapes, the report of
                that shape). None: the latest step.

        Raises:
            KeyError: no step ran with ``shape`` (the message lists the shapes seen).
        """
        return self._records.step_report(shape)

    def graph_breaks(self) -> str:
        """``compiled_graphs.describe_graph_breaks`` of the latest graph of every frame
        (empty when all training graphs come from one frame) and, once a step has run,
        the step's peak and the bytes the breaks cost there (``break_text``)."""
        text = describe_graph_breaks(self.reports)
        if text and self._records.first_step is not None:
            text += "\n  " + break_text(self._records.first_step)
        return text

    def _warn_graph_breaks(self) -> None:
        text = self.graph_breaks()
        if text:
            warnings.warn(text, GraphBreakWarning, stacklevel=2)


def backend(
    schedule: str | None = None,
    recompute_num_layers: int | None = None,
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
            ``--recompute-num-layers``; required with uniform and block.
        budget_bytes: with ``schedule="optimized"``, the peak activation bytes allowed
            for the training step (an int, or a size with a unit such as ``"80MiB"``);
            each graph is planned alone when it compiles, all together after the first
            step (``InfeasibleBudget``, with the least feasible step peak, if none fits).
        compiler: ``"eager"`` (the fx graphs; gradients equal eager's on CPU) or ``"inductor"``.
        layers: the layer stack's module path (``"transformer.h"``); None: found automatically.
        report_dir: write each graph's report and the first step's there (JSON,
            Markdown, ``.remat.json`` dumps); None: ``$REMAT_PASS_REPORT_DIR`` if set.
        calibrate: calibrate op scratch on this CPU (cached); False: the formula table.
        on_error: ``"raise"`` or ``"fallback"``: run what the pass cannot handle (a
            graph, or a step that cannot be composed) un-rewritten, with a warning.
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
        LayerStackNotFound: after the first step, when no graph holds ``layers``
            (``on_error="fallback"``: a ``RematFallbackWarning``).

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
