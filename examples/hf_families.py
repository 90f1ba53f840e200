"""Sweep the Hugging Face families: every distinct Megatron schedule and one optimized
plan, predicted against measured, gradients against the un-rewritten step.

Families (``remat_pass.models.hf_families``, small configs, random weights, fp32, dropout 0):
Llama, Mistral, Qwen2, GPT-NeoX, Phi-3, Mixtral (batched_mm experts), BERT, T5 (both
stacks), ViT. Prints a Markdown table (one row per family) and, with ``--json``, every
row per schedule.

Usage:
    python examples/hf_families.py [--threads 1] [--layers 3] [--family t5 ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's remat_pass

from remat_pass.errors import RematError  # noqa: E402
from remat_pass.formatting import markdown_table  # noqa: E402
from remat_pass.models.hf_families import FAMILIES  # noqa: E402
from remat_pass.plan.planner import Planner  # noqa: E402
from remat_pass.recompute.schedule import distinct_megatron_schedules  # noqa: E402
from remat_pass.evaluate.session import Session  # noqa: E402


def sweep_family(name: str, layers: int) -> dict:
    """Trace, sweep and plan one family; the per-schedule rows and a summary."""
    t0 = time.perf_counter()
    model, inputs, loss_fn = FAMILIES[name](layers=layers)
    session = Session.create(model, inputs, loss_fn)
    todo = distinct_megatron_schedules(session.stack.layers_per_stack)
    planner = Planner(session.joint, session.stack, session.report)
    _, least = planner.least_feasible()
    plan = planner.plan((planner.unconstrained_peak_bytes + least) // 2)
    if plan.schedule.groups not in {s.groups for s in todo}:
        todo.append(plan.schedule)
    rows = []
    for sch in todo:
        r = session.evaluate(sch, strict=False)
        rows.append({"schedule": sch.provenance, "groups": [list(g) for g in sch.groups],
                     "predicted_peak_bytes": r.predicted_peak_bytes, "measured_peak_bytes": r.measured_peak_bytes,
                     "grads_equal": r.grads_equal, "grads_within_run_to_run": r.grads_within_run_to_run,
                     "max_grad_diff_vs_reference": r.max_grad_diff_vs_reference,
                     "run_to_run_grad_diff": r.run_to_run_grad_diff})
    return {"family": name, "model": type(model).__name__,
            "stacks": [{"path": s.path, "num_layers": s.num_layers} for s in session.stack.stacks],
            "num_layers": session.stack.num_layers, "rows": rows, "seconds": time.perf_counter() - t0}


def summary_row(d: dict) -> list[str]:
    rows = d["rows"]
    measured = [r for r in rows if r["measured_peak_bytes"] is not None]
    exact = sum(r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in measured)
    errs = [r["predicted_peak_bytes"] - r["measured_peak_bytes"] for r in measured]
    worst = max(errs, key=abs, default=0)
    worst_pct = max((abs(e) / r["measured_peak_bytes"] for e, r in zip(errs, measured)), default=0.0)
    equal = sum(r["grads_equal"] for r in rows)
    within = sum(r["grads_within_run_to_run"] for r in rows)
    stacks = ", ".join(f"{s['path']} ({s['num_layers']})" for s in d["stacks"])
    return [d["family"], stacks, str(d["num_layers"]), str(len(rows)),
            f"{exact}/{len(rows)}", f"{worst:+d} B ({100 * worst_pct:.2f} %)",
            f"{equal}/{len(rows)}" + (f" (+{within} within run-to-run)" if within else ""),
            f"{d['seconds']:.0f}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    ap.add_argument("--layers", type=int, default=3, help="layers per stack (default: 3)")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES), help="repeatable; default: all")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON")
    args = ap.parse_args(argv)
    if args.layers < 2 or args.threads < 1:  # one layer is no stack (Session.create finds none)
        ap.error(f"--layers must be at least 2 and --threads at least 1 (got {args.layers}, {args.threads})")
    torch.set_num_threads(args.threads)
    results, failures = [], []
    for name in args.family or list(FAMILIES):
        try:
            results.append(sweep_family(name, args.layers))
            print(f"{name}: done", file=sys.stderr, flush=True)
        except RematError as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
            print(failures[-1], file=sys.stderr, flush=True)
    header = ["family", "stacks found (L each)", "L", "schedules", "predicted == measured",
              "largest predicted - measured", "gradients bitwise equal", "s"]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layers} layers per stack\n")
    print(markdown_table(header, [summary_row(d) for d in results]))
    for f in failures:
        print(f"\nrefused: {f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"threads": args.threads, "torch": torch.__version__, "families": results}, fh, indent=1)
    return 0 if not failures and all(r["grads_equal"] or r["grads_within_run_to_run"]
                                     for d in results for r in d["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
