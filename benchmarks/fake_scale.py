"""Planning a model that does not fit this machine: time and memory of every Megatron
schedule and an optimized plan for a Llama-2-70B config (80 layers, hidden 8192,
seq 4096, micro-batch 1, bf16, target cuda), predicted from a 4-layer trace.

    python benchmarks/fake_scale.py [--config examples/configs/llama2-70b.json]
        [--device-memory 80GiB] [--optimizer adamw] [--json out.json]

Prints wall and CPU seconds per stage and the peak RSS of the process
(``resource.getrusage``), the static memory split, then the predicted peaks of a few
schedules and the plan beside Megatron-LM's theoretical activation bytes for the same
shapes (Korthikanti et al. 2022, ``solvers.theoretical_memory``).
The goal (issue 11): under 60 s and 4 GiB of RSS on the project's 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat_pass.recompute import schedule as schedules  # noqa: E402
from remat_pass.errors import InfeasibleBudget, RematError  # noqa: E402
from remat_pass.formatting import fmt_bytes, parse_bytes  # noqa: E402
from remat_pass.evaluate.workload import WorkloadOptions, load_workload  # noqa: E402
from solvers.theoretical_memory import TransformerShape, megatron_activation_bytes  # noqa: E402


def rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def transformer_shape(config_path: str, seq: int, batch: int) -> TransformerShape:
    """Korthikanti et al.'s shapes from a ``transformers`` config file (Llama / Mistral
    names, or GPT-2's ``n_embd`` / ``n_inner`` / ``n_layer`` / ``n_head``)."""
    c = json.loads(Path(config_path).read_text())
    hidden = c.get("hidden_size", c.get("n_embd"))
    ffn = c.get("intermediate_size", c.get("n_inner")) or 4 * hidden
    return TransformerShape(seq=seq, micro_batch=batch, hidden=hidden, ffn_hidden=ffn,
                            num_heads=c.get("num_attention_heads", c.get("n_head")),
                            num_layers=c.get("num_hidden_layers", c.get("n_layer")), vocab=c["vocab_size"])


def theory_bytes(shape: TransformerShape, s: schedules.Schedule) -> int:
    """Korthikanti et al.'s activation bytes for a Megatron schedule (flash attention:
    selective-recompute terms for the layers that are not recomputed)."""
    return megatron_activation_bytes(shape, s.method, s.recompute_num_layers)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples/configs/llama2-70b.json"))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target", default="cuda")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--master-weights", action="store_true")
    p.add_argument("--device-memory", default="80GiB")
    p.add_argument("--json", help="write the figures as JSON")
    return p


def shown_schedules(L: int) -> list[schedules.Schedule]:
    """The rows of the printed table: none, uniform K = 1, 2, 4, block N = L/4, L/2."""
    return [schedules.none(L), schedules.uniform(1, L), schedules.uniform(2, L), schedules.uniform(4, L),
            schedules.block(L // 4, L), schedules.block(L // 2, L)]


def plan_for_device(w, args: argparse.Namespace, out: dict, none_peak_bytes: int):  # noqa: ANN001, ANN201
    """The optimized plan under the activation budget the device leaves; when static
    memory does not fit or the budget is infeasible, under a budget the stack can meet
    (said in ``out["budget_from"]``)."""
    try:
        budget = w.activation_budget()
        out["budget_from"] = "device memory minus static memory"
    except RematError as e:
        # 70B: the bf16 parameters alone (128.5 GiB) exceed an 80 GiB device
        print(f"--device-memory {args.device_memory}: {e}")
        budget = parse_bytes(args.device_memory)
        out["budget_from"] = "the device memory as an activation budget (static memory does not fit)"
    planner = w.planner()
    out["device_plan"] = None
    try:
        plan = planner.plan(budget)
        out["device_plan"] = plan.describe()
    except InfeasibleBudget as e:
        print(f"plan for {fmt_bytes(budget)} of activations: {e}")
        out["device_plan_error"] = str(e)
        # a budget the stack can meet, halfway between the least feasible peak and none's
        least = e.least_feasible_peak_bytes
        budget = least + (none_peak_bytes - least) // 2
        out["budget_from"] = "halfway between the least feasible peak and none's (the device budget is infeasible)"
        plan = planner.plan(budget)
    out["activation_budget_bytes"] = budget
    out["plan"] = {"schedule": plan.describe(), "predicted_peak_bytes": plan.predicted_peak_bytes,
                   "recompute_fraction": plan.recompute_fraction, "resolves": plan.resolves}
    return plan


def print_figures(w, args: argparse.Namespace, out: dict, plan) -> None:  # noqa: ANN001
    """Times and RSS, the static split, and the table of predicted peaks, saved
    activations and Korthikanti et al.'s figure."""
    print(f"{w.description}")
    print(f"trace {out['trace_wall_s']:.1f} s wall / {out['trace_cpu_s']:.1f} s CPU; "
          f"{out['schedules']} Megatron schedules {out['sweep_wall_s']:.1f} / {out['sweep_cpu_s']:.1f} s; "
          f"plan {out['plan_wall_s']:.1f} / {out['plan_cpu_s']:.1f} s; "
          f"total {out['total_wall_s']:.1f} s wall / {out['total_cpu_s']:.1f} s CPU; "
          f"peak RSS {fmt_bytes(out['rss_peak_bytes'])} (load average {' '.join(out['loadavg'])})")
    parts = [(k, v) for k, v in out["static"].items() if type(v) is int and k not in ("total_bytes", "gradient_bytes")]
    print(f"static {fmt_bytes(w.static.total_bytes)}: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts)
          + f"; parameter gradients {fmt_bytes(w.static.gradient_bytes)} (inside each peak)")
    print(f"activation budget {fmt_bytes(out['activation_budget_bytes'])} ({out['budget_from']})")
    print(f"  {'schedule':14s} {'predicted peak':>15s} {'saved':>11s} {'Korthikanti':>12s}")
    for name, theory in out["theory"].items():
        print(f"  {name:14s} {fmt_bytes(out['peaks'][name]):>15s} {fmt_bytes(out['saved_activation_bytes'][name]):>11s} "
              f"{fmt_bytes(theory):>12s}")
    print(f"  {'optimized':14s} {fmt_bytes(plan.predicted_peak_bytes):>15s} {'':>11s} {'':>12s}  {plan.describe()}  "
          f"recompute {100 * plan.recompute_fraction:.1f} % of forward")
    print("predicted peak: activation bytes above static memory (parameter gradients included); saved: what "
          "forward saves for backward; Korthikanti: Megatron's theoretical activations (flash attention)")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {"config": args.config, "seq": args.seq, "batch": args.batch, "dtype": args.dtype,
                 "target": args.target, "rss_start_bytes": rss_bytes()}
    w0, c0 = time.perf_counter(), time.process_time()
    try:  # a missing config or a bad option: one line, exit 2
        w = load_workload(WorkloadOptions(config=args.config, meta=True, dtype=args.dtype, target=args.target,
                                          batch=args.batch, seq=args.seq, optimizer=args.optimizer,
                                          master_weights=args.master_weights, device_memory=args.device_memory))
    except OSError as e:
        ap.error(f"--config {args.config}: {e.strerror}")
    except (RematError, ValueError) as e:  # the optimizer name is checked with a plain ValueError
        ap.error(str(e))
    out["trace_wall_s"], out["trace_cpu_s"] = time.perf_counter() - w0, time.process_time() - c0
    w1, c1 = time.perf_counter(), time.process_time()
    todo, shown = schedules.megatron_schedules(w.num_layers), shown_schedules(w.num_layers)
    out["peaks"], out["saved_activation_bytes"] = {}, {}
    for s in todo:
        r = w.report(s)
        out["peaks"][s.provenance] = r.peak_bytes
        if s in shown:
            out["saved_activation_bytes"][s.provenance] = r.saved_activation_bytes
    out["schedules"] = len(todo)
    out["sweep_wall_s"], out["sweep_cpu_s"] = time.perf_counter() - w1, time.process_time() - c1
    w2, c2 = time.perf_counter(), time.process_time()
    plan = plan_for_device(w, args, out, out["peaks"][shown[0].provenance])
    out["plan_wall_s"], out["plan_cpu_s"] = time.perf_counter() - w2, time.process_time() - c2
    out["total_wall_s"], out["total_cpu_s"] = time.perf_counter() - w0, time.process_time() - c0
    out["rss_peak_bytes"] = rss_bytes()
    out["templates_rewritten"] = len(w.reuse.templates) if w.reuse is not None else 0
    out["num_layers"] = w.num_layers
    out["static"] = w.static.to_dict()
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    shape = transformer_shape(args.config, args.seq, args.batch)
    out["theory"] = {s.provenance: theory_bytes(shape, s) for s in shown}
    print_figures(w, args, out, plan)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
