"""Op scratch: predicted vs measured peaks with calibration and with the formula table only.

For every model of the test zoo (``tests/helpers/zoo/``) that traces, and the shipped models
(``remat_pass.models``: TinyGPT, the Linear chain, GPT-2), under every distinct
Megatron schedule, prints the measured peak next to two predictions:

- ``table``: the memory model without calibration (the ATen formula table,
  ``remat_pass.memory.scratch_table``);
- ``calibrated``: every op signature run alone under the allocator profiler on this
  machine (``remat_pass.memory.calibration``), the table only where that fails;

and per model the calibration cost (signatures calibrated, seconds). A summary counts
the rows predicted to the byte and the largest differences. The calibration cache is a
fresh temporary folder, so every signature is calibrated here.

Run from the repository root:
    python benchmarks/op_scratch.py [--threads 1] [--gpt2] [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT))  # this checkout's remat_pass

from remat_pass.memory.calibration import CACHE_ENV  # noqa: E402
from remat_pass.errors import RematError  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.recompute.schedule import distinct_megatron_schedules  # noqa: E402
from remat_pass.evaluate.session import Session  # noqa: E402


def shipped(with_gpt2: bool) -> list[tuple[str, object, str | None]]:
    from remat_pass.models import gpt2, linear_chain, tiny_gpt

    models = [("tiny_gpt (models)", lambda: tiny_gpt(batch=2, seq=64, layers=4, hidden=64, heads=4, vocab=128), None),
              ("linear_chain (models)", lambda: linear_chain(layers=4), None)]
    if with_gpt2:
        models.append(("gpt2 default (models)", gpt2, None))
    return models


def zoo_models() -> list[tuple[str, object, str | None]]:
    from zoo import ZOO

    out = []
    for e in ZOO:
        if e.refusal is not None:  # the pass refuses it: nothing to sweep
            continue
        if any(not _importable(m) for m in e.requires):
            continue
        out.append((e.name, e.build, e.layers))
    return out


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def run(name: str, build, layers: str | None, schedule_limit: int | None) -> list[dict]:
    model, inputs, loss_fn = build()
    torch.manual_seed(0)
    try:
        calibrated = Session.create(model, inputs, loss_fn, layers=layers)
    except RematError as e:
        print(f"{name}: refused ({type(e).__name__})", file=sys.stderr)
        return []
    table_only = Session(calibrated.joint, calibrated.stack, inputs, loss_fn, calibrated.seed, None)
    rows = []
    todo = distinct_megatron_schedules(calibrated.stack.layers_per_stack)
    if schedule_limit:
        todo = todo[:schedule_limit]
    for sch in todo:
        try:
            r = calibrated.evaluate(sch, strict=False)
        except RematError:
            continue
        if not r.grads_equal:
            rows.append({"model": name, "schedule": sch.provenance, "grads_equal": False})
            continue
        rows.append({
            "model": name, "schedule": sch.provenance, "grads_equal": True,
            "measured_bytes": r.measured_peak_bytes,
            "calibrated_bytes": r.predicted_peak_bytes,
            "table_bytes": table_only.report(sch).peak_bytes,
        })
    cal = calibrated.calibrator
    for row in rows:
        row["signatures"] = cal.calibrated_signatures
        row["calibrate_s"] = round(cal.calibrate_s, 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpt2", action="store_true", help="also the default 12-layer GPT-2 (slow)")
    parser.add_argument("--only", nargs="*", help="only these model names")
    parser.add_argument("--gpt2-schedules", type=int, default=5, help="schedules of GPT-2 to run (default 5)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="remat-op-memory-")
    models = zoo_models() + shipped(args.gpt2)
    if args.only:
        unknown = sorted(set(args.only) - {m[0] for m in models})
        if unknown:
            parser.error(f"--only: no model named {', '.join(map(repr, unknown))}; the names are: "
                         + ", ".join(repr(m[0]) for m in models))
        models = [m for m in models if m[0] in args.only]
    rows: list[dict] = []
    t0 = time.perf_counter()
    per_model = []
    for name, build, layers in models:
        limit = args.gpt2_schedules if name.startswith("gpt2") else None
        got = run(name, build, layers, limit)
        rows += got
        if got:
            per_model.append([name, str(len(got)), str(got[0]["signatures"]), f"{got[0]['calibrate_s']:.2f}",
                              str(sum(r.get("calibrated_bytes") == r.get("measured_bytes") for r in got)),
                              str(sum(r.get("table_bytes") == r.get("measured_bytes") for r in got))])
    print(f"threads {args.threads}, torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {time.perf_counter() - t0:.0f} s in all\n")
    print(text_table(["model", "schedules", "signatures calibrated", "calibration s", "calibrated exact",
                      "table exact"], per_model, align="lrrrrr"))
    ok = [r for r in rows if r["grads_equal"]]
    print()
    for key in ("calibrated_bytes", "table_bytes"):
        diffs = [r[key] - r["measured_bytes"] for r in ok]
        exact = sum(d == 0 for d in diffs)
        worst = sorted(ok, key=lambda r: -abs(r[key] - r["measured_bytes"]) / max(r["measured_bytes"], 1))[:3]
        print(f"{key.split('_')[0]:10s}: {exact} of {len(ok)} peaks exact; under-predicted {sum(d < 0 for d in diffs)}, "
              f"over {sum(d > 0 for d in diffs)}; largest: " + "; ".join(
                  f"{r['model']} {r['schedule']} {r[key] - r['measured_bytes']:+d} B "
                  f"({100 * (r[key] - r['measured_bytes']) / r['measured_bytes']:+.2f} %)" for r in worst
                  if r[key] != r["measured_bytes"]))
    print(f"gradients unequal: {sum(not r['grads_equal'] for r in rows)} of {len(rows)} rows")
    sigs = sum(float(m[2]) for m in per_model)
    secs = sum(float(m[3]) for m in per_model)
    print(f"calibration: {sigs:.0f} signatures in {secs:.1f} s ({1000 * secs / max(sigs, 1):.1f} ms per signature)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
