"""``sweep --program eager``: the user's eager program next to the rewrite, per setting
(``evaluate/eager_program``): the model as written, with ``torch.utils.checkpoint`` (or
transformers' own ``gradient_checkpointing_enable``) around each recomputed layer or
group of layers,
predicted from its recording on fake tensors and measured; the rewrite's predicted
peak beside it and the difference."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import RematError
from ..evaluate.eager_program import (eager_program, peak_difference_by_cause, peak_difference_by_op,
                                      rewrite_live_by_cause, rewrite_live_by_op)
from ..evaluate.schedule_result import ScheduleResult
from ..evaluate.workload import Workload
from ..formatting import fmt_bytes, mib, text_table
from ..memory.cuda_target import GPUS
from ..models.megatron import is_megatron_core
from ..recompute import schedule as schedules


def add_program_args(p: argparse.ArgumentParser) -> None:
    """Add ``--program`` and ``--reentrant``."""
    g = p.add_argument_group("the user's eager program")
    g.add_argument("--program", choices=("rewrite", "eager"), default="rewrite",
                   help="eager: also predict and measure the model as written, each recomputed layer or group "
                        "under torch.utils.checkpoint (a transformers model: its gradient_checkpointing_enable), "
                        "next to the rewrite (default: %(default)s)")
    g.add_argument("--reentrant", action="store_true",
                   help="with --program eager: torch.utils.checkpoint(use_reentrant=True)")


def check_program_args(args: argparse.Namespace) -> None:
    """Refuse ``--program eager`` where it cannot run yet, before tracing.

    Raises:
        ValueError: with a per-rank or op-level sweep, or --reentrant without
            --program eager.
    """
    if getattr(args, "program", "rewrite") != "eager":
        if getattr(args, "reentrant", False):
            raise ValueError("--reentrant goes with --program eager")
        return
    for flag, given in (("--tp/--pp/--fsdp", _parallel(args)),
                        ("--selective/--recompute-modules/--policy",
                         args.selective or args.recompute_modules or args.policy)):
        if given:
            raise ValueError(f"--program eager does not go with {flag} yet: the eager program is recorded for "
                             "one device, whole-layer settings")


def _parallel(args: argparse.Namespace) -> bool:
    return any((getattr(args, a, None) or 1) > 1 for a in ("tp", "pp", "fsdp"))


def print_eager_table(args: argparse.Namespace, w: Workload, todo: Sequence[schedules.Schedule],
                      results: Sequence[ScheduleResult]) -> tuple[bool, list[dict]]:
    """The eager program's rows under the sweep's table. Returns ``(exact, rows)``: exact is
    False when an eager row's prediction differs from its measurement; rows are the
    JSON rows (``sweep_schema.json`` ``eager_program``: schedule, predicted and measured
    peak bytes of the eager program, the rewrite's predicted peak bytes, notes, the
    difference by op, and what the rewrite's in-place reuse saves in bytes: its
    predicted peak without ``recompute/reinplace`` minus with it)."""
    step = w.step
    if len(step.stack.stacks) > 1:
        print(f"--program eager: {len(step.stack.stacks)} layer stacks; the eager program is recorded for one "
              "stack (name it with --stack)", file=sys.stderr)
        return True, []
    if w.reuse is not None:
        print(f"--program eager: the step was analysed from a {step.stack.num_layers}-layer template of the "
              f"{w.num_layers} layers (layer reuse); the eager program is recorded whole: add --trace-all-layers",
              file=sys.stderr)
        return True, []
    rows, exact, doc = [], True, []
    own_loop = is_megatron_core(step.model)  # Megatron-Core runs every setting itself
    gpu = GPUS[w.options.gpu] if w.options.target == "cuda" else None
    refused: list[str] = []
    causes: list[tuple[str, list[tuple[str, int]]]] = []  # per setting: (op, rewrite - eager bytes at the peaks)
    kinds: list[tuple[str, list[tuple[str, int]]]] = []  # per setting: (cause, rewrite - eager bytes at the peaks)
    notes: dict[str, list[str]] = {}  # each eager row's note -> its count per setting said of ("": none)
    for sched, r in zip(todo, results):
        try:
            e = eager_program(step.model, step.example_inputs, step.loss_fn, sched, layers=step.stack.path,
                              use_reentrant=args.reentrant, gpu=gpu)
        except RematError as err:
            if not any(len(g) > 1 for g in sched.groups):
                print(f"--program eager: {sched.provenance}: {err}", file=sys.stderr)
                return False, doc
            refused.append(f"{sched.provenance}: {err}")
            continue
        exact = exact and e.measured_peak_bytes in (None, e.predicted.peak_bytes)
        for n in e.predicted.notes:  # a count that differs per setting ("34 ops have ...") kept apart
            count, _, rest = n.partition(" ")
            notes.setdefault(rest if count.isdigit() else n, []).append(count if count.isdigit() else "")
        diff = r.predicted_peak_bytes - e.predicted.peak_bytes
        prepared = w.session.prepare(sched, w.allocator)[:2]
        by_op = peak_difference_by_op(e.predicted, rewrite_live_by_op(*prepared))
        by_cause = peak_difference_by_cause(e.predicted, rewrite_live_by_cause(*prepared))
        causes.append((sched.provenance, by_op))
        kinds.append((sched.provenance, by_cause))
        reuse = w.session.prepare(sched, w.allocator, in_place=False)[1].peak_bytes - r.predicted_peak_bytes
        measured = "not run" if e.measured_peak_bytes is None else mib(e.measured_peak_bytes)
        doc.append({"schedule": sched.provenance, "predicted_peak_bytes": e.predicted.peak_bytes,
                    "measured_peak_bytes": e.measured_peak_bytes, "rewrite_predicted_peak_bytes": r.predicted_peak_bytes,
                    "peak_op": e.predicted.peak_op, "notes": list(e.predicted.notes),
                    "difference_by_op": dict(by_op), "difference_by_cause": dict(by_cause),
                    "in_place_reuse_bytes": reuse})
        rows.append([sched.provenance, mib(e.predicted.peak_bytes), measured,
                     mib(r.predicted_peak_bytes), f"{mib(diff)} ({100 * diff / e.predicted.peak_bytes:+.1f} %)",
                     mib(reuse)])
    how = ("Megatron-Core's own recompute (TransformerConfig recompute_method)" if own_loop else
           "torch.utils.checkpoint per recomputed layer or group of layers"
           + (", reentrant" if args.reentrant else ""))
    print(f"\nthe eager program (the model as written, {how}) against the rewrite:")
    print(text_table(["setting", "eager predicted MiB", "eager measured MiB", "rewrite predicted MiB",
                      "rewrite - eager MiB", "in-place reuse saves MiB"], rows))
    print_difference_by_op(causes)
    print_difference_by_cause(kinds)
    print("note (in-place reuse saves): the rewrite's predicted peak without its in-place ops (the functional "
          "trace, every op a new storage) minus with them (recompute/reinplace)")
    for note, counts in notes.items():
        which = "every setting" if len(counts) == len(rows) else f"{len(counts)} of {len(rows)} settings"
        numbers = sorted({int(c) for c in counts if c})
        span = "" if not numbers else (f"{numbers[0]} " if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]} ")
        print(f"note (eager program, {which}): {span}{note}")
    if refused:
        print(f"not run eagerly ({len(refused)} settings): {refused[0]}" + (" (and the same for "
              + ", ".join(x.partition(':')[0] for x in refused[1:]) + ")" if refused[1:] else ""))
    return exact, doc


def _signed(d: int) -> str:
    return ("+" if d > 0 else "-") + fmt_bytes(abs(d)) if d else "0"


def print_difference_by_cause(kinds: Sequence[tuple[str, list[tuple[str, int]]]]) -> None:
    """Per setting, ``eager_program.peak_difference_by_cause``: the rewrite's peak minus
    the eager program's by why the bytes are live at each (``liveness.eager_program.
    peak_cause``)."""
    if not any(by_cause for _, by_cause in kinds):
        return
    print("rewrite - eager at each program's peak, by cause (held outputs: kept past their last read; "
          "in-place reuse: the peak op's dying input of its output's size; copies; dropout masks: "
          "the saved bool mask, or the CPU's noise tensor; the terms sum to the column above):")
    for setting, by_cause in kinds:
        if by_cause:
            print(f"  {setting}: " + ", ".join(f"{c} {_signed(d)}" for c, d in by_cause))


def print_difference_by_op(causes: Sequence[tuple[str, list[tuple[str, int]]]], top: int = 4) -> None:
    """Per setting, the largest terms of ``eager_program.peak_difference_by_op``: where
    the rewrite's peak and the eager program's differ, by the op that allocated the
    bytes live at each."""
    if not causes:
        return
    print("rewrite - eager at each program's peak, by the op that allocated the bytes live there "
          f"(largest {top}; the terms sum to the column above):")
    for setting, by_op in causes:
        shown = ", ".join(f"{op} {_signed(d)}" for op, d in by_op[:top]) or "the same bytes"
        rest = sum(d for _, d in by_op[top:])
        print(f"  {setting}: {shown}" + (f", {len(by_op) - top} more {_signed(rest)}" if by_op[top:] else ""))
