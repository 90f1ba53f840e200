"""The ``remat-pass`` command line (argparse).

Subcommands:
    sweep   every Megatron recompute setting on a model: predicted vs measured peak.
    inspect the rewritten forward / backward graphs of a model or of a graph dump.
    report  liveness report: Markdown, versioned JSON, PNG timeline.
    check   CI gate: exit 1 when the predicted peak exceeds a budget or regresses.
    model   symbolic memory model: peak formulas in batch / seq.
    plan    optimized schedule under a peak budget (--granularity layer | op);
            --max-batch: largest batch.

Op-level policies (``sweep``): ``--selective`` (Megatron-LM
``--recompute-granularity selective``), ``--recompute-modules core_attn,mlp``
(Megatron-Core's names), ``--policy dots_saveable`` (JAX's names), with
``--module-kind KIND=PATH`` naming modules that are not recognised.

Every subcommand that takes a model accepts ``--model module:factory`` (default: the
shipped GPT-2), ``--batch``, ``--seq``, ``--layers`` (number of layers, passed to the
factory) and ``--stack`` (module path of a layer stack, repeatable for several, when
they are not found automatically).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from . import schedule as schedules
from .errors import InfeasibleBudget, InvalidSchedule, RematError
from .calibration import CACHE_ENV, CalibrationOptions
from .formatting import fmt_bytes, mib, parse_bytes, text_table
from .gate import gate
from .inspection import describe_step, dump_step, load_dump, render
from .measure import measured_step_timeline
from .models import build
from .op_planner import CostModel, OpPlanner
from .partition import Partition
from .planner import Planner, max_batch_rows
from .policies import KINDS, POLICIES, recompute_modules, save_policy
from .plot import plot_timeline
from .regions import LayerStack
from .report import (
    SWEEP_COLUMNS,
    op_plan_json,
    op_plan_text,
    plan_json,
    plan_text,
    read_reports,
    report_json,
    report_markdown,
    reports_document,
    summary_markdown,
    sweep_rows,
    symbolic_model_text,
    write_json,
    write_report,
)
from .sweep import ScheduleResult, Session, sweep
from .symbolic import default_symbols, trace_symbolic

DEFAULT_MODEL = "remat_pass.models:gpt2"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be 1 or more")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add the options that choose the model and its input."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="MODULE:FACTORY",
                   help="factory returning (model, example_inputs, loss_fn) (default: %(default)s)")
    g.add_argument("--batch", type=positive_int, help="batch size passed to the factory")
    g.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    g.add_argument("--layers", type=positive_int, help="number of layers passed to the factory")
    g.add_argument("--stack", metavar="PATH", action="append",
                   help="module path of a layer stack (e.g. transformer.h); repeat it for several "
                        "(--stack encoder.block --stack decoder.block); every stack is found automatically "
                        "if omitted")
    g.add_argument("--seed", type=int, default=0, help="RNG seed for every run (default: 0)")
    g = p.add_argument_group("op scratch")
    g.add_argument("--no-calibrate", action="store_true",
                   help="do not run ops to calibrate their scratch memory; use the ATen formula table only")
    g.add_argument("--calibration-cache", metavar="DIR",
                   help=f"folder of the calibration cache (default: ${CACHE_ENV} or ~/.cache/remat-pass)")


def load_session(args: argparse.Namespace) -> Session:
    """Build the model from the factory and trace it (prints what it does to stderr)."""
    model, inputs, loss_fn = build(args.model, batch=args.batch, seq=args.seq, layers=args.layers)
    t0 = time.perf_counter()
    calibration = None if args.no_calibrate else CalibrationOptions(cache_dir=args.calibration_cache)
    session = Session.create(model, inputs, loss_fn, layers=args.stack, seed=args.seed, calibration=calibration)
    print(
        f"traced {type(model).__name__}: {len(session.joint.gm.graph.nodes)} joint nodes, "
        f"{_stacks_text(session.stack)} ({time.perf_counter() - t0:.1f}s)",
        file=sys.stderr,
    )
    return session


def calibration_note(session: Session) -> None:
    """Say on stderr how many op signatures were calibrated now, in how long, where the
    figures are kept."""
    cal = session.calibrator
    if cal is not None and cal.calibrated_signatures:
        print(f"calibrated the scratch memory of {cal.calibrated_signatures} op signatures in "
              f"{cal.calibrate_s:.1f}s (cached in {cal.path})", file=sys.stderr)


def _stacks_text(stack: LayerStack) -> str:
    """``layer stack 'transformer.h' with L=12`` or, for several, each stack's layers."""
    if len(stack.stacks) == 1:
        return f"layer stack {stack.path!r} with L={stack.num_layers}"
    return f"{len(stack.stacks)} layer stacks, L={stack.num_layers} in all: {stack.describe()}"


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """Add the op-level policy options (selective recompute, recompute modules, save policies)."""
    g = p.add_argument_group("op-level policy")
    g.add_argument("--selective", action="store_true",
                   help="Megatron-LM --recompute-granularity selective: recompute core attention")
    g.add_argument("--recompute-modules", metavar="KINDS",
                   help="Megatron-Core --recompute-modules, comma-separated: core_attn, mlp, layernorm, moe_act, "
                        "moe, shared_experts")
    g.add_argument("--policy", metavar="NAME",
                   help="a JAX save policy: dots_saveable, dots_with_no_batch_dims_saveable, nothing_saveable, "
                        "everything_saveable, save_only_these_names, save_anything_except_these_names")
    g.add_argument("--policy-names", metavar="NAMES",
                   help="comma-separated node names or module paths inside a layer, for the *_names policies")
    g.add_argument("--module-kind", action="append", metavar="KIND=PATH", default=[],
                   help="name the modules of a kind (paths inside a layer, fnmatch patterns); repeatable")


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def op_partition(args: argparse.Namespace, session: Session,
                 schedule: schedules.Schedule | None = None) -> Partition | None:
    """The op-level Partition the policy options ask for (None when none is given).

    Raises:
        ValueError: more than one policy option, or a --module-kind without ``=``.
        InvalidSchedule: an unknown kind or policy, or a kind the model does not have.
    """
    chosen = [o for o in ("selective", "recompute_modules", "policy") if getattr(args, o, None)]
    if len(chosen) > 1:
        raise ValueError("give one of --selective, --recompute-modules, --policy")
    names: dict[str, list[str]] = {}
    for item in getattr(args, "module_kind", []) or []:
        kind, sep, path = item.partition("=")
        if not sep or not kind or not path:
            raise ValueError(f"--module-kind {item!r}: expected KIND=PATH, e.g. mlp=ffn")
        names.setdefault(kind, []).append(path)
    if not chosen:
        if getattr(args, "policy_names", None):
            raise ValueError("--policy-names goes with --policy save_only_these_names or "
                             "save_anything_except_these_names")
        return None
    if args.selective or args.recompute_modules:
        kinds = ["core_attn"] if args.selective else _split(args.recompute_modules)
        return recompute_modules(session.joint, session.stack, kinds, names, schedule)
    return save_policy(session.joint, session.stack, args.policy, _split(args.policy_names), schedule)


def check_policy_names(args: argparse.Namespace) -> None:
    """Refuse unknown module kinds and policies before tracing (the names alone).

    Raises:
        ValueError: more than one of --selective, --recompute-modules, --policy.
        InvalidSchedule: a kind outside ``policies.KINDS`` or a policy outside
            ``policies.POLICIES`` (the message lists them).
    """
    if sum(bool(getattr(args, o, None)) for o in ("selective", "recompute_modules", "policy")) > 1:
        raise ValueError("give one of --selective, --recompute-modules, --policy")
    kinds = _split(args.recompute_modules) + [k.partition("=")[0] for k in args.module_kind]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise InvalidSchedule(f"module kind(s) {bad} are not recompute modules; the kinds are {', '.join(KINDS)}")
    if args.policy and args.policy not in POLICIES:
        raise InvalidSchedule(f"save policy {args.policy!r} does not exist; the policies are {', '.join(POLICIES)}")


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run every Megatron setting (or an op-level policy with block); print the table,
    write --json."""
    check_policy_names(args)
    session = load_session(args)
    per_stack = session.stack.layers_per_stack
    todo: list = list(schedules.megatron_schedules(per_stack))
    policy = op_partition(args, session)
    if policy is not None:  # the policy alone, then with block(N) (uniform leaves no stored layer)
        todo = [schedules.none(per_stack), policy] + [op_partition(args, session, schedules.block(n, per_stack))
                                                       for n in range(1, min(per_stack))]

    def progress(i: int, n: int, s, r) -> None:  # noqa: ANN001
        peaks = (f"predicted {mib(r.predicted_peak_bytes):>8s} MiB  measured {mib(r.measured_peak_bytes):>8s} MiB"
                 if r.grads_match else "predicted        - MiB  measured        - MiB")
        print(f"[{i:2d}/{n}] {s.provenance:14s} {peaks}  grads {r.grads_text()}  ({r.measure_time_s:.1f}s)",
              file=sys.stderr, flush=True)

    results = sweep(session, todo, progress=progress)
    calibration_note(session)
    print(text_table(SWEEP_COLUMNS, sweep_rows(results)))
    noisy = [r for r in results if r.grads_within_run_to_run]
    if noisy:
        print(f"note: the un-rewritten step's backward is not bitwise reproducible (its gradients differ by up "
              f"to {max(r.run_to_run_grad_diff for r in noisy):.2g} between two runs with the same seed, e.g. a "
              "parallel reduction on several threads); the gradients of "
              f"{', '.join(r.provenance for r in noisy)} were compared against that difference instead of bit "
              "for bit (\"within\" in the table). One thread (torch.set_num_threads(1)) may make it reproducible.")
    if args.json:
        write_json(args.json, {
            "model": args.model,
            "layer_stack": session.stack.path,
            "num_layers": session.stack.num_layers,
            **_stacks_meta(session.stack),
            "static_bytes": sum(int(v.untyped_storage().nbytes()) for v in session.joint.primal_values),
            "rows": [r.to_dict() for r in results],
        })
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK if all(r.grads_match for r in results) else EXIT_FAILED


class _DeprecatedAlias(argparse.Action):
    """An old option name that still works for one release, with a note on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        print(f"remat-pass: {option_string} is deprecated (it is K or N, not the number of layers L); "
              "use --recompute-num-layers", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_schedule_args(p: argparse.ArgumentParser, allow_all: bool = True) -> None:
    """Add ``--schedule none|uniform|block``, ``--recompute-num-layers K`` (old name
    ``--num-layers``, deprecated) and ``--all-schedules``."""
    g = p.add_argument_group("schedule")
    g.add_argument("--schedule", choices=("none", "uniform", "block"), default="none",
                   help="recompute method (Megatron-LM --recompute-method; default: %(default)s)")
    g.add_argument("--recompute-num-layers", type=int, metavar="K", dest="recompute_num_layers",
                   help="K for uniform, N for block (Megatron-LM --recompute-num-layers)")
    g.add_argument("--num-layers", type=int, metavar="K", dest="recompute_num_layers", action=_DeprecatedAlias,
                   help=argparse.SUPPRESS)
    if allow_all:
        g.add_argument("--all-schedules", action="store_true",
                       help="every Megatron setting: none, uniform K=1..L, block N=0..L")
    g.add_argument("--allocator", choices=("cpu", "cuda"), default="cpu",
                   help="allocator model for the predicted bytes (default: %(default)s)")


def _schedules(args: argparse.Namespace, stack: LayerStack) -> list[schedules.Schedule]:
    per_stack = stack.layers_per_stack
    if getattr(args, "all_schedules", False):
        return schedules.megatron_schedules(per_stack)
    if args.schedule != "none" and args.recompute_num_layers is None:
        raise ValueError(f"--schedule {args.schedule} needs --recompute-num-layers K (the layer stack has "
                         f"L={stack.num_layers})" if len(per_stack) == 1 else
                         f"--schedule {args.schedule} needs --recompute-num-layers K (applied to each of the "
                         f"layer stacks {stack.describe()})")
    return [schedules.make(args.schedule, args.recompute_num_layers, per_stack)]


def _stacks_meta(stack: LayerStack) -> dict:
    """``{"layer_stacks": [...]}`` naming each stack and its layers when there are several."""
    if len(stack.stacks) == 1:
        return {}
    return {"layer_stacks": [{"path": s.path, "first_layer": s.first_layer, "num_layers": s.num_layers}
                             for s in stack.stacks]}


def _meta(args: argparse.Namespace, session: Session) -> dict:
    meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "layer_stack": session.stack.path, "num_layers": session.stack.num_layers,
            **_stacks_meta(session.stack)}
    return {k: v for k, v in meta.items() if v is not None}


def _predict(args: argparse.Namespace, session: Session, sched: schedules.Schedule):  # noqa: ANN202
    step, report, _ = session.prepare(sched, args.allocator)
    return step, report


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the rewritten graphs, saved activations and recompute segments."""
    sections = args.section or ["summary", "forward", "backward", "saved", "segments"]
    if args.graph:
        desc = load_dump(args.graph)
    else:
        session = load_session(args)
        (sched,) = _schedules(args, session.stack)
        step, report = _predict(args, session, sched)
        desc = describe_step(step, report, _meta(args, session))
        if args.dump:
            path = dump_step(step, report, args.dump, sched.provenance, _meta(args, session))
            print(f"wrote {path}", file=sys.stderr)
    sys.stdout.write(render(desc, sections, args.only_layer))
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown (stdout or --markdown), JSON (--json) and PNG (--png) liveness reports."""
    session = load_session(args)
    todo = _schedules(args, session.stack)
    if args.png and len(todo) != 1:
        raise ValueError("--png draws one schedule: drop --all-schedules or --png")
    docs, parts = [], []
    for sched in todo:
        step, report = _predict(args, session, sched)
        docs.append(report_json(report, step, timeline=args.timeline))
        text = report_markdown(report, step)
        measured = None
        if args.measure:
            measured = measured_step_timeline(step, session.joint, seed=args.seed)
            diffs = [m - p.live_bytes for p, m in zip(report.timeline, measured) if m != p.live_bytes]
            text += (f"\nMeasured (CPU profiler, per step): peak {mib(max(measured))} MiB; "
                     f"predicted {mib(report.peak_bytes)} MiB; {len(diffs)} of {len(measured)} steps differ"
                     + (f", measured minus predicted from {fmt_bytes(min(diffs))} to {fmt_bytes(max(diffs))}"
                        " (op scratch the memory model got wrong: see the op scratch line)" if diffs else "")
                     + ".\n")
        parts.append(text)
        if args.png:
            plot_timeline(report, args.png, measured, step=step)
            print(f"wrote {args.png}", file=sys.stderr)
    if len(todo) == 1:
        markdown = parts[0]
    else:
        markdown = (f"### remat-pass: predicted peaks of {args.model}\n\n" + summary_markdown(docs) + "\n\n"
                    + "\n".join(f"<details><summary>{d['schedule']['provenance']}</summary>\n\n{t}\n</details>\n"
                                for d, t in zip(docs, parts)))
    calibration_note(session)
    if args.markdown:
        _write(args.markdown, markdown)
    else:
        sys.stdout.write(markdown)
    if args.json:
        if len(docs) == 1 and not args.all_schedules:
            doc = {**docs[0], "meta": _meta(args, session)}
        else:
            doc = reports_document(docs, _meta(args, session))
        write_report(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    """CI gate: exit 1 when a predicted peak exceeds --budget or regresses past --baseline."""
    if args.budget is None and args.baseline is None:
        raise ValueError("nothing to check: give --budget SIZE and/or --baseline PATH")
    session = None
    if args.report:
        docs = read_reports(args.report)
    else:
        session = load_session(args)
        docs = []
        for sched in _schedules(args, session.stack):
            step, report = _predict(args, session, sched)
            docs.append(report_json(report, step))
        calibration_note(session)
        if args.json:
            write_report(args.json, reports_document(docs, _meta(args, session)))
            print(f"wrote {args.json}", file=sys.stderr)
    result = gate(docs, budget=args.budget, baseline=args.baseline, max_regression=args.max_regression)
    print(result.text())
    if session is not None and any(f.check == "budget" and not f.ok for f in result.findings):
        print(_fitting_schedules(args, session, parse_bytes(args.budget), docs))
    if args.markdown:
        verdict = "passed" if result.ok else "FAILED"
        _write(args.markdown, f"### remat-pass check {verdict}\n\n{summary_markdown(docs)}\n\n"
                              f"```\n{result.text()}\n```\n")
    return result.exit_code


def _fitting_schedules(args: argparse.Namespace, session: Session, budget_bytes: int, docs: list) -> str:
    """The Megatron settings whose predicted peak fits the budget, least recompute first
    (what a failing ``check --budget`` suggests)."""
    done = {d["schedule"]["provenance"]: d for d in docs}
    rows = []
    for sched in schedules.megatron_schedules(session.stack.layers_per_stack):
        d = done.get(sched.provenance)
        if d is None:
            step, report = _predict(args, session, sched)
            d = report_json(report, step)
        if d["peak_bytes"] <= budget_bytes:
            rows.append((d["recompute_flops"], d["peak_bytes"], sched.provenance))
    if not rows:
        return (f"no Megatron setting (none, uniform K, block N) fits {fmt_bytes(budget_bytes)}; "
                "`remat-pass plan --budget` finds the least peak an optimized schedule reaches")
    rows.sort()
    return (f"schedules whose predicted peak fits {fmt_bytes(budget_bytes)}, least recompute first: "
            + ", ".join(f"{name} ({mib(peak)} MiB)" for _, peak, name in rows))


def cmd_model(args: argparse.Namespace) -> int:
    """Trace with symbolic batch / seq and print the formulas (text and LaTeX)."""
    model, inputs, loss_fn = build(args.model, batch=args.batch, seq=args.seq, layers=args.layers)
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


def cmd_plan(args: argparse.Namespace) -> int:
    """The optimized schedule under --budget (or the largest batch per schedule)."""
    budget = parse_bytes(args.budget)
    if args.max_batch:
        model, inputs, loss_fn = build(args.model, batch=args.batch, seq=args.seq, layers=args.layers)
        sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs), layers=args.stack)
        rows = max_batch_rows(sm, budget)
        print(f"largest batch within {budget} bytes ({fmt_bytes(budget)}), "
              f"{', '.join(f'{k}={v}' for k, v in sm.hints.items() if k != 'batch')}:")
        print(text_table(
            ["schedule", "largest batch", "peak MiB", "peak at batch+1 MiB"],
            [[r["schedule"], str(r["batch"]), mib(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
              mib(r["next_peak_bytes"])] for r in rows],
        ))
        if args.json:
            write_json(args.json, {"budget_bytes": budget, "rows": rows})
        return EXIT_OK
    session = load_session(args)
    if args.granularity == "op":
        return _plan_op(args, session, budget)
    t0 = time.perf_counter()
    planner = Planner(session.joint, session.stack, session.report)
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        if args.json:
            write_json(args.json, {
                "budget_bytes": budget, "schedule": None, "error": str(e),
                "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                "unconstrained_peak_bytes": planner.unconstrained_peak_bytes,
            })
        raise
    result = session.evaluate(plan.schedule, strict=False)
    calibration_note(session)
    print(plan_text(plan, result, planner.calibrate_s, time.perf_counter() - t0))
    if args.json:
        write_json(args.json, plan_json(plan, result))
        print(f"wrote {args.json}", file=sys.stderr)
    return _plan_outcome(result, budget, plan.schedule.provenance, plan.predicted_peak_bytes)


def _plan_outcome(result: ScheduleResult, budget: int, provenance: str, predicted_peak_bytes: int) -> int:
    """EXIT_OK, or EXIT_FAILED saying why: the plan's gradients differ from the
    un-rewritten step, or its measured peak exceeds the budget."""
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


def _plan_op(args: argparse.Namespace, session: Session, budget: int) -> int:
    """``plan --granularity op``: the op-level optimum under the budget, measured."""
    t0 = time.perf_counter()
    planner = OpPlanner(session.joint, session.stack, session.report,
                        CostModel(args.flops_per_byte, timed=args.timed_costs))
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        if args.json:
            write_json(args.json, {"budget_bytes": budget, "granularity": "op", "partition": None, "error": str(e),
                                   "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                                   "unconstrained_peak_bytes": planner.unconstrained_peak_bytes})
        raise
    result = session.evaluate(plan.partition)
    print(op_plan_text(plan, result, planner, time.perf_counter() - t0))
    if args.json:
        write_json(args.json, op_plan_json(plan, result))
        print(f"wrote {args.json}", file=sys.stderr)
    return _plan_outcome(result, budget, plan.partition.provenance, plan.predicted_peak_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="remat-pass",
        description="Activation recomputation as a compiler pass: predicted and measured peak memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sweep", help="predicted vs measured peak for none, uniform K=1..L, block N=0..L")
    add_model_args(p)
    add_policy_args(p)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("inspect", help="the rewritten forward/backward graphs, saved activations, recompute segments")
    add_model_args(p)
    add_schedule_args(p, allow_all=False)
    p.add_argument("--graph", metavar="PATH", help="read a graph dump (*.remat.json, written by the torch.compile "
                   "backend or --dump) instead of tracing a model")
    p.add_argument("--section", action="append", choices=("summary", "forward", "backward", "saved", "segments", "code"),
                   help="what to print (repeatable; default: all but code)")
    p.add_argument("--only-layer", metavar="LAYER", help="node tables: only this layer (an index or 'outer')")
    p.add_argument("--dump", metavar="DIR", help="also write the dump file that --graph reads into DIR")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("report", help="liveness report: Markdown (CI step summary), versioned JSON, PNG timeline")
    add_model_args(p)
    add_schedule_args(p)
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown here instead of stdout")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (schema: remat_pass/report_schema.json)")
    p.add_argument("--timeline", action="store_true", help="JSON: include the live bytes at every step")
    p.add_argument("--png", metavar="PATH", help="draw the memory timeline, stacked by layer (needs matplotlib)")
    p.add_argument("--measure", action="store_true",
                   help="run the step on CPU and overlay the measured per-step bytes (PNG) and peak (Markdown)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("check", help="CI gate: exit 1 when the predicted peak exceeds a budget or regresses")
    add_model_args(p)
    add_schedule_args(p)
    p.add_argument("--budget", metavar="SIZE", help="largest allowed predicted peak, e.g. 2GiB, 512MiB, 1.5GB")
    p.add_argument("--baseline", metavar="PATH", help="baseline report JSON (remat-pass report/check --json)")
    p.add_argument("--max-regression", default="0%", metavar="FRACTION",
                   help="allowed growth over the baseline peak, e.g. 5%% or 0.05 (default: %(default)s)")
    p.add_argument("--report", metavar="PATH", help="check this report JSON instead of tracing a model")
    p.add_argument("--json", metavar="PATH", help="write the current reports as JSON (to update a baseline)")
    p.add_argument("--markdown", metavar="PATH", help="write the verdict as Markdown (e.g. $GITHUB_STEP_SUMMARY)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("model", help="symbolic memory model: peak formulas in batch / seq (text and LaTeX)")
    add_model_args(p)
    p.set_defaults(func=cmd_model)
    p = sub.add_parser("plan", help="optimized schedule: least recompute under a peak budget")
    add_model_args(p)
    p.add_argument("--budget", required=True, metavar="SIZE", help="peak budget: bytes or 1.5GiB, 800MiB, 2GB")
    p.add_argument("--max-batch", action="store_true",
                   help="instead: the largest batch that fits the budget, per Megatron schedule")
    p.add_argument("--granularity", choices=("layer", "op"), default="layer",
                   help="layer: recompute whole layers in groups; op: also choose, per layer, which values to "
                        "save (exact per layer kind, integer programs) (default: %(default)s)")
    p.add_argument("--flops-per-byte", type=int, default=CostModel().flops_per_byte, metavar="N",
                   help="op: roofline machine balance, a recomputed op costs max(FLOPs, N x bytes moved) "
                        "(default: %(default)s)")
    p.add_argument("--timed-costs", action="store_true", help="op: cost ops by timing them on this machine")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat-pass`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RematError, ValueError, ImportError, OSError) as e:
        print(f"remat-pass: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
