"""The text and JSON of ``remat-pass model`` and ``remat-pass plan``: the symbolic model's
formulas and closed forms, and a layer-level or op-level plan against its budget."""

from __future__ import annotations

from typing import Any

import sympy

from solvers import closed_forms

from ..recompute import schedule as schedules
from ..recompute.schedule import Schedule, megatron_equivalent, megatron_flags
from ..formatting import fmt_bytes, fmt_flops
from ..plan.op_planner import OpPlan, OpPlanner
from ..plan.op_reuse import OpDecision, ReusedOpPlanner
from ..plan.chain_calibration import closed_forms as chain_closed_forms
from ..plan.planner import Plan
from .schedule_report import op_scratch_text
from ..evaluate.schedule_result import ScheduleResult
from ..liveness.symbolic import SymbolicModel


def symbolic_model_text(sm: SymbolicModel) -> str:
    """The symbolic formulas of ``sm`` as text and LaTeX (``remat-pass model``): the
    per-layer aggregates, the closed forms (``solvers.closed_forms``) and, at the traced
    shapes, how close they are to the exact liveness peak of every Megatron setting."""
    L = sm.num_layers
    agg = sm.aggregates()
    traced_at = ", ".join(f"{k}={v}" for k, v in sm.hints.items())
    several = len(sm.stack.stacks) > 1
    where = f"layer stacks {sm.stack.describe()}, L = {L} in all" if several else f"layer stack {sm.stack.path!r}, L = {L}"
    lines = [f"{where}; symbols {', '.join(sm.gens)} (traced at {traced_at}); bytes, fp as traced", ""]
    lines.append("per-layer aggregates (read off the graph):")
    for name, label in (("checkpoint_bytes", "s  (saved as a group of one)"),
                        ("stored_layer_bytes", "a  (saved when stored)"),
                        ("forward_flops", "forward FLOPs"), ("recompute_flops", "recompute FLOPs (alone)")):
        vals = agg[name]
        if all(sympy.simplify(v - vals[0]) == 0 for v in vals):
            lines.append(f"  {label:32s} = {vals[0]}   (every layer)")
        else:
            lines += [f"  {label:32s} layer {i} = {v}" for i, v in enumerate(vals)]
    lines.append(f"  {'outer saved bytes':32s} = {agg['outer_saved_bytes']}")
    lines.append("")
    if several:
        return "\n".join(lines + _several_stacks_text(sm))
    cf = chain_closed_forms(sm)
    lines.append(f"chain-model terms (middle layer): s = {cf.checkpoint_bytes}, a = {cf.stored_layer_bytes}, "
                 f"g = {cf.param_grad_bytes} (parameter-gradient bytes)")
    for (sym, ex), what in zip(cf.region_peaks.items(), ("top layer's backward, rebuilt",
                                                         "top layer's backward, stored", "head", "rest of outer")):
        lines.append(f"  {sym} = {ex}   ({what})")
    lines.append("")
    lines.append(f"peak_uniform(K) = {cf.peak_uniform}")
    lines.append(f"peak_block(N)   = {cf.peak_block}")
    lines.append(f"K* (continuous) = {cf.k_star}")
    if sm.hints:
        at = {sm.symbol(k): v for k, v in sm.hints.items()}
        exact = {k: sm.peak_at(schedules.uniform(k, L), **sm.hints) for k in range(1, L + 1)}
        closed = {k: cf.evaluate(cf.peak_uniform, at, K=k, L=L) for k in exact}
        exact_b = {n: sm.peak_at(schedules.block(n, L), **sm.hints) for n in range(0, L + 1)}
        closed_b = {n: cf.evaluate(cf.peak_block, at, N=n, L=L) for n in exact_b}
        best = min(exact, key=lambda k: (exact[k], k))
        kstar = cf.k_star.xreplace(at).xreplace({closed_forms.L: L})
        err_u = max(abs(closed[k] - exact[k]) / exact[k] for k in exact)
        err_b = max(abs(closed_b[n] - exact_b[n]) / exact_b[n] for n in exact_b)
        lines.append(f"at {', '.join(f'{k}={v}' for k, v in sm.hints.items())}: K* = {float(kstar):.2f}; "
                     f"the exact peak of uniform(K) is least at K = {best} ({fmt_bytes(exact[best])}); "
                     f"closed forms vs exact liveness peaks: uniform K=1..{L} within {100 * err_u:.2f} %, "
                     f"block N=0..{L} within {100 * err_b:.2f} %")
    lines.append("")
    lines.append("LaTeX:")
    lines.append(f"  \\mathrm{{peak}}_{{uniform}}(K) = {sympy.latex(cf.peak_uniform)}")
    lines.append(f"  \\mathrm{{peak}}_{{block}}(N) = {sympy.latex(cf.peak_block)}")
    lines.append(f"  K^* = {sympy.latex(cf.k_star)}")
    return "\n".join(lines)


def _several_stacks_text(sm: SymbolicModel) -> list[str]:
    """For a chain of several stacks: the exact peak of every Megatron setting (applied
    per stack) at the traced shapes; the closed forms in K / N describe one stack of
    identical layers and are not printed."""
    per_stack = sm.stack.layers_per_stack
    none_terms = len(sm.profile(schedules.none(per_stack)).peak())
    lines = [f"closed forms in K / N describe one stack; this step chains {len(per_stack)} stacks, "
             "so the exact liveness peaks follow (uniform / block applied to each stack; "
             f"SymbolicModel.peak(schedule) gives each as a Max of polynomials: {none_terms} for none)."]
    if sm.hints:
        lines.append(f"at {', '.join(f'{k}={v}' for k, v in sm.hints.items())}:")
        for sch in schedules.megatron_schedules(per_stack):
            lines.append(f"  {sch.provenance:14s} {fmt_bytes(sm.peak_at(sch, **sm.hints))}")
    return lines


def plan_text(plan: Plan, result: ScheduleResult, calibrate_s: float, total_s: float) -> str:
    """What ``remat-pass plan --budget`` prints: the schedule, its predicted and measured
    peak against the budget, recompute, gradients, and the solver's figures."""
    p, b = plan, plan.budget_bytes
    measured = result.measured_peak_bytes
    lines = [
        f"budget             {b} bytes ({fmt_bytes(b)})",
        f"schedule           {p.describe()}",
        f"  groups           {' '.join(str(list(g)) for g in p.schedule.groups) or 'none'}",
        f"  stored layers    {' '.join(map(str, p.schedule.stored_layers)) or 'none'} (of L={p.schedule.num_layers})",
        f"Megatron-LM        {megatron_text(p.schedule)}",
        f"predicted peak     {p.predicted_peak_bytes} bytes ({fmt_bytes(p.predicted_peak_bytes)}); "
        f"chain model {p.model_peak_bytes}",
        (f"measured peak      {measured} bytes ({fmt_bytes(measured)}), {100 * (measured - b) / b:+.2f} % vs budget"
         if measured is not None else "measured peak      - (predicted only: nothing was run)" if result.predicted_only
         else "measured peak      - (not reported: the gradients differ)"),
        f"recompute          {p.recompute_flops} FLOPs ({fmt_flops(p.recompute_flops)}) = "
        f"{100 * p.recompute_fraction:.1f} % of forward",
        (f"gradients          {'bitwise equal' if result.grads_equal else result.grads_text()} to the "
         "un-rewritten step" if not result.predicted_only else "gradients          - (predicted only: nothing was run)"),
        f"unconstrained peak {p.unconstrained_peak_bytes} bytes ({fmt_bytes(p.unconstrained_peak_bytes)}, none)",
        f"least feasible     {p.least_feasible_peak_bytes} bytes ({fmt_bytes(p.least_feasible_peak_bytes)})",
        f"solve time         {1000 * p.solve_time_s:.1f} ms ({p.resolves} re-solves; calibration "
        f"{calibrate_s:.2f} s; total {total_s:.1f} s)",
    ]
    scratch = _plan_scratch(p)
    if scratch is not None:
        lines.append(f"op scratch at peak {op_scratch_text(scratch)}")
    if measured is not None and measured > b:
        lines.append(f"OVER BUDGET        the measured peak exceeds the budget by {measured - b} bytes "
                     f"({fmt_bytes(measured - b)})")
    return "\n".join(lines)


def megatron_text(schedule: Schedule) -> str:
    """The Megatron-LM flags of a plan's schedule when one setting recomputes the same
    groups (``schedule.megatron_equivalent``), else why no flag expresses it."""
    same = megatron_equivalent(schedule)
    if same is None:
        return ("not expressible with --recompute-method uniform / block (its groups are not K layers each over "
                "the whole stack, nor the first N layers one by one); apply it with this project's rewrite")
    return f"{megatron_flags(same.method, same.recompute_num_layers)} ({same.provenance})"


def megatron_json(schedule: Schedule) -> dict[str, Any] | None:
    """``{"provenance", "flags"}`` of the equal Megatron-LM setting, or None."""
    same = megatron_equivalent(schedule)
    if same is None:
        return None
    return {"provenance": same.provenance, "flags": megatron_flags(same.method, same.recompute_num_layers)}


def _plan_scratch(p: Plan) -> dict[str, Any] | None:
    m = p.peak_scratch
    if m is None:
        return None
    return {"threads": p.threads, "peak_could_move_bytes": p.peak_could_move_bytes,
            "at_peak": {"node": m.node, "op": m.op, "bytes": m.scratch_bytes, "source": m.source, "detail": m.detail}}


def plan_json(plan: Plan, result: ScheduleResult) -> dict[str, Any]:
    """The ``remat-pass plan --json`` document."""
    p = plan
    return {
        "budget_bytes": p.budget_bytes,
        "schedule": {
            "description": p.describe(),
            "provenance": p.schedule.provenance,
            "groups": [list(g) for g in p.schedule.groups],
            "stored_layers": list(p.schedule.stored_layers),
            "num_layers": p.schedule.num_layers,
        },
        "megatron": megatron_json(p.schedule),
        "predicted_peak_bytes": p.predicted_peak_bytes,
        "model_peak_bytes": p.model_peak_bytes,
        "measured_peak_bytes": result.measured_peak_bytes,
        "recompute_flops": p.recompute_flops,
        "forward_flops": p.forward_flops,
        "recompute_fraction": p.recompute_fraction,
        "grads_equal": result.grads_equal,
        "grads_within_run_to_run": result.grads_within_run_to_run,
        "least_feasible_peak_bytes": p.least_feasible_peak_bytes,
        "unconstrained_peak_bytes": p.unconstrained_peak_bytes,
        "solve_time_s": p.solve_time_s,
        "measured_over_budget": result.measured_peak_bytes is not None and result.measured_peak_bytes > p.budget_bytes,
        "op_scratch_at_peak": (_plan_scratch(p) or {}).get("at_peak"),
        "peak_could_move_bytes": p.peak_could_move_bytes,
    }


def op_plan_text(plan: OpPlan, result: ScheduleResult, planner: OpPlanner | ReusedOpPlanner, total_s: float) -> str:
    """What ``remat-pass plan --granularity op`` prints: the groups and each stored
    layer's trade-off point, predicted and measured peak against the budget, recompute
    FLOPs and bytes moved, gradients, and the solver's figures."""
    p, b = plan, plan.budget_bytes
    measured = result.measured_peak_bytes
    from_template = isinstance(p.partition, OpDecision)
    L = p.partition.num_layers if from_template else planner.stack.num_layers
    options = p.options or (0,) * L
    inside = {i for g in p.groups for i in g}
    per_layer = " ".join("G" if i in inside else str(options[i]) for i in range(L))
    fronts = ", ".join(f"layers {list(k.layers)}: {len(f)} points" for k, f in zip(planner.kinds, planner.fronts))
    lines = [
        f"budget             {b} bytes ({fmt_bytes(b)})",
        f"partition          {p.partition.provenance}",
        f"  groups           {' '.join(str(list(g)) for g in p.groups) or 'none'}",
        f"  per layer        {per_layer}  (G: in a group; k: k-th point of the layer's trade-off, 0: all saved)",
        (f"  saved values     {p.saved_nodes}; recomputed nodes {p.recomputed_nodes}" if not from_template else
         f"  saved storages   {p.saved_nodes}; recomputed steps {p.recomputed_nodes} (the {L}-layer step "
         f"assembled from a {planner.stack.num_layers}-layer template: --trace-all-layers names the nodes)"),
        f"predicted peak     {p.predicted_peak_bytes} bytes ({fmt_bytes(p.predicted_peak_bytes)}); "
        f"chain model {p.model_peak_bytes}",
        (f"measured peak      {measured} bytes ({fmt_bytes(measured)}), {100 * (measured - b) / b:+.2f} % vs budget"
         if measured is not None else "measured peak      - (predicted only: nothing was run)" if result.predicted_only
         else "measured peak      - (not reported: the gradients differ)"),
        f"recompute          {p.recompute_flops} FLOPs ({fmt_flops(p.recompute_flops)}), "
        f"{p.recompute_bytes_moved} bytes moved "
        f"(cost {p.recompute_cost} in the cost model's unit)",
        (f"gradients          {'bitwise equal' if result.grads_equal else result.grads_text()} to the "
         "un-rewritten step" if not result.predicted_only else "gradients          - (predicted only: nothing was run)"),
        f"unconstrained peak {p.unconstrained_peak_bytes} bytes ({fmt_bytes(p.unconstrained_peak_bytes)})",
        f"least feasible     {p.least_feasible_peak_bytes} bytes ({fmt_bytes(p.least_feasible_peak_bytes)})",
        f"layer kinds        {fronts}",
        f"solve time         {1000 * p.solve_time_s:.1f} ms ({p.resolves} re-solves; layer programs and "
        f"calibration {planner.prepare_s:.2f} s; total {total_s:.1f} s)",
        f"search             {'exact' if p.bound is None else 'bounded: ' + p.bound}",
    ]
    return "\n".join(lines)


def op_plan_json(plan: OpPlan, result: ScheduleResult) -> dict[str, Any]:
    """The ``remat-pass plan --granularity op --json`` document."""
    p = plan
    from_template = isinstance(p.partition, OpDecision)
    return {
        "budget_bytes": p.budget_bytes,
        "granularity": "op",
        "partition": {
            "provenance": p.partition.provenance,
            "policy": p.partition.policy,
            "groups": [list(g) for g in p.groups],
            "options": list(p.options),
            # None: the step was assembled from a template (layer reuse), nodes not named
            "saved": None if from_template else [s.name for s in p.partition.saved],
            "recomputed": None if from_template else list(p.partition.recomputed_names),
        },
        "saved_nodes": p.saved_nodes,
        "recomputed_nodes": p.recomputed_nodes,
        "predicted_peak_bytes": p.predicted_peak_bytes,
        "model_peak_bytes": p.model_peak_bytes,
        "measured_peak_bytes": result.measured_peak_bytes,
        "recompute_flops": p.recompute_flops,
        "recompute_bytes_moved": p.recompute_bytes_moved,
        "recompute_cost": p.recompute_cost,
        "forward_flops": p.forward_flops,
        "grads_equal": result.grads_equal,
        "grads_within_run_to_run": result.grads_within_run_to_run,
        "least_feasible_peak_bytes": p.least_feasible_peak_bytes,
        "unconstrained_peak_bytes": p.unconstrained_peak_bytes,
        "solve_time_s": p.solve_time_s,
        "search_bound": p.bound,
        "proven_gap_cost": p.gap_cost,
    }
