"""The training steps of a model the torch.compile backend compiled: each step's graph
calls composed into one timeline (``StepReport``, ``step_flow``, ``step_composition``)
and logged; after the first step, the schedules of all graphs re-planned against the
composed step (``step_planning``, ``step_op_planning``) and the graphs whose schedule
changed recompiled; the step's report files."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from solvers.errors import infeasible

from ..recompute import schedule as schedules
from .graph import BackendGraph, GraphBreakWarning, RematFallbackWarning, fallback_warning, report_folder
from .options import BackendOptions
from .compiled_graphs import GraphReport, describe_graph_breaks
from ..graph.costs import storage_nbytes
from ..errors import StepNotComposable
from ..formatting import fmt_bytes
from .graph_schedule import GraphScheduler
from ..liveness.symbolic_sizes import concrete_step, evaluate_size, symbolic_size
from .inductor_memory import code_liveness
from ..liveness.intervals import storage_bytes
from ..recompute.partition import Partition
from ..report.schedule_report import write_report
from ..recompute.rewrite import RewrittenStep, rewrite
from ..liveness.step_flow import GraphCall, GraphLiveness, graph_liveness
from ..plan.step_op_planning import OpPlannedGraph, plan_step_op_level
from ..plan.step_planning import PlannedGraph, plan_step
from .step_recorder import RecordedStep
from ..report.step_report import CallSummary, StepReport, break_text, build_step_report, step_markdown

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepLogEntry:
    """One training step as logged: its number, the shapes of its first graph's
    non-parameter inputs, and the predicted peak of the step at those shapes (None:
    not composed, see ``note``)."""

    index: int
    input_shapes: tuple[Any, ...]
    peak_bytes: int | None
    note: str = ""


class BackendSteps:
    """The steps of the graphs a RematBackend compiled (see the module docstring).

    Attributes:
        log: one StepLogEntry per training step run.
        first_step: the composed report of the first step (None before it ended).

    Args:
        options: the backend's options.
        scheduler: the backend's GraphScheduler (memory models, predictions, op plans).
        graphs: the backend's training graphs by id (filled as they compile).
        reports: the backend's GraphReports, in compile order.
        files: the backend's list of report files written (the step's are added).
        compile: compiles a graph rewritten (its ``schedule`` forced by the step plan).
        compile_plain: compiles a graph un-rewritten.
    """

    def __init__(self, options: BackendOptions, scheduler: GraphScheduler, graphs: dict[str, BackendGraph],
                 reports: list[GraphReport], files: list[Path],
                 compile: Callable[[BackendGraph], Callable[..., Any]],
                 compile_plain: Callable[[BackendGraph], Callable[..., Any]]):
        self.options = options
        self.log: list[StepLogEntry] = []
        self.first_step: StepReport | None = None
        self._scheduler = scheduler
        self._graphs = graphs
        self._reports = reports
        self._files = files
        self._compile = compile
        self._compile_plain = compile_plain
        self._steps: dict[tuple, StepReport] = {}  # by RecordedStep.signature()
        self._signatures: list[tuple] = []  # per log entry

    def step_report(self, shape: Sequence[int] | None = None) -> StepReport | None:
        """``RematBackend.step_report``: the latest step's composed report, or the
        latest one whose input had ``shape``; KeyError (naming the shapes seen) when none
        did."""
        want = None if shape is None else tuple(shape)
        for entry, sig in zip(reversed(self.log), reversed(self._signatures)):
            if want is None or (entry.input_shapes and entry.input_shapes[0] == want):
                return self._steps.get(sig)
        if want is None:
            return None
        seen = sorted({e.input_shapes[0] for e in self.log if e.input_shapes})
        raise KeyError(f"no step ran with input shape {list(want)}; shapes seen: {[list(s) for s in seen]}")

    def step_ended(self, rec: RecordedStep) -> None:
        """A step ended: compose it, log it; after the first, re-plan and warn."""
        sig = rec.signature()
        first = rec.calls[0] if rec.calls else None
        shapes = tuple(s for s in (first.shapes if first else ()) if isinstance(s, tuple))
        report, note = self._steps.get(sig), ""
        if rec.problems:
            note = "; ".join(rec.problems)
            self.not_composable(note)
        elif report is None:
            plain = [g.graph_id for g in self._graphs.values() if g.plain]
            missing = [c.graph_id for c in rec.calls if c.graph_id not in self._graphs]
            if plain or missing:
                note = f"graphs {plain or missing} run un-rewritten or were not recorded"
            else:
                report = self._compose(rec)
                self._steps[sig] = report
        self.log.append(StepLogEntry(rec.index, shapes, report.peak_bytes if report else None, note))
        self._signatures.append(sig)
        if report is not None:
            logger.info("remat-pass step %d, input shapes %s: predicted step peak %s", rec.index,
                        [list(s) for s in shapes], fmt_bytes(report.peak_bytes))
        if report is not None and self.first_step is None:
            self.first_step = report
            self._after_first_step(rec, report)

    def not_composable(self, why: str) -> None:
        """The step cannot be composed (``why``): raise StepNotComposable, or with
        ``on_error="fallback"`` warn and recompile every recorded graph un-rewritten."""
        error = StepNotComposable(
            f"the training step cannot be composed into one timeline: {why}. The backend models "
            "one forward of every graph, then one loss.backward() running their backwards in "
            "reverse (autograd's order); call backward once per step on one loss, or compile with "
            "on_error='fallback' to run the graphs un-rewritten")
        if self.options.on_error != "fallback":
            raise error
        for g in self._graphs.values():
            if g.plain is None and g.recorded is not None:
                fallback_warning(g, error)
                # a training graph, recompiled from inside a backward, where grad mode is
                # off (AOTAutograd would compile an inference graph)
                with torch.enable_grad():
                    g.recorded.replace(self._compile_plain(g))
        self._steps.clear()  # no step of these graphs is composed any more

    def _binding(self, g: BackendGraph, shapes: Sequence[Any]) -> dict[Any, int]:
        values = {}
        for i, dim, sym in g.symbols:
            s = shapes[i] if i < len(shapes) else None
            if dim is None and isinstance(s, int):
                values[sym] = s
            elif dim is not None and isinstance(s, tuple) and dim < len(s):
                values[sym] = s[dim]
        return values

    def _liveness(self, g: BackendGraph, step: RewrittenStep | None = None) -> GraphLiveness:
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

    def _write_step(self, report: StepReport) -> None:
        folder = report_folder(self.options)
        if folder is None:
            return
        js, md = folder / "step.json", folder / "step.md"
        write_report(js, report.to_dict())
        md.write_text(step_markdown(report), encoding="utf-8")
        self._files += [js, md]

    def graph_breaks(self) -> str:
        """``compiled_graphs.describe_graph_breaks`` of the latest graph of every frame
        (empty when all training graphs come from one frame), and once a step has run,
        the step's peak and the bytes the breaks cost there."""
        text = describe_graph_breaks(self._reports)
        if text and self.first_step is not None:
            text += "\n  " + break_text(self.first_step)
        return text


def _storage_size(val: torch.Tensor, allocator: str) -> Any:
    """Bytes of ``val``'s storage (a SymInt under dynamic shapes), rounded as the CUDA
    allocator does for ``allocator="cuda"`` when concrete."""
    n = storage_nbytes(val)
    return storage_bytes(val, allocator) if isinstance(n, int) else n

