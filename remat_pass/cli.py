"""The ``remat-pass`` command line (argparse).

Subcommands:
    sweep   every Megatron recompute setting on a model: predicted vs measured peak.
    inspect the rewritten forward / backward graphs of a model or of a graph dump.
    report  liveness report: Markdown, versioned JSON, PNG timeline.
    check   CI gate: exit 1 when the predicted peak exceeds a budget or regresses.
    model   symbolic memory model: peak formulas in batch / seq.
    plan    optimized schedule under a peak budget; --max-batch: largest batch.

Every subcommand that takes a model accepts ``--model module:factory`` (default: the
shipped GPT-2), ``--batch``, ``--seq``, ``--layers`` (number of layers, passed to the
factory) and ``--stack`` (module path of the layer stack when it is not found
automatically).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from . import schedule as schedules
from .errors import InfeasibleBudget, RematError
from .formatting import fmt_bytes, mib, parse_bytes, text_table
from .gate import gate
from .inspection import describe_step, dump_step, load_dump, render
from .measure import measured_step_timeline
from .cli_parallel import DEFAULT_PARALLEL_MODEL, add_parallel_args, parallel_config, plan_parallel, sweep_parallel
from .models import build
from .parallel import ParallelConfig
from .planner import Planner, max_batch_rows
from .plot import plot_timeline
from .report import (
    SWEEP_COLUMNS,
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
from .sweep import Session, sweep
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
    g.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help=f"factory returning (model, example_inputs, loss_fn) (default: {DEFAULT_MODEL})")
    g.add_argument("--batch", type=positive_int, help="batch size passed to the factory")
    g.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    g.add_argument("--layers", type=positive_int, help="number of layers passed to the factory")
    g.add_argument("--stack", metavar="PATH",
                   help="module path of the layer stack (e.g. transformer.h); found automatically if omitted")
    g.add_argument("--seed", type=int, default=0, help="RNG seed for every run (default: 0)")


def model_spec(args: argparse.Namespace, parallel: bool = False) -> str:
    """``--model``, or the default model (the parallel one for per-rank commands)."""
    return args.model or (DEFAULT_PARALLEL_MODEL if parallel else DEFAULT_MODEL)


def load_session(args: argparse.Namespace) -> Session:
    """Build the model from the factory and trace it (prints what it does to stderr)."""
    model, inputs, loss_fn = build(model_spec(args), batch=args.batch, seq=args.seq, layers=args.layers)
    t0 = time.perf_counter()
    session = Session.create(model, inputs, loss_fn, layers=args.stack, seed=args.seed)
    print(
        f"traced {type(model).__name__}: {len(session.joint.gm.graph.nodes)} joint nodes, "
        f"layer stack {session.stack.path!r} with L={session.stack.num_layers} "
        f"({time.perf_counter() - t0:.1f}s)",
        file=sys.stderr,
    )
    return session


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run every Megatron setting; print the table, write --json."""
    config = parallel_config(args)
    if config is not None:
        return EXIT_OK if sweep_parallel(args, config) else EXIT_FAILED
    session = load_session(args)

    def progress(i: int, n: int, s, r) -> None:  # noqa: ANN001
        print(
            f"[{i:2d}/{n}] {s.provenance:14s} predicted {r.predicted_peak_bytes / 2**20:8.2f} MiB"
            f"  measured {r.measured_peak_bytes / 2**20:8.2f} MiB"
            f"  grads {'equal' if r.grads_equal else 'DIFFER'}  ({r.measure_time_s:.1f}s)",
            file=sys.stderr, flush=True,
        )

    results = sweep(session, progress=progress)
    print(text_table(SWEEP_COLUMNS, sweep_rows(results)))
    if args.json:
        write_json(args.json, {
            "model": model_spec(args),
            "layer_stack": session.stack.path,
            "num_layers": session.stack.num_layers,
            "static_bytes": sum(int(v.untyped_storage().nbytes()) for v in session.joint.primal_values),
            "rows": [r.to_dict() for r in results],
        })
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK if all(r.grads_equal for r in results) else EXIT_FAILED


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


def _schedules(args: argparse.Namespace, num_layers: int) -> list[schedules.Schedule]:
    if getattr(args, "all_schedules", False):
        return schedules.megatron_schedules(num_layers)
    if args.schedule != "none" and args.recompute_num_layers is None:
        raise ValueError(f"--schedule {args.schedule} needs --recompute-num-layers K (the layer stack has "
                         f"L={num_layers})")
    return [schedules.make(args.schedule, args.recompute_num_layers, num_layers)]


def _meta(args: argparse.Namespace, session: Session) -> dict:
    meta = {"model": model_spec(args), "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "layer_stack": session.stack.path, "num_layers": session.stack.num_layers}
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
        (sched,) = _schedules(args, session.stack.num_layers)
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
    todo = _schedules(args, session.stack.num_layers)
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
                        " (scratch memory inside an op that the model does not count)" if diffs else "")
                     + ".\n")
        parts.append(text)
        if args.png:
            plot_timeline(report, args.png, measured, step=step)
            print(f"wrote {args.png}", file=sys.stderr)
    if len(todo) == 1:
        markdown = parts[0]
    else:
        markdown = (f"### remat-pass: predicted peaks of {model_spec(args)}\n\n" + summary_markdown(docs) + "\n\n"
                    + "\n".join(f"<details><summary>{d['schedule']['provenance']}</summary>\n\n{t}\n</details>\n"
                                for d, t in zip(docs, parts)))
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
    if args.report:
        docs = read_reports(args.report)
    else:
        session = load_session(args)
        docs = []
        for sched in _schedules(args, session.stack.num_layers):
            step, report = _predict(args, session, sched)
            docs.append(report_json(report, step))
        if args.json:
            write_report(args.json, reports_document(docs, _meta(args, session)))
            print(f"wrote {args.json}", file=sys.stderr)
    result = gate(docs, budget=args.budget, baseline=args.baseline, max_regression=args.max_regression)
    print(result.text())
    if args.markdown:
        verdict = "passed" if result.ok else "FAILED"
        _write(args.markdown, f"### remat-pass check {verdict}\n\n{summary_markdown(docs)}\n\n"
                              f"```\n{result.text()}\n```\n")
    return result.exit_code


def cmd_model(args: argparse.Namespace) -> int:
    """Trace with symbolic batch / seq and print the formulas (text and LaTeX)."""
    model, inputs, loss_fn = build(model_spec(args), batch=args.batch, seq=args.seq, layers=args.layers)
    t0 = time.perf_counter()
    sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs), layers=args.stack)
    print(f"traced {type(model).__name__} with symbolic shapes ({time.perf_counter() - t0:.1f}s)",
          file=sys.stderr)
    print(symbolic_model_text(sm))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """The optimized schedule under --budget (or the largest batch per schedule); per
    rank and stage under --device-memory for a parallel step."""
    config = parallel_config(args)
    if config is not None or args.device_memory is not None:
        plan_parallel(args, config or ParallelConfig())
        return EXIT_OK
    if args.budget is None:
        raise ValueError("plan needs --budget SIZE (activation bytes), or --device-memory SIZE for a per-rank plan")
    budget = parse_bytes(args.budget)
    if args.max_batch:
        model, inputs, loss_fn = build(model_spec(args), batch=args.batch, seq=args.seq, layers=args.layers)
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
    result = session.evaluate(plan.schedule)
    print(plan_text(plan, result, planner.calibrate_s, time.perf_counter() - t0))
    if args.json:
        write_json(args.json, plan_json(plan, result))
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK if result.grads_equal else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="remat-pass",
        description="Activation recomputation as a compiler pass: predicted and measured peak memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sweep", help="predicted vs measured peak for none, uniform K=1..L, block N=0..L")
    add_model_args(p)
    add_parallel_args(p)
    p.add_argument("--measure", action="store_true",
                   help="per-rank: also launch the ranks on gloo and measure every rank (multi-process)")
    p.add_argument("--repeats", type=positive_int, default=1, help="per-rank --measure: measured steps per setting")
    p.add_argument("--allocator", choices=("cpu", "cuda"), default="cpu",
                   help="per-rank: allocator model for the predicted bytes (default: %(default)s)")
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
    add_parallel_args(p)
    p.add_argument("--budget", metavar="SIZE", help="peak budget: bytes or 1.5GiB, 800MiB, 2GB")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="per rank: the device's memory (e.g. 80GiB); least recompute per pipeline stage that fits")
    p.add_argument("--allocator", choices=("cpu", "cuda"), default="cpu",
                   help="per-rank plan: allocator model for the predicted bytes (default: %(default)s)")
    p.add_argument("--max-batch", action="store_true",
                   help="instead: the largest batch that fits the budget, per Megatron schedule")
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
