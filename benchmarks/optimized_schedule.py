"""Optimized schedule versus Megatron uniform / block under peak budgets, measured.

For budgets spread from the unconstrained peak (``none``) down to the least feasible
peak, on a GPT-2 (transformers) and on a heterogeneous stack, prints per budget: the
optimized schedule (least recompute FLOPs under the budget, ``solvers.chain_search``), its
predicted (liveness) and measured peak, the recompute FLOPs, and the best uniform /
block schedule that fits the same budget; then the solver's time against L.

``--zoo``: instead, one table over the zoo (``tests/helpers/zoo``, every entry that
sweeps) and the small ``transformers`` families (``remat_pass.models.hf_families``): at
layer and at op level, the planner's least feasible peak against the lowest Megatron
setting (uniform K / block N, every K and N), the time to plan (planner built, least
found, one plan at the least), and what bounded the search (``OpPlan.bound``, its
proven gap); a least above the best Megatron setting is an error (exit 1).

Run from the repository root:  python benchmarks/optimized_schedule.py
(``--solver-only``: just the solver-time table; ``--zoo [--families llama,t5]``).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hetero import hetero_gpt  # noqa: E402

from remat_pass.models import gpt2  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.plan.planner import Planner  # noqa: E402
from remat_pass.evaluate.session import Session, megatron_schedules  # noqa: E402
from solvers import ChainCosts, least_recompute  # noqa: E402

MIB = 2**20


def table(name: str, model, inputs, loss_fn, n_budgets: int = 8) -> list[str]:
    """Print the table of one model; return the rows measured over their budget."""
    t0 = time.perf_counter()
    session = Session.create(model, inputs, loss_fn)
    planner = Planner(session.joint, session.stack, session.report)
    L = planner.model.num_layers
    megatron = [(s, planner.report(s)) for s in megatron_schedules(session.stack.layers_per_stack)]
    least = planner.least_feasible()[1]
    top = planner.unconstrained_peak_bytes
    budgets = sorted({least + (top - least) * i // (n_budgets - 1) for i in range(n_budgets)}, reverse=True)
    plans = planner.plan_many(budgets)
    rows = []
    better = 0
    measured_all = []
    over = []
    for budget, p in zip(budgets, plans):
        r = session.evaluate(p.schedule)
        if r.measured_peak_bytes > budget:
            over.append(f"{name}: {p.describe()} measured {r.measured_peak_bytes} B over the budget {budget} B "
                        f"by {r.measured_peak_bytes - budget} B (predicted {p.predicted_peak_bytes} B)")
        fits = [(rep.recompute_flops, rep.peak_bytes, s.provenance) for s, rep in megatron if rep.peak_bytes <= budget]
        best = min(fits) if fits else None
        better += bool(best and p.recompute_flops < best[0])
        measured_all.append(r.measured_peak_bytes)
        rows.append([
            f"{budget / MIB:.2f}",
            p.describe(),
            f"{p.predicted_peak_bytes / MIB:.2f}",
            f"{r.measured_peak_bytes / MIB:.2f}",
            f"{100 * (r.measured_peak_bytes - budget) / budget:+.2f}",
            f"{100 * p.recompute_fraction:.1f}",
            f"{best[2]} {100 * best[0] / p.forward_flops:.1f}" if best else "none fits",
            "yes" if r.grads_equal else "NO",
            f"{1000 * p.solve_time_s:.1f}",
        ])
    print(f"\n## {name}: L={L}, unconstrained (none) {top / MIB:.2f} MiB, least feasible {least / MIB:.2f} MiB "
          f"(calibration {planner.calibrate_s:.2f} s, total {time.perf_counter() - t0:.0f} s)\n")
    print(text_table(
        ["budget MiB", "optimized schedule", "predicted MiB", "measured MiB", "vs budget %",
         "recompute %", "best uniform/block that fits, recompute %", "grads equal", "solve ms"],
        rows, align="llrrrrlrr"))
    mono = all(b <= a for a, b in zip(measured_all, measured_all[1:]))
    print(f"\nmeasured peak never rises as the budget falls: {'yes' if mono else 'NO'}; "
          f"optimized strictly cheaper than the best fitting uniform/block at {better} of {len(budgets)} budgets; "
          f"measured over budget: {len(over)}")
    return over


def random_chain(L: int, seed: int = 0) -> ChainCosts:
    """Random heterogeneous chain costs (every layer different), as in tests/helpers/chain_cases.py."""
    r = random.Random(seed)

    def v(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(r.randint(lo, hi) for _ in range(L))

    return ChainCosts(v(50, 200), v(5, 20), v(0, 3), v(40, 150), v(30, 120), v(100, 300),
                      v(100, 300), v(50, 200), v(10, 100), v(10, 100), 300, 200)


def _cpu_ms(fn, repeats: int) -> tuple[float, object]:
    """Median process CPU milliseconds of ``fn()`` over ``repeats`` runs (the machine is
    shared: CPU time of this process, not wall time), and its result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        times.append(1000 * (time.process_time() - t0))
    return statistics.median(times), out


def solve_times(lengths: tuple[int, ...] = (12, 24, 48, 72, 96), old_up_to: int = 96) -> None:
    """The chain solver's time against L on random heterogeneous chains (budget 300 +
    40 L), next to the dynamic program without bounds it replaced (tests/helpers/chain_oracle.py),
    both exact: the least recompute must agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    import chain_oracle

    rows = []
    for L in lengths:
        c = random_chain(L)
        budget = 300 + 40 * L
        new_ms, sol = _cpu_ms(lambda: least_recompute(c, budget), 5)
        row = [str(L), str(budget), str(sol.recompute_flops), str(len(sol.groups)), f"{new_ms:.1f}"]
        if L <= old_up_to:
            old_ms, old = _cpu_ms(lambda: chain_oracle.least_recompute(c, budget), 1)
            row += [f"{old_ms:.0f}", "yes" if old.recompute_flops == sol.recompute_flops else "NO"]
        else:
            row += ["-", "-"]
        rows.append(row)
    print("\n## chain solver time (random heterogeneous chain costs; CPU ms of this process)\n")
    print(text_table(["L", "budget", "least recompute", "groups", "solve ms (median of 5)",
                      "unbounded DP ms", "same optimum"], rows))


def zoo_models(families: list[str]) -> list[tuple[str, object]]:
    """(name, build) of every zoo entry that sweeps, then the named transformers families."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from zoo import ZOO

    out = [(f"zoo:{e.name}", e.build) for e in ZOO if e.refusal is None and e.layers is None and not e.requires]
    if families:
        from remat_pass.models.hf_families import FAMILIES

        out += [(f"hf:{f}", FAMILIES[f]) for f in families]
    return out


def least_row(name: str, build) -> list[list[str]]:
    """The two rows (layer, op) of one model, or one row saying why it was not planned."""
    from remat_pass.plan.op_planner import OpPlanner
    from remat_pass.recompute.schedule import distinct_megatron_schedules

    try:
        session = Session.create(*build())
    except Exception as e:  # noqa: BLE001 - recorded, the table goes on
        return [[name, "-", "-", "-", "-", "-", f"not traced: {type(e).__name__}: {str(e)[:80]}"]]
    named = {s.provenance: session.report(s).peak_bytes
             for s in distinct_megatron_schedules(session.stack.layers_per_stack)}
    best = min(named, key=named.get)
    rows = []
    for level in ("layer", "op"):
        t0 = time.perf_counter()
        try:
            planner = (Planner if level == "layer" else OpPlanner)(session.joint, session.stack, session.report)
            least = planner.least_feasible_checked().predicted_peak_bytes
            plan = planner.plan(least)
            bound = getattr(plan, "bound", None) or "exact"
            note = bound if least <= named[best] else f"ERROR: least above {best}; {bound}"
        except Exception as e:  # noqa: BLE001 - recorded, the table goes on
            rows.append([name, level, "-", f"{named[best]} ({best})", "-", f"{time.perf_counter() - t0:.1f}",
                         f"not planned: {type(e).__name__}: {str(e)[:80]}"])
            continue
        rows.append([name, level, str(least), f"{named[best]} ({best})", f"{least - named[best]:+d}",
                     f"{time.perf_counter() - t0:.1f}", note])
    return rows


def zoo_table(families: list[str]) -> bool:
    """Print the ``--zoo`` table; True when every least is at or below the best Megatron."""
    rows = []
    for name, build in zoo_models(families):
        rows += least_row(name, build)
        print(f"  {name}: {rows[-1][2]} B ({rows[-1][5]} s)", file=sys.stderr, flush=True)
    print("\n## least feasible peak (bytes, predicted by liveness) against the lowest Megatron setting\n")
    print(text_table(["model", "level", "least feasible", "best Megatron (setting)", "least - best",
                      "plan time s", "search"], rows, align="llrrrrl"))
    return not any(r[6].startswith(("ERROR", "not planned")) for r in rows)


def main() -> None:
    if "--solver-only" in sys.argv:
        solve_times()
        return
    if "--zoo" in sys.argv:
        families = sys.argv[sys.argv.index("--families") + 1].split(",") if "--families" in sys.argv else []
        sys.exit(0 if zoo_table(families) else 1)
    model, inputs, loss_fn = gpt2(batch=4, seq=128, layers=8, hidden=128, heads=4, vocab=512, dropout=0.1)
    over = table("GPT-2 (transformers; 8 layers, hidden 128, seq 128, batch 4, vocab 512, dropout 0.1)",
                 model, inputs, loss_fn)
    model, inputs, loss_fn = hetero_gpt(batch=4, seq=64, layers=6, hidden=64)
    over += table("heterogeneous stack (6 MixedBlocks: attention+MLP 1x, 8x; MLP-only 4x; attention+MLP 2x, 16x; "
                  "MLP-only 1x; hidden 64, seq 64, batch 4)", model, inputs, loss_fn)
    solve_times()
    if over:  # a budget that does not hold is an error, never a silent exit 0
        print("\nERROR: measured peaks over their budget:\n  " + "\n  ".join(over), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
