"""Step time of the torch.compile backend against PyTorch's own recompute at the same
measured peak, the systems alternated in one run (issue 22, item 4).

For each model (``tiny``: ``remat_pass.models:tiny_gpt``; ``gpt2``: transformers' GPT-2,
``use_cache=False``; both as ``benchmarks/compile_backend.py`` builds them) and compiler:

- the reference: ``eager`` compiler: ``aot_eager`` under
  ``torch._functorch.config.activation_memory_budget`` = ``--memory-budget`` (PyTorch's
  min-cut partitioner with its knapsack over saved activations); ``inductor``:
  Inductor with ``torch.utils.checkpoint`` around every layer (GPT-2:
  ``gradient_checkpointing_enable(use_reentrant=False)``);
- ``remat``: ``remat_pass.backend("optimized", budget_bytes=P)`` with the same compiler,
  whole layers and ``granularity="op"``, where ``P`` is the reference's measured step
  peak (so both run at the same memory, the backend at most at it);
- ``eager``: no torch.compile (the time unit).

Each system is compiled and warmed up (two steps, the backend's first step re-plans),
its peak measured (``remat_pass.measure.run.profiled_peak_cpu``: the CPU allocator
profiler's running-sum peak above the step's start, ``.grad`` None before the step,
seed set before every step), then ``--rounds`` rounds each time one step of every
system, the order reversed every other round (ABBA: A B C, C B A, ...), so that the
machine's drift (other load, frequency) falls on all systems alike. Printed: per
system the FLOPs it recomputes per step (the backend: its GraphReports'; the reference:
the backward FLOPs of its partition less those of ``default_partition``, which
recomputes nothing, both by ``remat_pass.graph.costs.node_flops``), the median step
seconds, the interquartile range, and the ratio of the medians to the reference's. The figures are this machine's: they depend on its cores, their
load and torch's thread count (``--threads``), so only the ratios of one run compare.

Usage: ``python benchmarks/compile_time.py [--models tiny,gpt2 --compilers eager,inductor
--batch 4 --rounds 11 --memory-budget 0.5 --threads 1 --json out.json]``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's remat_pass
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compile_backend's model builders

import remat_pass  # noqa: E402
from remat_pass.measure.run import profiled_peak_cpu  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.compile.steps import INDUCTOR_ROUNDS  # noqa: E402
from remat_pass.graph.costs import node_flops  # noqa: E402
from compile_backend import MIB, backward, loss_fn, make_model, with_checkpoint  # noqa: E402

GFLOP = 1e9


class System:
    """One way of running the step: a model copy, its step function, and the context
    every call of it runs under (PyTorch's budget is read at compile time, and a
    recompile must see it too)."""

    def __init__(self, name: str, model: nn.Module, step: Callable[[torch.Tensor], Any],
                 context: Callable[[], Any] = torch.enable_grad, warm_up: int = 2):
        self.name, self.model, self.step, self.context = name, model, step, context
        self.warm_up = warm_up
        self.params = list(model.parameters())
        self.times: list[float] = []
        self.peak_bytes = 0
        self.recompute_flops: int | None = None

    def once(self, ids: torch.Tensor) -> float:
        """One timed step (seconds), ``.grad`` None before it."""
        for p in self.params:
            p.grad = None
        torch.manual_seed(1)
        with self.context():
            t = time.perf_counter()
            backward(self.step(ids))
            return time.perf_counter() - t

    def warm_up_and_measure(self, ids: torch.Tensor) -> None:
        """``warm_up`` steps (the first compiles; the backend's first step re-plans, and
        under Inductor each of the next ``INDUCTOR_ROUNDS`` may), then the measured peak
        of one more."""
        for _ in range(self.warm_up):
            self.once(ids)
        for p in self.params:
            p.grad = None

        def measured() -> None:
            torch.manual_seed(1)
            with self.context():
                backward(self.step(ids))

        self.peak_bytes, _ = profiled_peak_cpu(measured)


def _backward_flops(model: nn.Module, loss: Callable[[nn.Module, torch.Tensor], Any], ids: torch.Tensor,
                    partition: Callable[..., Any], budget: float) -> int:
    """FLOPs (``remat_pass.graph.costs.node_flops``) of the backward graphs AOTAutograd
    builds for one step of ``model`` with ``partition`` under
    ``activation_memory_budget=budget`` (a copy of the model; one step run)."""
    from functorch.compile import default_partition, make_boxed_func  # noqa: F401
    from torch._dynamo.backends.common import aot_autograd

    total = [0]

    def bw(gm: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
        total[0] += sum(int(node_flops(n)) for n in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    m = copy.deepcopy(model)
    compiled = torch.compile(lambda i: loss(m, i), backend=aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=bw, partition_fn=partition))
    with torch._functorch.config.patch(activation_memory_budget=budget):
        backward(compiled(ids))
    return total[0]


def reference_recompute_flops(name: str, compiler: str, base: nn.Module, memory_budget: float,
                              ids: torch.Tensor) -> int:
    """FLOPs the reference recomputes in one step: the backward FLOPs of its partition
    (``eager``: the min-cut partitioner at ``memory_budget``; ``inductor``: the
    checkpointed model under the min-cut partitioner, as Inductor partitions it) less
    those of ``default_partition`` on the plain model (saves every forward value
    backward needs, recomputes nothing)."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    loss = loss_fn(name, False)
    model, budget = (base, memory_budget) if compiler == "eager" else (with_checkpoint(name, base), 1.0)
    plain = _backward_flops(base, loss, ids, default_partition, 1.0)
    return _backward_flops(model, loss, ids, min_cut_rematerialization_partition, budget) - plain


def _running_recompute_flops(b: Any) -> int:
    """The recompute FLOPs of the graphs the backend runs now (their GraphReports)."""
    return sum(getattr(s, "compiled", s).planned.report.memory.recompute_flops for s in b.graph_states.values()
               if hasattr(getattr(s, "compiled", s), "planned"))


def systems(name: str, compiler: str, batch: int, memory_budget: float, ids: torch.Tensor) -> list[System]:
    """The reference, the backend at the reference's measured peak, and eager: each
    compiled, warmed up and measured."""
    base, _ = make_model(name, batch, None)
    loss = loss_fn(name, False)
    if compiler == "eager":
        model = copy.deepcopy(base)
        ref = System(f"aot_eager activation_memory_budget={memory_budget}", model,
                     torch.compile(lambda i, m=model: loss(m, i), backend="aot_eager"),
                     lambda: torch._functorch.config.patch(activation_memory_budget=memory_budget))
    else:
        model = with_checkpoint(name, base)
        ref = System("inductor + checkpoint every layer", model,
                     torch.compile(lambda i, m=model: loss(m, i), backend="inductor"))
    ref.warm_up_and_measure(ids)
    ref.recompute_flops = reference_recompute_flops(name, compiler, base, memory_budget, ids)
    ours = []
    for granularity in ("layer", "op"):
        try:
            ours.append(_backend_system(base, loss, "optimized", ref.peak_bytes, compiler, ids, granularity))
        except Exception as e:  # the backend's refusal (InfeasibleBudget inside Dynamo's wrapper)
            lines = [ln for ln in str(e).splitlines() if "Infeasible" in ln or "Error:" in ln] or [str(e)]
            first = lines[-1].strip()[:160]
            print(f"row: {name} | {compiler} | remat optimized ({granularity} level) at {ref.peak_bytes / MIB:.2f} "
                  f"MiB refused: {first}" + ("; timing uniform K=1 instead" if granularity == "layer" else ""),
                  flush=True)
            if granularity == "layer":
                ours.append(_backend_system(base, loss, "uniform", None, compiler, ids))
    model = copy.deepcopy(base)
    plain = System("eager (no compile)", model, lambda i, m=model: loss(m, i))
    plain.warm_up_and_measure(ids)
    plain.recompute_flops = 0
    return [ref, *ours, plain]


def _backend_system(base: nn.Module, loss: Callable[[nn.Module, torch.Tensor], Any], schedule: str,
                    budget: int | None, compiler: str, ids: torch.Tensor, granularity: str = "layer") -> System:
    """This backend's system: ``optimized`` at ``budget`` bytes (whole layers, or
    ``granularity="op"``: the op-level optimum), or ``uniform`` K=1."""
    model = copy.deepcopy(base)
    if schedule == "optimized":
        b = remat_pass.backend("optimized", budget_bytes=budget, compiler=compiler, granularity=granularity)
        label = f"remat optimized{' op level' if granularity == 'op' else ''} at {budget / MIB:.2f} MiB"
    else:
        b, label = remat_pass.backend("uniform", 1, compiler=compiler), "remat uniform K=1"
    ours = System(label, model, torch.compile(lambda i, m=model: loss(m, i), backend=b),
                  warm_up=2 + INDUCTOR_ROUNDS)
    ours.warm_up_and_measure(ids)
    ours.recompute_flops = _running_recompute_flops(b)
    return ours


def alternate(runs: list[System], ids: torch.Tensor, rounds: int) -> None:
    """``rounds`` rounds of one timed step per system, every other round reversed."""
    for r in range(rounds):
        for s in (runs if r % 2 == 0 else runs[::-1]):
            s.times.append(s.once(ids))


def _quartiles(times: list[float]) -> tuple[float, float]:
    if len(times) < 2:
        return times[0], times[0]
    q = statistics.quantiles(times, n=4)
    return q[0], q[2]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,gpt2", help="comma list of tiny, gpt2")
    ap.add_argument("--compilers", default="eager,inductor", help="comma list of eager, inductor")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--memory-budget", type=float, default=0.5,
                    help="PyTorch's activation_memory_budget for the aot_eager reference (0 < f <= 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    models, compilers = args.models.split(","), args.compilers.split(",")
    if not set(models) <= {"tiny", "gpt2"} or not set(compilers) <= {"eager", "inductor"}:
        ap.error("--models takes tiny and gpt2, --compilers eager and inductor (comma lists)")
    if args.batch < 1 or args.rounds < 1 or args.threads < 1 or not 0 < args.memory_budget <= 1:
        ap.error("--batch, --rounds and --threads must be at least 1, --memory-budget in (0, 1]")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # three systems share the models' code objects
    rows: list[dict[str, Any]] = []
    for name in models:
        for compiler in compilers:
            torch._dynamo.reset()
            _, ids_of = make_model(name, args.batch, None)
            ids = ids_of(args.batch)
            runs = systems(name, compiler, args.batch, args.memory_budget, ids)
            alternate(runs, ids, args.rounds)
            ref_median = statistics.median(runs[0].times)
            for s in runs:
                lo, hi = _quartiles(s.times)
                med = statistics.median(s.times)
                rows.append({"model": name, "compiler": compiler, "system": s.name, "batch": args.batch,
                             "measured_bytes": s.peak_bytes, "median_s": med, "q1_s": lo, "q3_s": hi,
                             "ratio_to_reference": med / ref_median, "rounds": args.rounds,
                             "recompute_flops": s.recompute_flops})
                print(f"row: {name} | {compiler} | {s.name} | {s.peak_bytes / MIB:.2f} MiB | "
                      f"recompute {s.recompute_flops / GFLOP:.3f} GFLOP | median {med:.4f} s "
                      f"| IQR {lo:.4f}-{hi:.4f} | / reference {med / ref_median:.3f}", flush=True)
    print(text_table(["model", "compiler", "system", "measured MiB", "recompute GFLOP", "median s", "IQR s",
                      "/ reference"],
                     [[r["model"], r["compiler"], r["system"], f"{r['measured_bytes'] / MIB:.2f}",
                       f"{r['recompute_flops'] / GFLOP:.3f}",
                       f"{r['median_s']:.4f}", f"{r['q1_s']:.4f}-{r['q3_s']:.4f}",
                       f"{r['ratio_to_reference']:.3f}"] for r in rows]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"config": vars(args), "torch": torch.__version__, "rows": rows}, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
