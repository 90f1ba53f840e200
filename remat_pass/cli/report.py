"""The ``inspect``, ``report`` and ``check`` commands: the rewritten graphs of a step
(or of a graph dump), its liveness report as Markdown, versioned JSON and a PNG
timeline (measured per step with ``--measure``), and the CI gate (``gate.gate``: a
budget, a baseline) with the Megatron settings that would fit a failed budget.
"""

from __future__ import annotations

import argparse
import sys

from ..recompute import schedule as schedules
from .common import EXIT_OK, calibration_note, chosen_schedules, load, model_name, predict, report_meta
from .common import static_line, write_text
from ..formatting import fmt_bytes, mib, parse_bytes
from ..report.gate import gate
from ..report.inspection import describe_step, dump_step, load_dump, render
from ..measure.run import measured_step_timeline
from ..report.plot import plot_timeline
from ..report.schedule_report import read_reports, report_json, report_markdown, reports_document, summary_markdown, write_report
from ..evaluate.workload import Workload

def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the rewritten graphs, saved activations and recompute segments."""
    sections = args.section or ["summary", "forward", "backward", "saved", "segments"]
    if args.graph:
        desc = load_dump(args.graph)
    else:
        w = load(args)
        if w.session is None:
            raise ValueError("inspect prints every node of the rewritten graphs: add --trace-all-layers")
        (sched,) = chosen_schedules(args, w)
        step, report = predict(w, sched)
        desc = describe_step(step, report, report_meta(args, w))
        if args.dump:
            path = dump_step(step, report, args.dump, sched.provenance, report_meta(args, w))
            print(f"wrote {path}", file=sys.stderr)
    sys.stdout.write(render(desc, sections, args.only_layer))
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown (stdout or --markdown), JSON (--json) and PNG (--png) liveness reports."""
    w = load(args)  # --measure and --png against their flags: flags.check_flags, before this
    todo = chosen_schedules(args, w)
    if (args.png or args.timeline) and w.session is None:
        raise ValueError("--png and --timeline need every step: add --trace-all-layers")
    docs, parts = [], []
    for sched in todo:
        step, report = predict(w, sched)
        docs.append(report_json(report, step, timeline=args.timeline))
        text = report_markdown(report, step)
        measured = None
        if args.measure:
            measured = measured_step_timeline(step, w.session.joint, seed=args.seed)
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
        markdown = (f"### remat-pass: predicted peaks of {model_name(args)}\n\n" + summary_markdown(docs)
                    + "\n\n" + "\n".join(f"<details><summary>{d['schedule']['provenance']}</summary>\n\n{t}\n"
                                           "</details>\n" for d, t in zip(docs, parts)))
    if args.optimizer != "none" or args.target != "cpu" or args.device_memory:
        markdown += f"\n{static_line(w)}\n"
    calibration_note(w)
    if args.markdown:
        write_text(args.markdown, markdown)
    else:
        sys.stdout.write(markdown)
    if args.json:
        if len(docs) == 1 and not args.all_schedules:
            doc = {**docs[0], "meta": report_meta(args, w)}
        else:
            doc = reports_document(docs, report_meta(args, w))
        write_report(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    """CI gate: exit 1 when a predicted peak exceeds --budget or regresses past --baseline."""
    if args.budget is None and args.baseline is None:
        raise ValueError("nothing to check: give --budget SIZE and/or --baseline PATH")
    w = None
    if args.report:
        docs = read_reports(args.report)
    else:
        w = load(args)
        docs = []
        for sched in chosen_schedules(args, w):
            step, report = predict(w, sched)
            docs.append(report_json(report, step))
        calibration_note(w)
        if args.json:
            write_report(args.json, reports_document(docs, report_meta(args, w)))
            print(f"wrote {args.json}", file=sys.stderr)
    result = gate(docs, budget=args.budget, baseline=args.baseline, max_regression=args.max_regression or "0%")
    print(result.text())
    if w is not None and any(f.check == "budget" and not f.ok for f in result.findings):
        print(_fitting_schedules(w, parse_bytes(args.budget), docs))
    if args.markdown:
        verdict = "passed" if result.ok else "FAILED"
        write_text(args.markdown, f"### remat-pass check {verdict}\n\n{summary_markdown(docs)}\n\n"
                              f"```\n{result.text()}\n```\n")
    return result.exit_code


def _fitting_schedules(w: Workload, budget_bytes: int, docs: list) -> str:
    """The Megatron settings whose predicted peak fits the budget, least recompute first
    (what a failing ``check --budget`` suggests)."""
    done = {d["schedule"]["provenance"]: d for d in docs}
    rows = []
    for sched in schedules.megatron_schedules(w.layers_per_stack):
        d = done.get(sched.provenance)
        if d is None:
            step, report = predict(w, sched)
            d = report_json(report, step)
        if d["peak_bytes"] <= budget_bytes:
            rows.append((d["recompute_flops"], d["peak_bytes"], sched.provenance))
    if not rows:
        return (f"no Megatron setting (none, uniform K, block N) fits {fmt_bytes(budget_bytes)}; "
                "`remat-pass plan --budget` finds the least peak an optimized schedule reaches")
    rows.sort()
    return (f"schedules whose predicted peak fits {fmt_bytes(budget_bytes)}, least recompute first: "
            + ", ".join(f"{name} ({mib(peak)} MiB)" for _, peak, name in rows))
