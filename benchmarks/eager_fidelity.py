"""The user's eager program against the rewritten step, per recompute setting.

For each model (``tiny``: TinyGPT with dropout 0.1, loss outside the model; ``gpt2``: a
3-layer transformers GPT-2 with dropout 0.1; ``llama`` and ``t5`` from
``remat_pass.models.hf_families``; ``mcore`` / ``mcore-32k``: Megatron-Core's GPTModel,
4 layers, hidden 128, seq 64, micro-batch 2 (``--mcore-shape``), vocabulary 512 / 32768,
dropout 0.1, its own recompute; ``mcore-p0`` / ``mcore-32k-p0``: the same at dropout 0), and each
setting (``none``, uniform K=1, block N=1
.. L-1):

- eager measured: the real eager step (the model as written, the setting applied as
  users apply it: transformers' ``gradient_checkpointing_enable`` per layer, else
  ``torch.utils.checkpoint`` per layer; ``--reentrant`` for ``use_reentrant=True``)
  under the allocator profiler, its peak above the start of the step;
- eager predicted: the same step recorded on fake tensors
  (``remat_pass.evaluate.eager_program``);
- rewrite measured / predicted: this project's rewrite of the traced step under the
  same setting (``Session.evaluate``), gradients against the un-rewritten step.

The summary line per model says whether eager predicted == measured in every row,
whether the rewrite used at most eager's memory in every row, and the least-memory
setting of each. CPU, fp32, 1 thread. Groups of several layers (uniform K > 1, K
dividing L) run under one ``torch.utils.checkpoint`` each on TinyGPT, and under
Megatron-Core's own recompute; transformers models checkpoint one layer at a time.

Usage: ``python benchmarks/eager_fidelity.py [--models tiny,gpt2,llama,t5 --reentrant --json out.json]
[--mcore-shape 8,256,128,8]`` (layers, hidden, seq, micro-batch of the Megatron-Core models;
issue 19's table used 8,256,128,8 with 4 heads)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's remat_pass
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from remat_pass.evaluate.eager_program import eager_program  # noqa: E402
from remat_pass.evaluate.session import Session  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.models import hf_families, tiny_gpt  # noqa: E402
from remat_pass.recompute import schedule as schedules  # noqa: E402

MODELS = ("tiny", "gpt2", "llama", "t5", "mcore", "mcore-32k", "mcore-p0", "mcore-32k-p0")
MCORE_SHAPE = (4, 128, 64, 2)  # layers, hidden, seq, micro-batch


def build(name: str, mcore_shape: tuple[int, int, int, int] = MCORE_SHAPE) -> tuple[Any, Any, Any, str]:
    """``(model, inputs, loss_fn, stack path)``."""
    if name == "tiny":
        model, inputs, loss_fn = tiny_gpt(batch=4, seq=64, layers=4, hidden=128, heads=4, vocab=256, dropout=0.1)
        return model, inputs, loss_fn, "blocks"
    if name == "gpt2":
        from small_models import small_gpt2

        model, inputs, loss_fn = small_gpt2(layers=3, dropout=0.1)
        return model, inputs, loss_fn, "transformer.h"
    if name.startswith("mcore"):
        from remat_pass.models.megatron import megatron_gpt

        layers, hidden, seq, batch = mcore_shape
        model, inputs, loss_fn = megatron_gpt(layers=layers, hidden=hidden, heads=4, seq=seq, batch=batch,
                                              dropout=0.0 if name.endswith("-p0") else 0.1,
                                              vocab=32768 if "32k" in name else 512)
        return model, inputs, loss_fn, "decoder.layers"
    model, inputs, loss_fn = getattr(hf_families, name)()
    return model, inputs, loss_fn, "model.layers" if name == "llama" else "encoder.block"


def rows_of(name: str, reentrant: bool, mcore_shape: tuple[int, int, int, int] = MCORE_SHAPE) -> list[dict[str, Any]]:
    """One row per setting of model ``name`` (see the module docstring)."""
    model, inputs, loss_fn, stack = build(name, mcore_shape)
    layers = len(model.get_submodule(stack))
    settings = [schedules.none(layers), schedules.uniform(1, layers)]
    if name == "tiny" or name.startswith("mcore"):  # one checkpoint per group; Megatron-Core's own loop
        settings += [schedules.uniform(k, layers) for k in range(2, layers + 1) if layers % k == 0]  # Megatron's
    settings += [schedules.block(n, layers) for n in range(1, layers)]
    session = Session.create(model, inputs, loss_fn, layers=stack)
    rows = []
    for sch in settings:
        eager = eager_program(model, inputs, loss_fn, sch, layers=stack, use_reentrant=reentrant)
        rewrite = session.evaluate(sch)
        rows.append({"model": name, "setting": sch.provenance,
                     "eager_measured": eager.measured_peak_bytes, "eager_predicted": eager.predicted.peak_bytes,
                     "rewrite_measured": rewrite.measured_peak_bytes, "rewrite_predicted": rewrite.predicted_peak_bytes,
                     "rewrite_grads_equal": rewrite.grads_equal, "eager_notes": list(eager.predicted.notes)})
        print(f"row: {rows[-1]}", flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    exact = all(r["eager_predicted"] == r["eager_measured"] for r in rows)
    never_worse = all(r["rewrite_measured"] <= r["eager_measured"] for r in rows)
    low_eager = min(r["eager_measured"] for r in rows)
    low_rewrite = min(r["rewrite_measured"] for r in rows)
    least_eager = [r["setting"] for r in rows if r["eager_measured"] == low_eager]
    least_rewrite = [r["setting"] for r in rows if r["rewrite_measured"] == low_rewrite]
    agree = "the same" if set(least_eager) & set(least_rewrite) else "DIFFERENT"
    return (f"{rows[0]['model']}: eager predicted == measured in {'every' if exact else 'NOT every'} row; "
            f"rewrite <= eager in {'every' if never_worse else 'NOT every'} row; least memory: eager "
            f"{', '.join(least_eager)}, rewrite {', '.join(least_rewrite)} (ties listed; {agree})")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reentrant", action="store_true", help="torch.utils.checkpoint(use_reentrant=True)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mcore-shape", default=",".join(map(str, MCORE_SHAPE)),
                    help="layers,hidden,seq,micro-batch of the Megatron-Core models (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        mcore_shape = tuple(int(v) for v in args.mcore_shape.split(","))
        assert len(mcore_shape) == 4 and min(mcore_shape) > 0
    except (ValueError, AssertionError):
        ap.error(f"--mcore-shape: four positive integers layers,hidden,seq,micro-batch, not {args.mcore_shape!r}")
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: {unknown} not among {list(MODELS)}")
    torch.set_num_threads(1)
    rows, lines = [], []
    for name in names:
        mine = rows_of(name, args.reentrant, mcore_shape)
        rows += mine
        lines.append(summary(mine))
    mib = 2 ** 20
    print(text_table(["model", "setting", "eager measured MiB", "eager predicted MiB", "rewrite measured MiB",
                      "rewrite predicted MiB", "rewrite/eager", "grads"],
                     [[r["model"], r["setting"], f"{r['eager_measured'] / mib:.4f}", f"{r['eager_predicted'] / mib:.4f}",
                       f"{r['rewrite_measured'] / mib:.4f}", f"{r['rewrite_predicted'] / mib:.4f}",
                       f"{r['rewrite_measured'] / r['eager_measured']:.3f}",
                       "bitwise" if r["rewrite_grads_equal"] else "DIFFER"] for r in rows]))
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"torch": torch.__version__, "reentrant": args.reentrant, "mcore_shape": list(mcore_shape),
                       "rows": rows}, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
