"""The ``sweep`` command on one device: every Megatron recompute setting (none,
uniform K=1..L, block N=0..L), or an op-level policy alone and with block N, predicted
vs measured peak and gradients checked; the op-level policy options (``--selective``,
``--recompute-modules``, ``--policy``, ``--module-kind``) and the Partition they ask for.

With ``--tp`` / ``--pp`` / ``--fsdp`` it hands over to ``cli_parallel.sweep_parallel``.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..recompute import schedule as schedules
from .parallel import parallel_config, sweep_parallel
from .common import EXIT_FAILED, EXIT_OK, calibration_note, load, model_name, stacks_meta, static_line
from .common import whole_session
from ..errors import InvalidSchedule
from ..formatting import fmt_bytes, mib, text_table
from ..recompute.partition import Partition
from ..recompute.policies import KINDS, POLICIES, recompute_modules, save_policy
from ..models.megatron import megatron_note
from ..report.documents import write_document
from ..report.schedule_report import sweep_columns, sweep_rows, sweep_unit
from ..report.sweep_summary import sweep_summary
from ..evaluate.schedule_result import ScheduleResult
from ..evaluate.session import Session
from .eager import add_program_args, check_program_args, print_eager_table
from ..evaluate.workload import Workload, fits

def _progress(i: int, n: int, r: ScheduleResult) -> None:
    """One line on stderr for the i-th of n schedules swept."""
    if r.predicted_only:
        text = f"predicted {mib(r.predicted_peak_bytes)} MiB (predicted only)  ({r.pass_time_s:.2f}s)"
    elif r.grads_match:
        text = (f"predicted {mib(r.predicted_peak_bytes)} MiB  measured {mib(r.measured_peak_bytes)} MiB  "
                f"grads {r.grads_text()}  ({r.measure_time_s:.1f}s)")
    else:
        text = f"grads {r.grads_text()}: no peak reported"
    print(f"[{i:2d}/{n}] {r.provenance:14s} {text}", file=sys.stderr, flush=True)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """Add the op-level policy options (selective recompute, recompute modules, save policies)."""
    g = p.add_argument_group("op-level policy")
    g.add_argument("--selective", action="store_true",
                   help="Megatron-LM --recompute-granularity selective: recompute core attention")
    g.add_argument("--recompute-modules", metavar="KINDS",
                   help="Megatron-Core --recompute-modules, comma-separated: core_attn, mlp, layernorm, moe_act, "
                        "moe, shared_experts")
    g.add_argument("--policy", metavar="NAME",
                   help="a JAX save policy: dots_saveable, dots_with_no_batch_dims_saveable, nothing_saveable, "
                        "everything_saveable, save_only_these_names, save_anything_except_these_names")
    g.add_argument("--policy-names", metavar="NAMES",
                   help="comma-separated node names or module paths inside a layer, for the *_names policies")
    g.add_argument("--module-kind", action="append", metavar="KIND=PATH", default=[],
                   help="name the modules of a kind (paths inside a layer, fnmatch patterns); repeatable")
    add_program_args(p)


def _split(text: str | None) -> list[str]:
    """The items of a comma-separated option."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def op_partition(args: argparse.Namespace, session: Session,
                 schedule: schedules.Schedule | None = None) -> Partition | None:
    """The op-level Partition the policy options ask for (None when none is given).

    Raises:
        ValueError: more than one policy option, or a --module-kind without ``=``.
        InvalidSchedule: an unknown kind or policy, or a kind the model does not have.
    """
    chosen = [o for o in ("selective", "recompute_modules", "policy") if getattr(args, o, None)]
    if len(chosen) > 1:
        raise ValueError("give one of --selective, --recompute-modules, --policy")
    names: dict[str, list[str]] = {}
    for item in getattr(args, "module_kind", []) or []:
        kind, sep, path = item.partition("=")
        if not sep or not kind or not path:
            raise ValueError(f"--module-kind {item!r}: expected KIND=PATH, e.g. mlp=ffn")
        names.setdefault(kind, []).append(path)
    if not chosen:
        if getattr(args, "policy_names", None):
            raise ValueError("--policy-names goes with --policy save_only_these_names or "
                             "save_anything_except_these_names")
        return None
    if args.selective or args.recompute_modules:
        kinds = ["core_attn"] if args.selective else _split(args.recompute_modules)
        return recompute_modules(session.joint, session.stack, kinds, names, schedule)
    return save_policy(session.joint, session.stack, args.policy, _split(args.policy_names), schedule)


def check_policy_names(args: argparse.Namespace) -> None:
    """Refuse unknown module kinds and policies before tracing (the names alone).

    Raises:
        ValueError: more than one of --selective, --recompute-modules, --policy.
        InvalidSchedule: a kind outside ``policies.KINDS`` or a policy outside
            ``policies.POLICIES`` (the message lists them).
    """
    if sum(bool(getattr(args, o, None)) for o in ("selective", "recompute_modules", "policy")) > 1:
        raise ValueError("give one of --selective, --recompute-modules, --policy")
    kinds = _split(args.recompute_modules) + [k.partition("=")[0] for k in args.module_kind]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise InvalidSchedule(f"module kind(s) {bad} are not recompute modules; the kinds are {', '.join(KINDS)}")
    if args.policy and args.policy not in POLICIES:
        raise InvalidSchedule(f"save policy {args.policy!r} does not exist; the policies are {', '.join(POLICIES)}")


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run (or predict) every Megatron setting, or an op-level policy alone and with
    block N; print the table, write --json."""
    config = parallel_config(args)
    if config is not None:
        return EXIT_OK if sweep_parallel(args, config) else EXIT_FAILED
    check_policy_names(args)
    check_program_args(args)
    w = load(args)
    t0 = time.perf_counter()
    per_stack = w.layers_per_stack
    todo: list = list(schedules.megatron_schedules(per_stack))
    if args.selective or args.recompute_modules or args.policy:
        session = whole_session(w, "an op-level policy")
        # the policy alone, then with block(N) (uniform leaves no stored layer)
        todo = [schedules.none(per_stack), op_partition(args, session)] + [
            op_partition(args, session, schedules.block(n, per_stack)) for n in range(1, min(per_stack))]
    none_peak = w.report(todo[0]).peak_bytes if w.predicted_only else None
    results = []
    try:
        for i, sched in enumerate(todo, 1):
            results.append(w.result(sched, none_peak))
            _progress(i, len(todo), results[-1])
    except KeyboardInterrupt:
        if args.json and results:  # the rows already finished are kept, marked partial
            _write_sweep_json(args, w, results, partial=True)
            print(f"interrupted after {len(results)} of {len(todo)} schedules: wrote them to {args.json} "
                  "(\"partial\": true)", file=sys.stderr)
        raise
    calibration_note(w)
    unit = sweep_unit(results)
    print(text_table(sweep_columns(unit), sweep_rows(results, unit)))
    for line in sweep_summary(results, w.static, w.device_memory_bytes):
        print(line)
    eager_exact, eager_rows = (print_eager_table(args, w, todo, results)
                               if getattr(args, "program", "rewrite") == "eager" else (True, []))
    crashes = megatron_note(w.step.model, todo)
    if crashes:
        print(crashes)
    noisy = [r for r in results if r.grads_within_run_to_run]
    if noisy:
        print(f"note: the un-rewritten step's backward is not bitwise reproducible (its gradients differ by up "
              f"to {max(r.run_to_run_grad_diff for r in noisy):.2g} between two runs with the same seed, e.g. a "
              "parallel reduction on several threads); the gradients of "
              f"{', '.join(r.provenance for r in noisy)} were compared against that difference instead of bit "
              "for bit (\"within\" in the table). One thread (torch.set_num_threads(1)) may make it reproducible.")
    print(static_line(w), file=sys.stderr)
    if w.device_memory_bytes is not None:
        fitting = [r.provenance for r in results if fits(r, w.static, w.device_memory_bytes)]
        print(f"fit the device ({fmt_bytes(w.device_memory_bytes)} with static memory): {len(fitting)} of "
              f"{len(results)} schedules" + (f": {', '.join(fitting)}" if 0 < len(fitting) <= 8 else ""),
              file=sys.stderr)
    print(f"{len(results)} schedules in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.json:
        _write_sweep_json(args, w, results, eager_rows=eager_rows)
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK if eager_exact and all(r.predicted_only or r.grads_match for r in results) else EXIT_FAILED


def _write_sweep_json(args: argparse.Namespace, w: Workload, results: list[ScheduleResult],
                      partial: bool = False, eager_rows: list[dict] | None = None) -> None:
    """The sweep's JSON: the model, target, stacks, static memory and one row per schedule;
    ``partial``: the sweep was interrupted and ``rows`` holds the schedules finished;
    ``eager_rows``: the eager program's rows (``--program eager``)."""
    rows = [dict(r.to_dict(), fits_device=fits(r, w.static, w.device_memory_bytes)) for r in results]
    formula = getattr(args, "megatron_formula", None)  # remat-pass megatron: Megatron-LM's own estimate
    if formula is not None:
        rows = [dict(r, megatron_formula_bytes=formula.total_bytes) for r in rows]
    write_document(args.json, "remat-pass-sweep", {
        "model": model_name(args),
        "description": w.description,
        "target": args.target,
        "allocator": w.allocator,
        "predicted_only": w.predicted_only,
        "layer_stack": w.stack_path,
        "num_layers": w.num_layers,
        **stacks_meta(w),
        "static_bytes": w.static.total_bytes,
        "static": w.static.to_dict(),
        "device_memory_bytes": w.device_memory_bytes,
        **({"notes": list(w.session.joint.notes)} if w.session is not None and w.session.joint.notes else {}),
        **({"partial": True} if partial else {}),
        "rows": rows,
        **({"eager_program": eager_rows} if eager_rows else {}),
        **({"megatron_formula": formula.to_dict()} if formula is not None else {}),
    })
