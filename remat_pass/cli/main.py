"""The ``remat-pass`` command line (argparse).

Subcommands:
    sweep   every Megatron recompute setting on a model: predicted vs measured peak.
    inspect the rewritten forward / backward graphs of a model or of a graph dump.
    report  liveness report: Markdown, versioned JSON, PNG timeline.
    check   CI gate: exit 1 when the predicted peak exceeds a budget or regresses.
    model   symbolic memory model: peak formulas in batch / seq.
    plan    optimized schedule under a peak budget (--granularity layer | op);
            --max-batch: largest batch.

Op-level policies (``sweep``): ``--selective`` (Megatron-LM
``--recompute-granularity selective``), ``--recompute-modules core_attn,mlp``
(Megatron-Core's names), ``--policy dots_saveable`` (JAX's names), with
``--module-kind KIND=PATH`` naming modules that are not recognised.

Every subcommand that takes a model accepts ``--model module:factory`` (default: the
shipped GPT-2) or ``--config PATH`` (a ``transformers`` config JSON, ``--task``),
``--batch``, ``--seq``, ``--layers`` (number of layers, passed to the factory) and
``--stack`` (module path of a layer stack, repeatable for several, when they are not
found automatically);
``--meta`` builds it without weights (predicted only), ``--dtype`` / ``--autocast`` set
the precision, ``--target cuda`` predicts for a GPU (``--gpu``), and ``--optimizer``,
``--master-weights`` and ``--device-memory`` add static memory and the device's
activation budget (``evaluate/workload.py``).

This module holds the parser and the dispatch; the commands live in ``cli.sweep``
(``sweep``), ``cli.report`` (``inspect``, ``report``, ``check``), ``cli.plan``
(``model``, ``plan``) and ``cli.parallel`` (the per-rank ``sweep`` / ``plan``), the
options they share in ``cli.common``; ``cli.flags`` refuses flags that contradict each
other or do not apply. Exit codes: 0 ok, 1 a gate or gradient check failed, 2 bad input
(the message on stderr, no traceback), 130 interrupted (Ctrl-C: one line; a sweep first
writes the rows it finished to --json, marked ``"partial": true``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Sequence

from .parallel import add_parallel_args
from .plan import cmd_model, cmd_plan
from .report import cmd_check, cmd_inspect, cmd_report
from .sweep import add_policy_args, cmd_sweep
from .megatron import add_megatron_parser
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE  # noqa: F401 - what main returns, also for its callers
from .common import add_model_args, add_schedule_args, positive_int
from .flags import check_flags

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
from ..errors import RematError
from ..formatting import fmt_bytes, parse_bytes
from ..plan.op_planner import CostModel


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="remat-pass", allow_abbrev=False,
        description="Activation recomputation as a compiler pass: predicted and measured peak memory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('remat-pass')}")
    # no prefix matching: --lay is not --layers (a typo must not pick a flag)
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    p = sub.add_parser("sweep", help="predicted vs measured peak for none, uniform K=1..L, block N=0..L")
    add_model_args(p)
    add_policy_args(p)
    add_parallel_args(p)
    p.add_argument("--measure", action="store_true",
                   help="per-rank: also launch the ranks on gloo and measure every rank (multi-process)")
    p.add_argument("--repeats", type=positive_int, default=1, help="per-rank --measure: measured steps per setting")
    p.add_argument("--allocator", choices=("cpu", "cuda"),
                   help="allocator model for the predicted bytes (default: the --target's; per-rank: cpu)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=cmd_sweep)
    add_megatron_parser(sub)
    p = sub.add_parser("inspect", help="the rewritten forward/backward graphs, saved activations, recompute segments")
    add_model_args(p)
    add_schedule_args(p, allow_all=False)
    p.add_argument("--graph", metavar="PATH", help="read a graph dump (*.remat.json, written by the torch.compile "
                   "backend or --dump) instead of tracing a model")
    p.add_argument("--section", action="append", choices=("summary", "forward", "backward", "saved", "segments", "code"),
                   help="what to print (repeatable; default: all but code)")
    p.add_argument("--only-layer", metavar="LAYER", help="node tables: only this layer (an index or 'outer')")
    p.add_argument("--dump", metavar="DIR", help="also write the dump file that --graph reads into DIR")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("report", help="liveness report: Markdown (CI step summary), versioned JSON, PNG timeline")
    add_model_args(p)
    add_schedule_args(p)
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown here instead of stdout")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (schema: remat_pass/report_schema.json)")
    p.add_argument("--timeline", action="store_true", help="JSON: include the live bytes at every step")
    p.add_argument("--png", metavar="PATH", help="draw the memory timeline, stacked by layer (needs matplotlib)")
    p.add_argument("--measure", action="store_true",
                   help="run the step on CPU and overlay the measured per-step bytes (PNG) and peak (Markdown)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("check", help="CI gate: exit 1 when the predicted peak exceeds a budget or regresses")
    add_model_args(p)
    add_schedule_args(p)
    p.add_argument("--budget", metavar="SIZE", help="largest allowed predicted peak, e.g. 2GiB, 512MiB, 1.5GB")
    p.add_argument("--baseline", metavar="PATH", help="baseline report JSON (remat-pass report/check --json)")
    p.add_argument("--max-regression", metavar="FRACTION",
                   help="allowed growth over the --baseline peak: a percentage (5%%) or a fraction below 1 "
                        "(0.05) (default: 0%%)")
    p.add_argument("--report", metavar="PATH", help="check this report JSON instead of tracing a model")
    p.add_argument("--json", metavar="PATH", help="write the current reports as JSON (to update a baseline)")
    p.add_argument("--markdown", metavar="PATH", help="write the verdict as Markdown (e.g. $GITHUB_STEP_SUMMARY)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("model", help="symbolic memory model: peak formulas in batch / seq (text and LaTeX)")
    add_model_args(p)
    p.set_defaults(func=cmd_model)
    p = sub.add_parser("plan", help="optimized schedule: least recompute under a peak budget")
    add_model_args(p)
    p.add_argument("--budget", metavar="SIZE", help="peak budget (activation bytes): bytes or 1.5GiB, 800MiB, 2GB; "
                   "or give --device-memory")
    add_parallel_args(p)
    p.add_argument("--allocator", choices=("cpu", "cuda"),
                   help="allocator model for the predicted bytes (default: the --target's; per-rank: cpu)")
    p.add_argument("--max-batch", action="store_true",
                   help="instead: the largest batch that fits the budget, per Megatron schedule")
    p.add_argument("--granularity", choices=("layer", "op"), default="layer",
                   help="layer: recompute whole layers in groups; op: also choose, per layer, which values to "
                        "save (exact per layer kind, integer programs) (default: %(default)s)")
    p.add_argument("--flops-per-byte", type=int, default=CostModel().flops_per_byte, metavar="N",
                   help="op: roofline machine balance, a recomputed op costs max(FLOPs, N x bytes moved) "
                        "(default: %(default)s)")
    p.add_argument("--timed-costs", action="store_true", help="op: cost ops by timing them on this machine")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.set_defaults(func=cmd_plan)
    return parser


OUTPUTS = ("json", "markdown", "png")
INPUTS = ("config", "baseline", "report", "graph")


def check_paths_and_sizes(args: argparse.Namespace) -> None:
    """What can be checked before any model is built: input files exist, output files
    can be written where asked (not a folder, in an existing folder this user can write;
    a missing folder is not made: a typo would otherwise create folders anywhere), the
    --dump and calibration cache folders can be made, --png has matplotlib, sizes parse.

    Raises:
        ValueError: the option is named, with what is wrong.
    """
    for name in INPUTS:
        path = getattr(args, name, None)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--{name} {path}: no such file")
    for name in OUTPUTS:
        path = getattr(args, name, None)
        if path is None:
            continue
        if Path(path).is_dir():
            raise ValueError(f"--{name} {path}: is a folder; give a file name")
        folder = Path(path).absolute().parent
        if not folder.exists():
            raise ValueError(f"--{name} {path}: the folder {folder} does not exist; make it first "
                             f"(mkdir -p {folder}) or give a path in an existing folder")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ValueError(f"--{name} {path}: {folder} is not a folder this user can write to")
    dump = getattr(args, "dump", None)
    if dump is not None:
        parent = Path(dump).absolute().parent
        if Path(dump).exists() and not Path(dump).is_dir():
            raise ValueError(f"--dump {dump}: is a file; give a folder")
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"--dump {dump}: {parent} is not an existing folder this user can write to")
    if getattr(args, "png", None) is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--png draws with matplotlib, which is not installed: pip install 'remat-pass[plot]' "
                         "(or pip install matplotlib), or drop --png")
    cache = getattr(args, "calibration_cache", None)
    if cache is not None and not getattr(args, "no_calibrate", False):
        folder = Path(cache).absolute()
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ValueError(f"--calibration-cache {cache}: {folder} is not a folder this user can write to; "
                             "give another folder, or --no-calibrate")
    for name in ("budget", "device_memory"):
        value = getattr(args, name, None)
        if value is not None:
            try:
                size = parse_bytes(value)
            except ValueError as e:
                raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
            if size <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {value}: a size must be more than 0 bytes")


def size_notes(args: argparse.Namespace) -> list[str]:
    """A line for each --budget / --device-memory whose unit is decimal (GB = 10^9
    bytes) or absent (bytes), saying what it was read as, since 80GB and 80GiB differ by
    7 % and a bare 80 is 80 bytes; binary units (GiB) need no note.

    Example:
        >>> size_notes(argparse.Namespace(budget="80GB", device_memory="80GiB"))
        ['--budget 80GB read as 80,000,000,000 bytes = 74.51 GiB (GB, MB: powers of 1000; GiB, MiB: powers of 1024)']
    """
    notes = []
    for name in ("budget", "device_memory"):
        value = getattr(args, name, None)
        if not isinstance(value, str):
            continue
        unit = value.strip().lstrip("0123456789.").strip().lower()
        if unit in ("", "b"):
            notes.append(f"--{name.replace('_', '-')} {value} read as {parse_bytes(value):,} bytes (a bare number is "
                         "bytes: write 80GiB for 80 x 2^30)")
        elif unit in ("kb", "mb", "gb", "tb"):
            notes.append(f"--{name.replace('_', '-')} {value} read as {parse_bytes(value):,} bytes = "
                         f"{fmt_bytes(parse_bytes(value))} (GB, MB: powers of 1000; GiB, MiB: powers of 1024)")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat-pass`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # --model mymod:make finds mymod.py in the current folder, as `python -m` would (appended:
    # a file here never shadows an installed package)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        check_flags(args)
        check_paths_and_sizes(args)
        for line in size_notes(args):
            print(line, file=sys.stderr)
        return args.func(args)
    except (RematError, ValueError, ImportError, OSError) as e:
        print(f"remat-pass: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("remat-pass: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
