"""The ``remat-pass`` command line (argparse).

Subcommands:
    sweep   every Megatron recompute setting on a model: predicted vs measured peak.

Every subcommand that takes a model accepts ``--model module:factory`` (default: the
shipped GPT-2), ``--batch``, ``--seq``, ``--layers`` (number of layers, passed to the
factory) and ``--stack`` (module path of the layer stack when it is not found
automatically).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .errors import RematError
from .models import build
from .report import SWEEP_COLUMNS, sweep_rows, text_table, write_json
from .sweep import Session, sweep

DEFAULT_MODEL = "remat_pass.models:gpt2"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add the options that choose the model and its input."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="MODULE:FACTORY",
                   help="factory returning (model, example_inputs, loss_fn) (default: %(default)s)")
    g.add_argument("--batch", type=int, help="batch size passed to the factory")
    g.add_argument("--seq", type=int, help="sequence length passed to the factory")
    g.add_argument("--layers", type=int, help="number of layers passed to the factory")
    g.add_argument("--stack", metavar="PATH",
                   help="module path of the layer stack (e.g. transformer.h); found automatically if omitted")
    g.add_argument("--seed", type=int, default=0, help="RNG seed for every run (default: 0)")


def load_session(args: argparse.Namespace) -> Session:
    """Build the model from the factory and trace it (prints what it does to stderr)."""
    model, inputs, loss_fn = build(args.model, batch=args.batch, seq=args.seq, layers=args.layers)
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
            "model": args.model,
            "layer_stack": session.stack.path,
            "num_layers": session.stack.num_layers,
            "static_bytes": sum(int(v.untyped_storage().nbytes()) for v in session.joint.primal_values),
            "rows": [r.to_dict() for r in results],
        })
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r.grads_equal for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="remat-pass",
        description="Activation recomputation as a compiler pass: predicted and measured peak memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sweep", help="predicted vs measured peak for none, uniform K=1..L, block N=0..L")
    add_model_args(p)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=cmd_sweep)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat-pass`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RematError, ValueError, ImportError) as e:
        print(f"remat-pass: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
