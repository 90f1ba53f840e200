"""The ``model`` and ``plan`` commands: the symbolic memory model (peak formulas in
batch / seq), and the optimized schedule under a peak budget (``--granularity layer``:
``planner``; ``op``: ``op_planner``) or the largest batch per Megatron setting
(``--max-batch``), checked against a measurement where the step can run.

With ``--tp`` / ``--pp`` / ``--fsdp``, ``plan`` hands over to ``cli_parallel.plan_parallel``.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..recompute import schedule as schedules
from .parallel import parallel_config, plan_parallel
from .common import EXIT_FAILED, EXIT_OK, calibration_note, load, static_line, whole_session
from ..models.configs import ModelSpec, build_factory, build_from_config, check_spec, default_task, load_config
from ..errors import InfeasibleBudget
from ..formatting import fmt_bytes, mib, parse_bytes, text_table
from ..plan.op_planner import CostModel, OpPlanner
from ..plan.op_reuse import OpDecision, ReusedOpPlanner
from ..plan.planner import max_batch_rows
from ..graph.regions import LayerStack
from ..report.plan_report import op_plan_json, op_plan_text, plan_json, plan_text, symbolic_model_text
from ..report.documents import write_document
from ..evaluate.schedule_result import ScheduleResult, predicted_result
from ..liveness.symbolic import default_symbols, trace_symbolic
from ..evaluate.workload import DEFAULT_MODEL, Workload

def _stacks_text(stack: LayerStack) -> str:
    """``layer stack 'transformer.h' with L=12`` or, for several, each stack's layers."""
    if len(stack.stacks) == 1:
        return f"layer stack {stack.path!r} with L={stack.num_layers}"
    return f"{len(stack.stacks)} layer stacks, L={stack.num_layers} in all: {stack.describe()}"


def _model_for_symbols(args: argparse.Namespace):  # noqa: ANN202
    """``(model, inputs, loss_fn)`` for the symbolic model (a factory or a config)."""
    if args.target != "cpu" or args.autocast:
        raise ValueError("model (symbolic shapes) traces for --target cpu without --autocast")
    if args.config:
        config = load_config(args.config)
        spec = ModelSpec(task=args.task or default_task(config), dtype=args.dtype or "float32", meta=args.meta,
                         batch=args.batch or 2, seq=args.seq or 128, seed=args.seed, layers=args.layers)
        check_spec(config, spec)
        return build_from_config(config, spec)
    return build_factory(args.model or DEFAULT_MODEL, meta=args.meta, dtype=args.dtype, batch=args.batch, seq=args.seq,
                         layers=args.layers)


def cmd_model(args: argparse.Namespace) -> int:
    """Trace with symbolic batch / seq and print the formulas (text and LaTeX)."""
    model, inputs, loss_fn = _model_for_symbols(args)
    t0 = time.perf_counter()
    sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs), layers=args.stack)
    print(f"traced {type(model).__name__} with symbolic shapes ({time.perf_counter() - t0:.1f}s); "
          f"{_stacks_text(sm.stack)}", file=sys.stderr, flush=True)
    _profile_with_progress(sm)
    print(symbolic_model_text(sm))
    return EXIT_OK


def _profile_with_progress(sm) -> None:  # noqa: ANN001 - a SymbolicModel
    """Profile every schedule ``symbolic_model_text`` reads (cached by the model), one
    line on stderr each, so a long model shows where it is."""
    per_stack = sm.stack.layers_per_stack
    todo = list(dict.fromkeys([*schedules.megatron_schedules(per_stack),
                               schedules.uniform(max(per_stack), per_stack)]))
    t0 = time.perf_counter()
    for i, sched in enumerate(todo, 1):
        sm.profile(sched)
        print(f"[{i:2d}/{len(todo)}] symbolic liveness of {sched.provenance} ({time.perf_counter() - t0:.1f}s)",
              file=sys.stderr, flush=True)


def _budget(args: argparse.Namespace, w: Workload | None) -> int:
    """The activation budget: --budget, what --device-memory leaves, or the smaller."""
    budgets = [parse_bytes(args.budget)] if args.budget else []
    if w is not None and w.device_memory_bytes is not None:
        left = w.activation_budget()
        print(f"{static_line(w)}", file=sys.stderr)
        budgets.append(left)
    if not budgets:
        raise ValueError("plan needs --budget SIZE (activation bytes) or --device-memory SIZE")
    return min(budgets)


def cmd_plan(args: argparse.Namespace) -> int:
    """The optimized schedule under --budget / --device-memory (or the largest batch per
    schedule); per rank and pipeline stage with --tp / --pp / --fsdp."""
    config = parallel_config(args)
    if config is not None:
        plan_parallel(args, config)
        return EXIT_OK
    if args.max_batch:
        budget = _budget(args, None)
        model, inputs, loss_fn = _model_for_symbols(args)
        sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs), layers=args.stack)
        rows = max_batch_rows(sm, budget)
        print(f"largest batch within {budget} bytes ({fmt_bytes(budget)}), "
              f"{', '.join(f'{k}={v}' for k, v in sm.hints.items() if k != 'batch')} "
              "(predicted peaks, by the symbolic model; nothing was run at these batches):")
        print(text_table(
            ["schedule", "largest batch", "peak MiB", "peak at batch+1 MiB"],
            [[r["schedule"], str(r["batch"]), mib(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
              mib(r["next_peak_bytes"])] for r in rows],
        ))
        if args.json:
            write_document(args.json, "remat-pass-plan",
                           {"budget_bytes": budget, "predicted_only": True, "rows": rows})
        return EXIT_OK
    if not args.budget and not args.device_memory:
        raise ValueError("plan needs --budget SIZE (activation bytes) or --device-memory SIZE")
    w = load(args)
    budget = _budget(args, w)
    if args.granularity == "op":
        return _plan_op(args, w, budget)
    t0 = time.perf_counter()
    planner = w.planner()
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        if args.json:
            write_document(args.json, "remat-pass-plan", {
                "budget_bytes": budget, "schedule": None, "error": str(e),
                "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                "unconstrained_peak_bytes": planner.unconstrained_peak_bytes,
            })
        raise
    result = w.result(plan.schedule)
    calibration_note(w)
    print(plan_text(plan, result, planner.calibrate_s, time.perf_counter() - t0))
    if args.json:
        doc = plan_json(plan, result)
        doc.update(static=w.static.to_dict(), static_bytes=w.static.total_bytes,
                   device_memory_bytes=w.device_memory_bytes, predicted_only=w.predicted_only)
        write_document(args.json, "remat-pass-plan", doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return _plan_outcome(result, budget, plan.schedule.provenance, plan.predicted_peak_bytes)


def _plan_outcome(result: ScheduleResult, budget: int, provenance: str, predicted_peak_bytes: int) -> int:
    """EXIT_OK, or EXIT_FAILED saying why: the plan's gradients differ from the
    un-rewritten step, or its measured peak exceeds the budget (a predicted-only plan
    is not measured: EXIT_OK)."""
    if result.predicted_only:
        return EXIT_OK
    if not result.grads_match:
        print(f"remat-pass plan: error: the gradients of {provenance} differ from the "
              "un-rewritten step", file=sys.stderr)
        return EXIT_FAILED
    if result.measured_peak_bytes > budget:
        print(f"remat-pass plan: error: the measured peak {result.measured_peak_bytes} bytes "
              f"({fmt_bytes(result.measured_peak_bytes)}) exceeds the budget {budget} bytes ({fmt_bytes(budget)}) "
              f"by {result.measured_peak_bytes - budget} bytes; predicted {predicted_peak_bytes} bytes",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _plan_op(args: argparse.Namespace, w: Workload, budget: int) -> int:
    """``plan --granularity op``: the op-level optimum under the budget, measured when
    the step can run."""
    t0 = time.perf_counter()
    cost_model = CostModel(args.flops_per_byte, timed=args.timed_costs)
    planner: OpPlanner | ReusedOpPlanner
    if w.session is None and w.reuse is not None:
        if args.timed_costs:
            raise ValueError("--timed-costs runs every forward op, and this step has no weights to run it on; "
                             "use the roofline cost (--flops-per-byte)")
        planner = ReusedOpPlanner(w.reuse, cost_model)
    else:
        session = whole_session(w, "plan --granularity op")
        planner = OpPlanner(session.joint, session.stack, w.report, cost_model)
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        if args.json:
            write_document(args.json, "remat-pass-plan", {
                "budget_bytes": budget, "granularity": "op", "partition": None, "error": str(e),
                "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                "unconstrained_peak_bytes": planner.unconstrained_peak_bytes})
        raise
    if isinstance(plan.partition, OpDecision):  # analysed from a template: predicted only
        none_peak = w.report(schedules.none(w.layers_per_stack)).peak_bytes
        result = predicted_result(plan.partition, planner.report(plan.partition), none_peak,
                                  plan.solve_time_s, w.static)
    else:
        result = w.result(plan.partition)
    calibration_note(w)
    print(op_plan_text(plan, result, planner, time.perf_counter() - t0))
    if args.json:
        write_document(args.json, "remat-pass-plan", op_plan_json(plan, result))
        print(f"wrote {args.json}", file=sys.stderr)
    return _plan_outcome(result, budget, plan.partition.provenance, plan.predicted_peak_bytes)
