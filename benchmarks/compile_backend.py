"""Measured peak memory and step time of one training step under torch.compile.

Rows, all on the same model, batch and initial weights (TinyGPT from
``remat_pass.models``, dropout 0, fp32, loss inside the compiled function):

- ``eager``: no torch.compile (the gradient reference).
- ``remat``: ``torch.compile(step, backend=remat_pass.backend(...))`` for ``none``,
  ``uniform(K)``, ``block(N)`` and ``optimized`` (budget halfway between the
  predicted peaks of ``uniform(K=1)`` and ``none``); the predicted peak of the compiled graph
  (``backend.reports[0].memory.peak_bytes``) is shown next to the measured one. The
  report counts the tangent of the loss (``ones_like(loss)``, an input of the backward
  graph) as static memory, while ``loss.backward()`` allocates it inside the step: the
  measured peak is one loss element (4 bytes in fp32) above the prediction when the
  peak comes after backward starts.
- ``aot_eager + checkpoint``: ``torch.compile(backend="aot_eager")`` with
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around groups of K layers.
- ``aot_eager budget``: ``torch.compile(backend="aot_eager")`` (min-cut partition) with
  ``torch._functorch.config.activation_memory_budget`` set while compiling.

Measurement (DESIGN.md): CPU peak from the profiler's allocator events
(``remat_pass.measure.profiled_peak_cpu``): the peak of the running sum of allocated
bytes above the start of one step (``.grad`` set to None before the window, so the
gradients are allocated inside it and nothing allocated before it is freed inside it),
after the compile step and the timed steps. Step time: the median wall time of
``--repeats`` steps after the compile step. Gradients: every row's parameter
gradients against eager's, bit for bit, and the largest absolute difference.

Usage: ``python benchmarks/compile_backend.py [--layers 8 --hidden 256 --seq 128
--batch 8 --recompute-num-layers 2 --budgets 0.5,0.2,0.0 --repeats 5 --json out.json]``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import remat_pass
from remat_pass.measure import profiled_peak_cpu
from remat_pass.models import TinyGPT
from remat_pass.schedule import describe_groups


def schedules_describe(schedule: Any) -> str:
    """``recompute [0-3], store 4 5`` for a Schedule."""
    return describe_groups(schedule.groups, schedule.num_layers)

MIB = 2**20


class CheckpointGroup(nn.Module):
    """K consecutive layers run under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._run, x, use_reentrant=False)


def with_checkpoint_groups(model: TinyGPT, k: int) -> TinyGPT:
    """A copy of ``model`` whose ``blocks`` are groups of ``k`` checkpointed layers
    (same parameters, same order)."""
    m = copy.deepcopy(model)
    blocks = list(m.blocks)
    m.blocks = nn.ModuleList(CheckpointGroup(blocks[i : i + k]) for i in range(0, len(blocks), k))
    return m


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; the targets come from ``ids`` inside the step."""
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def run_row(
    model: nn.Module,
    ids: torch.Tensor,
    make_step: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]],
    repeats: int,
    during_compile: Any = None,
) -> dict[str, Any]:
    """Warm up, measure the peak of one step, time ``repeats`` steps, return grads."""
    torch._dynamo.reset()
    step = make_step(model)
    params = list(model.parameters())

    def clear() -> None:
        for p in params:
            p.grad = None

    def once() -> None:
        step(ids).backward()

    ctx = during_compile if during_compile is not None else _nullcontext()
    with ctx:
        clear()
        once()  # compiles
    times = []
    for _ in range(max(repeats, 1)):
        clear()
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    clear()  # the previous gradients are freed outside the profiled window
    peak, _ = profiled_peak_cpu(once)
    grads = [p.grad.detach().clone() for p in params]
    return {"peak_bytes": peak, "step_s": statistics.median(times), "grads": grads}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--recompute-num-layers", type=int, default=2, metavar="K",
                    help="K of uniform and of the checkpoint groups")
    ap.add_argument("--budgets", default="0.5,0.2,0.0",
                    help="activation_memory_budget values (1.0 is aot_eager's default row)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: step times stable on a shared machine)")
    args = ap.parse_args(argv)
    L, K = args.layers, args.recompute_num_layers
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = TinyGPT(args.vocab, args.hidden, args.heads, L, args.seq, dropout=0.0).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    rows: list[dict[str, Any]] = []

    def add(method: str, setting: str, result: dict[str, Any], predicted: int | None = None,
            note: str = "") -> None:
        ref = rows[0]["grads"] if rows else result["grads"]
        equal = all(torch.equal(a, b) for a, b in zip(result["grads"], ref))
        diff = max(float((a - b).abs().max()) for a, b in zip(result["grads"], ref))
        rows.append({"method": method, "setting": setting, "peak_bytes": result["peak_bytes"],
                     "predicted_peak_bytes": predicted, "step_s": result["step_s"],
                     "grads_bitwise_equal": equal, "max_grad_diff": diff,
                     "note": note, "grads": result["grads"]})

    add("eager", "-", run_row(copy.deepcopy(base), ids, lambda m: (lambda x: loss_of(m, x)), args.repeats))

    schedules = [("none", None), ("uniform", 1), ("uniform", K), ("uniform", L),
                 ("block", L // 2), ("block", L)]
    predicted: dict[str, int] = {}
    for method, k in dict.fromkeys(schedules):
        b = remat_pass.backend(method, k)
        res = run_row(copy.deepcopy(base), ids,
                      lambda m, b=b: torch.compile(lambda x: loss_of(m, x), backend=b), args.repeats)
        (report,) = b.reports
        predicted[report.schedule] = report.memory.peak_bytes
        add("remat", report.schedule, res, report.memory.peak_bytes,
            f"recompute {100 * report.memory.recompute_fraction:.0f}% fwd FLOPs")
    # optimized: a budget halfway between uniform(K=1)'s predicted peak and none's
    budget = (predicted["none"] + predicted["uniform(K=1)"]) // 2
    b = remat_pass.backend("optimized", budget_bytes=budget)
    res = run_row(copy.deepcopy(base), ids,
                  lambda m: torch.compile(lambda x: loss_of(m, x), backend=b), args.repeats)
    (report,) = b.reports
    add("remat", f"optimized, budget {budget / MIB:.2f} MiB", res, report.memory.peak_bytes,
        f"recompute {100 * report.memory.recompute_fraction:.0f}% fwd FLOPs; "
        + schedules_describe(report.step.schedule))
    over_budget = res["peak_bytes"] - budget if res["peak_bytes"] > budget else 0

    for k in sorted({1, K}):
        model = with_checkpoint_groups(base, k)
        res = run_row(model, ids, lambda m: torch.compile(lambda x: loss_of(m, x), backend="aot_eager"),
                      args.repeats)
        add("aot_eager + checkpoint", f"groups of K={k}", res)

    budgets = [1.0] + [float(b) for b in args.budgets.split(",") if b]
    for budget in budgets:
        res = run_row(copy.deepcopy(base), ids,
                      lambda m: torch.compile(lambda x: loss_of(m, x), backend="aot_eager"),
                      args.repeats,
                      during_compile=torch._functorch.config.patch(activation_memory_budget=budget))
        add("aot_eager budget", f"activation_memory_budget={budget}", res,
            note="min-cut default" if budget == 1.0 else "")

    header = ["method", "setting", "measured peak MiB", "predicted MiB", "measured - predicted B",
              "step ms", "grads == eager", "max |grad diff|", "note"]
    table = [
        [r["method"], r["setting"], f"{r['peak_bytes'] / MIB:.2f}",
         "" if r["predicted_peak_bytes"] is None else f"{r['predicted_peak_bytes'] / MIB:.2f}",
         "" if r["predicted_peak_bytes"] is None else f"{r['peak_bytes'] - r['predicted_peak_bytes']:+,}",
         f"{1000 * r['step_s']:.1f}", "bitwise" if r["grads_bitwise_equal"] else "NO",
         f"{r['max_grad_diff']:.1e}", r["note"]]
        for r in rows
    ]
    print(f"TinyGPT L={L} hidden={args.hidden} heads={args.heads} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab}, fp32 CPU ({args.threads} thread), "
          f"torch {torch.__version__}; "
          "peak = activation bytes above the step's start (profiler), after warm-up")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table)]
    for cells in [header, ["-" * w for w in widths], *table]:
        print("  ".join(str(c).ljust(w) if i < 2 or i == len(header) - 1 else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))))
    for r in rows:
        r.pop("grads")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    if over_budget:  # a budget that does not hold is an error, never a silent exit 0
        raise SystemExit(f"ERROR: the optimized row measured {res['peak_bytes']} B, over its budget "
                         f"{budget} B by {over_budget} B (predicted {report.memory.peak_bytes} B)")
    return rows


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        main()
