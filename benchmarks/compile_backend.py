"""Measured against predicted peak of whole training steps under torch.compile.

For each model (``gpt2``: ``remat_pass.models:gpt2``, transformers' GPT-2, which
Dynamo splits at ``self.loss_function`` into a layer graph and a loss graph, called
with ``use_cache=False`` in every row, as a training step and as transformers'
gradient checkpointing calls it, so no key/value cache is returned; ``tiny``:
``remat_pass.models:tiny_gpt``, loss inside the compiled function), compiler
(``eager``: fx code; ``inductor``), shapes (static, or ``--dynamic``: one compile with
``dynamic=True`` run at every ``--batches``) and precision (fp32, or ``--bf16``:
``torch.autocast("cpu", torch.bfloat16)`` inside the compiled step), the rows are:

- ``eager``: no torch.compile (the gradient and step-time reference);
- ``remat``: ``remat_pass.compile.backend`` with ``none``, ``uniform`` K=1, 2, and (static
  shapes) ``optimized`` at budgets spread between the predicted step peaks of uniform
  K=1 and none; the predicted step peak is ``backend.step_report(shape).peak_bytes``
  (the composed step: every graph, what crosses between them), after the re-plan of
  the first step;
- references: ``aot_eager`` with ``activation_memory_budget`` (eager compiler) and
  Inductor with ``torch.utils.checkpoint`` around every layer (inductor compiler;
  GPT-2: ``gradient_checkpointing_enable(use_reentrant=False)``, K=1 only).

Measured: CPU peak from the profiler's allocator events
(``remat_pass.measure.run.profiled_peak_cpu``), the peak of the running sum above the
start of one step, ``.grad`` None before it (the step allocates its gradients), after
two warm-up steps at that shape; the seed is set before every step (dropout). Step
time: median of ``--repeats`` steps over eager's. Gradients: against eager's, bitwise
or the largest absolute difference.

``--head-apart``: GPT-2's ``lm_head`` behind a graph break in every row (``HeadApart``).

``--bound``: GPT-2's step keeps the model's whole result until its backward returned
(``out = model(...); out.loss.backward()``), the logits held.

Usage: ``python benchmarks/compile_backend.py [--models gpt2,tiny --compilers eager
--batches 4 --dynamic --bf16 --bound --head-apart --repeats 3 --json out.json]``
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
import warnings
from typing import Any, Callable

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's remat_pass

import remat_pass  # noqa: E402
from remat_pass.errors import InfeasibleBudget, RematError  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.measure.run import profiled_peak_cpu  # noqa: E402
from remat_pass.models import gpt2, tiny_gpt  # noqa: E402

MIB = 2**20


class HeadApart(nn.Module):
    """GPT-2's ``lm_head`` behind a graph break (``--head-apart``): Dynamo compiles the
    head as its own graph (the split transformers' gradient-checkpointing path gets
    from its ``use_cache`` warning), so the logits' gradient is held only by the head's
    backward, not by the layer graph's whole backward (AOTAutograd's
    ``CompiledFunction.backward(ctx, *grads)`` keeps its arguments until it returns)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.head(x)


def make_model(name: str, batch: int, dropout: float | None,
               head_apart: bool = False) -> tuple[nn.Module, Callable[[int], Any]]:
    """``(model, inputs(batch))``: the model and a function giving its step inputs."""
    if name == "gpt2":
        model, inputs, _ = gpt2(batch=batch, **({} if dropout is None else {"dropout": dropout}))
        seq, vocab = inputs["input_ids"].shape[1], model.config.vocab_size
        if head_apart:
            model.lm_head = HeadApart(model.lm_head)
    else:
        model, (ids,), _ = tiny_gpt(batch=batch, **({} if dropout is None else {"dropout": dropout}))
        seq, vocab = ids.shape[1], model.tok.num_embeddings

    def inputs_of(b: int) -> torch.Tensor:
        return torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(b))

    return model, inputs_of


def backward(result: Any) -> None:
    """``result.backward()`` for a loss; for a model's whole result (``--bound``), its
    loss's, with the result held by this frame until backward returns (``out =
    model(...); out.loss.backward()``: ``out.logits`` stays alive)."""
    (result if isinstance(result, torch.Tensor) else result.loss).backward()


def loss_fn(name: str, bf16: bool, bound: bool = False) -> Callable[[nn.Module, torch.Tensor], Any]:
    def loss(model: nn.Module, ids: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if name == "gpt2":
                out = model(input_ids=ids, labels=ids, use_cache=False)
                return out if bound else out.loss
            logits = model(ids)
            return F.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())

    return loss


class CheckpointLayer(nn.Module):
    """One layer under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.layer, x, use_reentrant=False)


def with_checkpoint(name: str, model: nn.Module) -> nn.Module:
    m = copy.deepcopy(model)
    if name == "gpt2":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        m.blocks = nn.ModuleList(CheckpointLayer(b) for b in m.blocks)
    return m


def run(model: nn.Module, step: Callable[[torch.Tensor], torch.Tensor], ids_of: Callable[[int], torch.Tensor],
        batches: list[int], repeats: int, during: Any = None) -> list[dict[str, Any]]:
    """Per batch: warm up (the first call compiles), time, measure one step's peak."""
    params = list(model.parameters())
    out = []
    for batch in batches:
        ids = ids_of(batch)

        def once() -> None:
            for p in params:
                p.grad = None
            torch.manual_seed(1)
            backward(step(ids))

        with during if during is not None else torch.enable_grad():
            once()
        once()
        times = []
        for _ in range(max(repeats, 1)):
            t = time.perf_counter()
            once()
            times.append(time.perf_counter() - t)
        for p in params:
            p.grad = None

        def measured() -> None:
            torch.manual_seed(1)
            backward(step(ids))

        peak, _ = profiled_peak_cpu(measured)
        out.append({"batch": batch, "peak_bytes": peak, "step_s": statistics.median(times),
                    "grads": [p.grad.detach().clone() for p in params]})
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,tiny")
    ap.add_argument("--compilers", default="eager")
    ap.add_argument("--batches", default="4", help="batch sizes (several: with --dynamic)")
    ap.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True), one compile")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast inside the compiled step")
    ap.add_argument("--dropout", type=float, default=None, help="the models' dropout (default: theirs)")
    ap.add_argument("--schedules", default="none,uniform:1,uniform:2,optimized")
    ap.add_argument("--budget-fractions", default="0.05,0.35,0.65,0.95",
                    help="optimized budgets: uniform(K=1) + f * (none - uniform(K=1)) predicted step peaks")
    ap.add_argument("--references", default="budget:0.5,checkpoint",
                    help="aot_eager activation_memory_budget values (eager) and Inductor+checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bound", action="store_true",
                    help="gpt2: the step keeps the model's result through backward (out = model(...); "
                         "out.loss.backward())")
    ap.add_argument("--head-apart", action="store_true",
                    help="GPT-2: a graph break before lm_head in every row (the head its own graph)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1)
    return ap


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The batch sizes; every list option checked first (``ap.error``: exit 2, one line)
    so that a typo fails before minutes of compiling, not after."""
    def ints(text: str, what: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{what}={text!r}: comma-separated positive integers expected")
        if min(values) < 1:
            ap.error(f"{what}={text!r}: comma-separated positive integers expected")
        return values

    for name in args.models.split(","):
        if name not in ("gpt2", "tiny"):
            ap.error(f"--models: {name!r} is not one of gpt2, tiny")
    for compiler in args.compilers.split(","):
        for spec in args.schedules.split(","):
            method, _, k = spec.partition(":")
            try:  # the backend's own checks of its options (remat_pass.compile.options)
                if spec != "optimized":
                    remat_pass.backend(method, int(k) if k else None, compiler=compiler)
            except (ValueError, RematError) as e:
                ap.error(f"--compilers {compiler} --schedules {spec}: {e}")
    try:
        [float(x) for x in args.budget_fractions.split(",")]
        [float(x.split(":", 1)[1]) for x in args.references.split(",") if x.startswith("budget:")]
    except (ValueError, IndexError):
        ap.error("--budget-fractions / --references budget:F: F must be numbers")
    for spec in args.references.split(","):
        if spec != "checkpoint" and not spec.startswith("budget:"):
            ap.error(f"--references: {spec!r} is not budget:F or checkpoint")
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be at least 1")
    return ints(args.batches, "--batches")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = _parser()
    args = ap.parse_args(argv)
    batches = _check(ap, args)
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        rows += _model_rows(args, name, batches)
    _print(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"config": vars(args), "torch": torch.__version__, "rows": rows}, fh, indent=2)
    return rows


def _model_rows(args: argparse.Namespace, name: str, batches: list[int]) -> list[dict[str, Any]]:
    """One model's rows: eager (the reference), then per compiler the remat schedules,
    the optimized budgets (static shapes) and the references."""
    base, ids_of = make_model(name, batches[0], args.dropout, args.head_apart)
    loss = loss_fn(name, args.bf16, args.bound)
    torch._dynamo.reset()
    ref_model = copy.deepcopy(base)
    eager = run(ref_model, lambda ids: loss(ref_model, ids), ids_of, batches, args.repeats)
    tag = (f"{name} {'bf16' if args.bf16 else 'fp32'} {'dynamic' if args.dynamic else 'static'}"
           + (" bound" if args.bound and name == "gpt2" else "")
           + (" head apart" if args.head_apart and name == "gpt2" else ""))
    bench = _Bench(args, name, tag, base, ids_of, loss, batches, {r["batch"]: r for r in eager})
    bench.add("-", "eager", eager, {})
    for compiler in args.compilers.split(","):
        step_peaks = bench.schedules(compiler)
        if "optimized" in args.schedules.split(",") and not args.dynamic and {"none", "uniform:1"} <= set(step_peaks):
            bench.budgets(compiler, step_peaks["uniform:1"], step_peaks["none"])
        bench.references(compiler)
    return bench.rows


@dataclasses.dataclass
class _Bench:
    """One model's runs against its eager reference ``ref`` (by batch), as rows."""

    args: argparse.Namespace
    name: str
    tag: str
    base: nn.Module
    ids_of: Callable[[int], torch.Tensor]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    batches: list[int]
    ref: dict[int, dict[str, Any]]
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def failed(self, compiler: str, method: str, note: str) -> None:
        """A reference row that could not be run (per batch, figures None)."""
        for batch in self.batches:
            self.rows.append({
                "model": self.tag, "compiler": compiler, "method": method, "batch": batch,
                "measured_bytes": None, "predicted_bytes": None, "error_pct": None, "budget_bytes": None,
                "within_budget": None, "time_ratio": None, "grads_bitwise": None, "max_grad_diff": None,
                "note": note})

    def add(self, compiler: str, method: str, results: list[dict[str, Any]], predicted: dict[int, int | None],
            note: str = "", budget: int | None = None) -> None:
        tag = self.tag
        for r in results:
            e = self.ref[r["batch"]]
            equal = all(torch.equal(a, b) for a, b in zip(r["grads"], e["grads"]))
            diff = max(float((a - b).abs().max()) for a, b in zip(r["grads"], e["grads"]))
            p = predicted.get(r["batch"])
            self.rows.append({
                "model": tag, "compiler": compiler, "method": method, "batch": r["batch"],
                "measured_bytes": r["peak_bytes"], "predicted_bytes": p,
                "error_pct": None if p is None else 100.0 * (p - r["peak_bytes"]) / r["peak_bytes"],
                "budget_bytes": budget, "within_budget": None if budget is None else r["peak_bytes"] <= budget,
                "time_ratio": r["step_s"] / e["step_s"], "grads_bitwise": equal, "max_grad_diff": diff,
                "note": note})
            r2 = self.rows[-1]
            print(f"row: {tag} | {compiler} | {method} | batch {r['batch']} | measured {r2['measured_bytes']:,} | "
                  f"predicted {p if p is None else format(p, ',')} | time/eager {r2['time_ratio']:.2f} | "
                  f"grads {'bitwise' if equal else diff}", flush=True)

    def schedules(self, compiler: str) -> dict[str, int]:
        """The remat rows of every schedule but ``optimized``; their predicted step peaks."""
        args, base, loss, ids_of, batches = self.args, self.base, self.loss, self.ids_of, self.batches
        step_peaks: dict[str, int] = {}
        for spec in args.schedules.split(","):
            if spec == "optimized":
                continue
            method, _, k = spec.partition(":")
            torch._dynamo.reset()
            b = remat_pass.backend(method, int(k) if k else None, compiler=compiler)
            model = copy.deepcopy(base)
            f = torch.compile(lambda ids, m=model: loss(m, ids), backend=b, dynamic=args.dynamic)
            res = run(model, f, ids_of, batches, args.repeats)
            pred = {r["batch"]: _step_peak(b, r["batch"], ids_of) for r in res}
            step_peaks[spec] = pred[batches[0]]
            self.add(compiler, spec, res, pred, _note(b))
        return step_peaks

    def budgets(self, compiler: str, lo: int, hi: int) -> None:
        """The ``optimized`` rows at budgets ``lo + f * (hi - lo)``, f in ``--budget-fractions``."""
        args, base, loss, ids_of, batches, tag = self.args, self.base, self.loss, self.ids_of, self.batches, self.tag
        for frac in (float(x) for x in args.budget_fractions.split(",")):
            budget = int(lo + frac * (hi - lo))
            torch._dynamo.reset()
            b = remat_pass.backend("optimized", budget_bytes=budget, compiler=compiler)
            model = copy.deepcopy(base)
            f = torch.compile(lambda ids, m=model: loss(m, ids), backend=b)
            try:
                res = run(model, f, ids_of, batches, args.repeats)
            except InfeasibleBudget as e:
                print(f"row: {tag} | {compiler} | optimized {budget / MIB:.2f} MiB | {e}", flush=True)
                self.rows.append({"model": tag, "compiler": compiler, "method": f"optimized {budget / MIB:.2f} MiB",
                                  "batch": batches[0], "measured_bytes": 0, "predicted_bytes": e.least_feasible_peak_bytes,
                                  "error_pct": None, "budget_bytes": budget, "within_budget": None,
                                  "time_ratio": 0.0, "grads_bitwise": False, "max_grad_diff": 0.0,
                                  "note": "InfeasibleBudget (predicted = least feasible step peak)"})
                continue
            self.add(compiler, f"optimized {budget / MIB:.2f} MiB",
                     res, {r["batch"]: _step_peak(b, r["batch"], ids_of) for r in res}, _note(b), budget)

    def references(self, compiler: str) -> None:
        """The reference rows: ``aot_eager`` under ``activation_memory_budget`` (eager
        compiler), Inductor with ``torch.utils.checkpoint`` every layer (inductor)."""
        args, base, loss, ids_of, batches = self.args, self.base, self.loss, self.ids_of, self.batches
        for spec in args.references.split(","):
            if spec.startswith("budget:") and compiler == "eager":
                frac = float(spec.split(":")[1])
                torch._dynamo.reset()
                model = copy.deepcopy(base)
                f = torch.compile(lambda ids, m=model: loss(m, ids), backend="aot_eager", dynamic=args.dynamic)
                res = run(model, f, ids_of, batches, args.repeats,
                          torch._functorch.config.patch(activation_memory_budget=frac))
                self.add("aot_eager", f"activation_memory_budget={frac}", res, {})
            elif spec == "checkpoint" and compiler == "inductor":
                torch._dynamo.reset()
                model = with_checkpoint(self.name, base)
                f = torch.compile(lambda ids, m=model: loss(m, ids), backend="inductor", dynamic=args.dynamic)
                method = "checkpoint every layer (K=1)"
                try:
                    res = run(model, f, ids_of, batches, args.repeats)
                except Exception as e:  # PyTorch's own failure: a row that says so, not the run's end
                    first = (str(e).strip().splitlines() or [""])[0][:120]
                    self.failed("inductor", method, f"PyTorch failed: {type(e).__name__}: {first}")
                    continue
                self.add("inductor", method, res, {})


def _step_peak(b: Any, batch: int, ids_of: Callable[[int], torch.Tensor]) -> int | None:
    report = b.step_report(tuple(ids_of(batch).shape))
    return None if report is None else report.peak_bytes


def _note(b: Any) -> str:
    report = b.step_report()
    if report is None:
        return "no step report"
    scheds = "; ".join(f"{c.label}: {c.schedule}" for c in report.calls if c.layers)
    return f"{len(report.calls)} graphs, {report.model}; {scheds}" + ("" if report.exact else " (notes)")


def _print(rows: list[dict[str, Any]]) -> None:
    header = ["model", "compiler", "method", "batch", "measured MiB", "predicted MiB", "error %",
              "<= budget", "time / eager", "grads", "note"]
    table = [[r["model"], r["compiler"], r["method"], str(r["batch"]),
              "" if r["measured_bytes"] is None else f"{r['measured_bytes'] / MIB:.2f}",
              "" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / MIB:.2f}",
              "" if r["error_pct"] is None else f"{r['error_pct']:+.2f}",
              "" if r["within_budget"] is None else ("yes" if r["within_budget"] else "NO"),
              "" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}",
              "" if r["grads_bitwise"] is None else
              "bitwise" if r["grads_bitwise"] else f"{r['max_grad_diff']:.1e}",
              r["note"]] for r in rows]
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s)")
    print(text_table(header, table, "lllrrrrrrrl"))


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        over = [r for r in main() if r["within_budget"] is False]
    if over:  # a budget that does not hold is an error, never a silent exit 0
        raise SystemExit("ERROR: measured over budget: " + "; ".join(
            f"{r['model']} {r['compiler']} {r['method']} batch {r['batch']}: {r['measured_bytes']} B > "
            f"{r['budget_bytes']} B" for r in over))
