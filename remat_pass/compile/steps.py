"""The training steps of the graphs the torch.compile backend compiled, as transitions of
their states (``graph_state``) and of the step records.

- ``end_step``: a recorded step (``step_recorder.RecordedStep``) -> its graphs recorded
  (``graph_state.record``), the step composed into one timeline (``compose``:
  ``StepReport``, ``step_flow``, ``composition``) and logged in the StepRecords.
- ``replan_step``: after the first step, with ``schedule="optimized"``, the schedules of
  all graphs re-planned against the composed step (``step_planning``, whole layers or,
  with ``granularity="op"``, op-level choices) and the graphs whose schedule changed
  compiled again (``graph_state.replan``, ``graph_compile.compile_graph``).
- ``not_composable``: a step that cannot be composed raises StepNotComposable, or
  (``on_error="fallback"``) every graph falls back (``graph_compile.fall_back``).

``write_step`` writes the step's report files.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from solvers.errors import infeasible

from ..errors import StepNotComposable
from ..formatting import fmt_bytes
from ..liveness.step_flow import GraphCall
from ..liveness.symbolic_sizes import evaluate_size
from ..plan.planner import Planner
from ..plan.step_planning import OpLevelGraph, WholeLayerGraph, plan_step
from ..recompute import schedule as schedules
from ..recompute.partition import Partition
from ..recompute.rewrite import RewrittenStep
from ..report.schedule_report import write_report
from ..report.step_report import CallSummary, StepReport, build_step_report, step_markdown
from .compiled_graphs import GraphReport
from .graph import RematFallbackWarning
from .graph_compile import compile_graph, fall_back
from .graph_schedule import GraphScheduler
from .options import BackendOptions
from .graph_state import (Compiled, GraphState, Plain, Planned, Recorded, liveness_model, record, replan,
                          step_liveness)
from .eager_recorder import EagerRecording, eager_ops
from .step_recorder import RecordedStep

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


@dataclasses.dataclass(frozen=True)
class StepRecords:
    """The steps run so far.

    Attributes:
        log: one StepLogEntry per training step run.
        signatures: the ``RecordedStep.signature()`` of each entry of ``log``.
        composed: the composed StepReport by signature (emptied when graphs change:
            the next steps are composed anew). Never modified: a transition returns new
            StepRecords with a new dict.
        first_step: the composed report of the first step, as it ran (None before it
            ended).
        eager: the eager ops recorded in a step of each signature
            (``RecordedStep.eager``), used for every step of that signature.
    """

    log: tuple[StepLogEntry, ...] = ()
    signatures: tuple[tuple, ...] = ()
    composed: Mapping[tuple, StepReport] = dataclasses.field(default_factory=dict)
    first_step: StepReport | None = None
    eager: Mapping[tuple, EagerRecording] = dataclasses.field(default_factory=dict)

    def step_report(self, shape: Sequence[int] | None = None) -> StepReport | None:
        """``RematBackend.step_report``: the latest step's composed report, or the
        latest one whose input had ``shape``.

        Raises:
            KeyError: no step ran with ``shape`` (the message names the shapes seen).
        """
        want = None if shape is None else tuple(shape)
        for entry, sig in zip(reversed(self.log), reversed(self.signatures)):
            if want is None or (entry.input_shapes and entry.input_shapes[0] == want):
                return self.composed.get(sig)
        if want is None:
            return None
        seen = sorted({e.input_shapes[0] for e in self.log if e.input_shapes})
        raise KeyError(f"no step ran with input shape {list(want)}; shapes seen: {[list(s) for s in seen]}")


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What ``end_step`` ends in: the step records with the step logged, the graphs of
    the step recorded, and the step's composed report (None: not composed) with
    ``first`` True when it is the first step composed; ``step``: the recorded step
    with the eager ops of its signature (``StepRecords.eager``); ``new_eager``: they
    were recorded in this step."""

    records: StepRecords
    recorded: dict[str, Recorded]
    report: StepReport | None
    first: bool
    step: RecordedStep | None = None
    new_eager: bool = False


def end_step(records: StepRecords, states: Mapping[str, GraphState], rec: RecordedStep,
             scheduler: GraphScheduler) -> StepEnd:
    """A step ended: its graphs recorded and the step composed (unless a step of the same
    signature was: its report is taken), then logged. Not composed (a note instead):
    ``rec.problems`` (see ``not_composable``), or a graph of it runs un-rewritten or
    was not recorded."""
    sig = rec.signature()
    new_eager = rec.eager is not None and sig not in records.eager
    if new_eager:
        records = dataclasses.replace(records, eager={**records.eager, sig: rec.eager},
                                      composed={k: v for k, v in records.composed.items() if k != sig})
    elif rec.eager is None and sig in records.eager:
        rec = dataclasses.replace(rec, eager=records.eager[sig])
    first = rec.calls[0] if rec.calls else None
    shapes = tuple(s for s in (first.shapes if first else ()) if isinstance(s, tuple))
    report, note, recorded = records.composed.get(sig), "", {}
    if rec.problems:
        note = "; ".join(rec.problems)
    elif report is None:
        plain = [gid for gid, s in states.items() if isinstance(s, Plain)]
        missing = [c.graph_id for c in rec.calls if c.graph_id not in states]
        if plain or missing:
            note = f"graphs {plain or missing} run un-rewritten or were not recorded"
        else:
            recorded = record_step(states, rec, scheduler)
            report = compose({**states, **recorded}, rec, scheduler)
            records = dataclasses.replace(records, composed={**records.composed, sig: report})
    records = dataclasses.replace(records, log=(*records.log, StepLogEntry(
        rec.index, shapes, report.peak_bytes if report else None, note)), signatures=(*records.signatures, sig))
    if report is not None:
        logger.info("remat-pass step %d, input shapes %s: predicted step peak %s", rec.index,
                    [list(s) for s in shapes], fmt_bytes(report.peak_bytes))
    is_first = report is not None and records.first_step is None
    if is_first:
        records = dataclasses.replace(records, first_step=report)
    return StepEnd(records, recorded, report, is_first, rec, new_eager)


def eager_unrecorded(rec: RecordedStep) -> bool:
    """Whether eager code ran around the step's graphs (an input made by an eager
    autograd op, a last graph whose output 0 is not a loss) and was not recorded
    (``RecordedStep.eager``): its composition counts the eager ops' place only roughly."""
    last = rec.calls[-1].first_output_shape if rec.calls else ()
    return rec.eager is None and bool(rec.eager_inputs or last is None or math.prod(last) != 1)


def record_step(states: Mapping[str, GraphState], rec: RecordedStep, scheduler: GraphScheduler
                ) -> dict[str, Recorded]:
    """Every graph called in ``rec`` recorded (``graph_state.record``); each must be
    Compiled or Recorded."""
    return {c.graph_id: record(states[c.graph_id], scheduler) for c in rec.calls}


def _binding(symbols: Sequence[tuple[int, int | None, Any]], shapes: Sequence[Any]) -> dict[Any, int]:
    """The value of each shape symbol at a call's input ``shapes`` (``symbol_sources``)."""
    values = {}
    for i, dim, sym in symbols:
        s = shapes[i] if i < len(shapes) else None
        if dim is None and isinstance(s, int):
            values[sym] = s
        elif dim is not None and isinstance(s, tuple) and dim < len(s):
            values[sym] = s[dim]
    return values


def compose(states: Mapping[str, GraphState], rec: RecordedStep, scheduler: GraphScheduler,
            steps: Mapping[str, RewrittenStep] | None = None, fx: bool = False) -> StepReport:
    """The StepReport of a recorded step whose graphs are all Recorded in ``states``,
    every size evaluated at the shapes of the call (``evaluate_size``); ``steps``
    replaces graphs' rewrites (a step planner's candidates, their fx liveness); ``fx``:
    every graph's fx liveness, also under Inductor (the step planner's model)."""
    steps = steps or {}
    options = scheduler.options
    kept = rec.grad_kept_in_order()
    calls, summaries, seen = [], [], {}
    for c, k in zip(rec.calls, kept):
        g = states[c.graph_id]
        assert isinstance(g, Recorded), f"graph {c.graph_id} is not recorded"
        p = g.planned
        seen[c.graph_id] = seen.get(c.graph_id, 0) + 1
        label = c.graph_id if seen[c.graph_id] == 1 else f"{c.graph_id}#{seen[c.graph_id]}"
        values = _binding(p.symbols, c.shapes)
        live = (step_liveness(p, steps[c.graph_id], scheduler) if c.graph_id in steps
                else g.liveness["fx" if fx else liveness_model(g, options)])
        live = live.map_sizes(lambda b: evaluate_size(b, values, p.hints))
        calls.append(GraphCall(live, label, c.inputs_from, g.compiled.output_joint, g.compiled.output_tangent, k))
        summaries.append(CallSummary(label, c.graph_id, p.report.schedule, p.report.layers, c.shapes,
                                     p.report.peak_bytes))
    model = "inductor" if options.compiler == "inductor" else "fx"
    notes = [f"eager code between graphs ({', '.join(rec.eager_inputs)})"
             + ("" if rec.eager is not None else ": its ops are recorded from the next step of these shapes on")
             ] if rec.eager_inputs else []
    last = rec.calls[-1].first_output_shape if rec.calls else ()
    eager = None
    if rec.eager is not None:
        memory = scheduler.eager_memory_model(rec.eager.ops, states[rec.calls[0].graph_id].planned.allocator)
        eager = eager_ops(rec.eager, memory, [c.output_tangent for c in calls])
    elif last is None or math.prod(last) != 1:
        notes.append(f"the last graph's output 0 is not a loss (shape {list(last or [])}): eager code after the "
                     "compiled graphs computes it; its ops are recorded from the next step of these shapes on "
                     "(here the output is counted live to the end of the step in their place)")
    if model == "inductor" and (steps or fx or any(liveness_model(states[c.graph_id], options) == "fx"
                                             for c in rec.calls)):
        model = "fx"
        if not steps and not fx:
            notes.append("Inductor's code was not captured; the fx graphs are used")
    return build_step_report(rec.index, model, calls, summaries, rec.backward_order, notes, rec.held, eager)


@dataclasses.dataclass(frozen=True)
class PendingCheck:
    """A step plan made under Inductor, to be checked on the first step that runs it.

    The step planner models every graph with its fx liveness; under Inductor the step's
    peak is read from the generated code, which fuses and reuses buffers. The plan is
    made at the budget shifted by what the code saves on the first step
    (``saved_bytes``: fx step peak minus Inductor's, at the schedules that ran), so its
    Inductor peak is known only once its code exists and a step of the same signature
    has run (``check_replan``).

    Attributes:
        signature: the ``RecordedStep.signature()`` of the step planned against.
        previous: the states the re-planned graphs had (their compiled code kept).
        previous_peak_bytes: the Inductor-read peak of the step with ``previous``.
        saved_bytes: fx step peak minus Inductor-read step peak at ``previous``.
        rounds: the step plans made so far (at most ``INDUCTOR_ROUNDS``).
    """

    signature: tuple
    previous: dict[str, GraphState]
    previous_peak_bytes: int
    saved_bytes: int
    rounds: int = 1


INDUCTOR_ROUNDS = 3  # step plans under Inductor: the first, and two with the saving read at the plan before


@dataclasses.dataclass(frozen=True)
class StepReplan:
    """What ``replan_step`` ends in: every graph's state (the re-planned ones compiled
    again and recorded), the GraphReports of those compiles in order, the step composed
    with them, whether a step plan was made (then the composed steps so far are
    dropped: the next ones are composed anew), and, under Inductor, the check the next
    step of the same signature makes (``check_replan``)."""

    states: dict[str, GraphState]
    reports: tuple[GraphReport, ...]
    report: StepReport
    planned: bool
    pending: PendingCheck | None = None


def replan_step(states: Mapping[str, GraphState], rec: RecordedStep, report: StepReport,
                scheduler: GraphScheduler, earlier: Sequence[GraphReport], rounds: int = 1) -> StepReplan:
    """The graphs of the first composed step ``rec`` (``report``) re-planned against it
    (``schedule="optimized"``): every graph's schedule (``_layer_plan``) or op-level
    choice (``_op_plan``) chosen so that the composed step fits ``budget_bytes``, the
    graphs whose schedule changed compiled again (under grad mode: a training graph,
    recompiled at the end of a backward), and the step composed anew (``report`` itself
    when a graph's compile fell back: the step is not composable any more).

    The planner composes the fx liveness of every graph. Under Inductor (``report``
    read from the generated code) it plans at ``budget_bytes`` plus what the code saves
    against the fx model at the schedules that ran; a plan that changes a graph is
    checked on the next step of the same signature (``PendingCheck``, ``check_replan``),
    and one that fits is planned again from there with the saving read at it (the
    saving differs by schedule: some KiB per stored layer), ``INDUCTOR_ROUNDS`` plans at
    most, each starting from schedules that fit.

    Args:
        states: every graph's state (those of ``rec`` Recorded).
        rec, report: the first composed step (or, under Inductor, the first that ran
            the previous step plan) and its report.
        scheduler: the backend's GraphScheduler.
        earlier: the GraphReports so far (the recompiles' follow).
        rounds: which step plan this is (under Inductor).

    Raises:
        InfeasibleBudget: the budget is below the least feasible step peak (under
            Inductor: and below the peak of the step that ran) (``on_error="fallback"``:
            a RematFallbackWarning, and the least feasible schedules run).
    """
    options = scheduler.options
    budget = int(options.budget_bytes)
    saved = compose(states, rec, scheduler, fx=True).peak_bytes - report.peak_bytes
    plan = (_op_plan if options.op_level else _layer_plan)(states, rec, scheduler, budget + saved)
    if plan is None:
        return StepReplan(dict(states), (), report, False)
    changed, feasible, least_peak, least = plan
    if not feasible:
        if saved and report.peak_bytes <= budget:  # Inductor's code of the step that ran fits
            return StepReplan(dict(states), (), report, False)
        shifted = (f" (the fx model's least, less the {saved} bytes Inductor's code saves on the step that ran)"
                   if saved else "")
        error = infeasible(budget, least_peak - saved, f"the step with {least}{shifted}")
        if options.on_error != "fallback":
            raise error
        warnings.warn(f"remat-pass: {error}; running the least feasible schedules (on_error='fallback')",
                      RematFallbackWarning, stacklevel=4)
    new, reports = _compile_changed(states, changed, scheduler, earlier)
    pending = (PendingCheck(rec.signature(), {gid: states[gid] for gid in changed}, report.peak_bytes, saved,
                            rounds) if saved and changed else None)
    if any(isinstance(new[c.graph_id], Plain) for c in rec.calls):
        return StepReplan(new, reports, report, True)
    new.update(record_step(new, rec, scheduler))
    return StepReplan(new, reports, compose(new, rec, scheduler), True, pending)


def _compile_changed(states: Mapping[str, GraphState], changed: Mapping[str, Any], scheduler: GraphScheduler,
                     earlier: Sequence[GraphReport]) -> tuple[dict[str, GraphState], tuple[GraphReport, ...]]:
    """Every graph of ``changed`` compiled again with its schedule forced; the new
    states and the GraphReports of those compiles."""
    new, reports = dict(states), list(earlier)
    for gid, sched in changed.items():
        with torch.enable_grad():  # a training graph, recompiled at the end of a backward
            result = compile_graph(replan(new[gid], sched), scheduler, reports)
        new[gid] = result.state
        reports += result.reports
    return new, tuple(reports[len(earlier):])


def check_replan(pending: PendingCheck, rec: RecordedStep, report: StepReport, budget_bytes: int,
                 on_error: str) -> dict[str, GraphState] | None:
    """The first step of ``pending.signature`` that ran an Inductor step plan
    (``report``, read from its code): None when it fits ``budget_bytes`` or is not of
    that signature (checked later); else the previous states of the re-planned graphs,
    to run from the next step on (their code is kept), when the step with them fitted.

    Raises:
        InfeasibleBudget: neither fits (``on_error="fallback"``: a RematFallbackWarning,
            and the one of lower peak runs).
    """
    if rec.signature() != pending.signature or report.peak_bytes <= budget_bytes:
        return None
    logger.info("remat-pass: the Inductor step plan peaks at %s, above the budget %s; back to the schedules "
                "of the first step (%s)", fmt_bytes(report.peak_bytes), fmt_bytes(budget_bytes),
                fmt_bytes(pending.previous_peak_bytes))
    if pending.previous_peak_bytes > budget_bytes:
        least = min(pending.previous_peak_bytes, report.peak_bytes)
        error = infeasible(budget_bytes, least, "the step as Inductor's code runs it (the first step's schedules "
                           "and the step plan's, read from the code)")
        if on_error != "fallback":
            raise error
        warnings.warn(f"remat-pass: {error}; running the lower (on_error='fallback')", RematFallbackWarning,
                      stacklevel=4)
        if report.peak_bytes <= pending.previous_peak_bytes:
            return None
    return dict(pending.previous)


_Plan = tuple[dict[str, Any], bool, int, str]  # changed schedules, feasible, least peak, its text


def _layer_plan(states: Mapping[str, GraphState], rec: RecordedStep, scheduler: GraphScheduler,
                budget_bytes: int) -> _Plan | None:
    """Every graph's layer-level schedule chosen against the composed step
    (``step_planning.plan_step`` with ``WholeLayerGraph``s, on the fx graphs) at
    ``budget_bytes``; None when no graph of the step has layers."""
    graphs = {c.graph_id: states[c.graph_id] for c in rec.calls}
    current = {gid: g.planned.step.schedule for gid, g in graphs.items() if isinstance(g, Recorded)}
    planned = [WholeLayerGraph(gid, Planner(g.planned.joint, g.planned.stack, _graph_predict(g.planned, scheduler)),
                               current[gid], scheduler.in_place)
               for gid, g in graphs.items() if isinstance(g, Recorded) and g.planned.stack.num_layers]
    if not planned:
        return None
    plan = plan_step(planned, lambda steps: compose(states, rec, scheduler, steps, fx=True).peak_bytes,
                     budget_bytes)
    least = ", ".join(f"{gid}: {s.provenance}" for gid, s in plan.least_feasible.items())
    changed = {gid: s for gid, s in plan.choices.items() if s != current[gid]}
    return changed, plan.feasible, plan.least_feasible_peak_bytes, least


def _graph_predict(planned: Planned, scheduler: GraphScheduler) -> Callable[[schedules.Schedule], Any]:
    """The graph's own predicted report of a schedule (its planner's predictor)."""
    return lambda s: scheduler.predict(planned.joint, planned.stack, s, planned.allocator)


def _op_plan(states: Mapping[str, GraphState], rec: RecordedStep, scheduler: GraphScheduler,
             budget_bytes: int) -> _Plan | None:
    """``granularity="op"``: every graph's op-level choice picked against the composed
    step (``step_planning.plan_step`` with ``OpLevelGraph``s, on the fx graphs), from the
    choices the graphs were planned with alone (``Planned.op_plan``); None when no graph
    has one."""
    graphs = {c.graph_id: states[c.graph_id] for c in rec.calls}
    planned = [OpLevelGraph(gid, g.planned.op_plan.planner, g.planned.op_plan.solution, scheduler.in_place)
               for gid, g in graphs.items() if isinstance(g, Recorded) and g.planned.op_plan is not None]
    if not planned:
        return None
    plan = plan_step(planned, lambda steps: compose(states, rec, scheduler, steps, fx=True).peak_bytes,
                     budget_bytes)
    least = ", ".join(f"{gid}: op-level options {s.options or 'all 0'}, groups {list(s.groups)}"
                      for gid, s in plan.least_feasible.items())
    changed: dict[str, Partition] = {p.graph_id: plan.decisions[p.graph_id] for p in planned
                                     if plan.choices[p.graph_id] != p.current}
    return changed, plan.feasible, plan.least_feasible_peak_bytes, least


def not_composable(states: Mapping[str, GraphState], why: str, options: BackendOptions) -> dict[str, Plain]:
    """A step of these graphs cannot be composed (``why``): every graph not yet Plain
    falls back (``graph_compile.fall_back``, under grad mode: a training graph,
    recompiled from inside a backward, where grad mode is off and AOTAutograd would
    compile an inference graph).

    Returns:
        The graphs that fell back, by id.

    Raises:
        StepNotComposable: unless ``options.on_error`` is ``"fallback"``.
    """
    error = StepNotComposable(
        f"the training step cannot be composed into one timeline: {why}. The backend models "
        "one forward of every graph, then one loss.backward() running their backwards in "
        "reverse (autograd's order); call backward once per step on one loss, or compile with "
        "on_error='fallback' to run the graphs un-rewritten")
    if options.on_error != "fallback":
        raise error
    out = {}
    for gid, g in states.items():
        if isinstance(g, (Compiled, Recorded)):
            with torch.enable_grad():
                out[gid] = fall_back(g, error, options.compiler)
    return out


def write_step(folder: Path, report: StepReport) -> list[Path]:
    """Write the step's report to ``folder`` (``step.json``: ``StepReport.to_dict``,
    ``step.md``: ``step_markdown``); returns the files written."""
    js, md = folder / "step.json", folder / "step.md"
    write_report(js, report.to_dict())
    md.write_text(step_markdown(report), encoding="utf-8")
    return [js, md]
