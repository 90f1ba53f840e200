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
activation budget (``workload.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from . import schedule as schedules
from .calibration import CACHE_ENV
from .errors import InfeasibleBudget, InvalidSchedule, RematError
from .formatting import fmt_bytes, mib, parse_bytes, text_table
from .gate import gate
from .inspection import describe_step, dump_step, load_dump, render
from .configs import (
    DTYPES,
    TASKS,
    ModelSpec,
    build_factory,
    build_from_config,
    check_spec,
    default_task,
    load_config,
)
from .cuda_target import GPUS
from .measure import measured_step_timeline
from .op_planner import CostModel, OpPlanner
from .partition import Partition
from .planner import max_batch_rows
from .policies import KINDS, POLICIES, recompute_modules, save_policy
from .static_memory import OPTIMIZERS
from .cli_parallel import add_parallel_args, parallel_config, plan_parallel, sweep_parallel
from .plot import plot_timeline
from .regions import LayerStack
from .plan_report import op_plan_json, op_plan_text, plan_json, plan_text, symbolic_model_text
from .report import (
    SWEEP_COLUMNS,
    read_reports,
    report_json,
    report_markdown,
    reports_document,
    summary_markdown,
    sweep_rows,
    write_json,
    write_report,
)
from .schedule_result import ScheduleResult
from .sweep import Session
from .symbolic import default_symbols, trace_symbolic
from .workload import DEFAULT_MODEL, TARGETS, Workload, WorkloadOptions, fits, load_workload
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be 1 or more")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add the options that choose the model and its input."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help=f"factory returning (model, example_inputs, loss_fn) (default: {DEFAULT_MODEL}; "
                        "with --tp / --pp / --fsdp: remat_pass.models:tiny_llama)")
    g.add_argument("--batch", type=positive_int, help="batch size passed to the factory")
    g.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    g.add_argument("--layers", type=positive_int, help="number of layers passed to the factory")
    g.add_argument("--stack", metavar="PATH", action="append",
                   help="module path of a layer stack (e.g. transformer.h); repeat it for several "
                        "(--stack encoder.block --stack decoder.block); every stack is found automatically "
                        "if omitted")
    g.add_argument("--seed", type=int, default=0, help="RNG seed for every run (default: 0)")
    g.add_argument("--config", metavar="PATH", help="a transformers config JSON (model_type and fields, as a model "
                   "repository's config.json) instead of --model")
    g.add_argument("--task", choices=TASKS, help="with --config: the model class (default: the config's "
                   "architectures, else the first the model type has)")
    g.add_argument("--meta", action="store_true", help="build without weights (meta device): every figure is "
                   "predicted, nothing is run; automatic when a --config model would not fit in memory")
    g.add_argument("--dtype", choices=tuple(DTYPES), help="parameter and activation dtype (default: as built; "
                   "float32 for --config)")
    g.add_argument("--autocast", choices=("bfloat16", "float16"),
                   help="mixed precision: fp32 parameters, the forward under torch.autocast in this dtype")
    g.add_argument("--trace-all-layers", action="store_true",
                   help="trace every layer of a large --meta model instead of analysing it from a few")
    t = p.add_argument_group("target and static memory")
    t.add_argument("--target", choices=TARGETS, default="cpu",
                   help="device to predict for: cpu (measurable here) or cuda (kernels and allocator modelled; "
                   "predicted only on a machine without a GPU) (default: %(default)s)")
    t.add_argument("--gpu", choices=tuple(GPUS), default="h100", help="the GPU of --target cuda (default: %(default)s)")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                   help="optimizer states counted as static memory (default: %(default)s)")
    t.add_argument("--master-weights", action="store_true",
                   help="an fp32 master copy of non-fp32 parameters (the optimizer states are then fp32)")
    t.add_argument("--device-memory", metavar="SIZE",
                   help="the device's memory (e.g. 80GiB): the activation budget is what static memory leaves")
    c = p.add_argument_group("op scratch")
    c.add_argument("--no-calibrate", action="store_true",
                   help="do not run ops to calibrate their scratch memory; use the ATen formula table only")
    c.add_argument("--calibration-cache", metavar="DIR",
                   help=f"folder of the calibration cache (default: ${CACHE_ENV} or ~/.cache/remat-pass)")


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    """The WorkloadOptions of the model arguments.

    Raises:
        ValueError: --model and --config both given.
    """
    if args.config and args.model:
        raise ValueError("give --model or --config, not both")
    return WorkloadOptions(
        model=args.model or DEFAULT_MODEL, config=args.config, task=args.task, meta=args.meta, dtype=args.dtype,
        autocast=args.autocast, batch=args.batch, seq=args.seq, layers=args.layers,
        stack=tuple(args.stack) if args.stack else None, calibrate=not args.no_calibrate,
        calibration_cache=args.calibration_cache,
        seed=args.seed, target=args.target, gpu=args.gpu, optimizer=args.optimizer,
        master_weights=args.master_weights, device_memory=args.device_memory,
        trace_all_layers=args.trace_all_layers, allocator=getattr(args, "allocator", None))


def _model_name(args: argparse.Namespace) -> str:
    """The config file or factory the model arguments name."""
    return args.config or args.model or DEFAULT_MODEL


def load(args: argparse.Namespace) -> Workload:
    """Build and trace the step of the model arguments (prints what it does to stderr)."""
    return load_workload(workload_options(args))


def _static_line(w: Workload) -> str:
    s = w.static
    parts = [f"parameters {fmt_bytes(s.parameter_bytes)}", f"optimizer ({s.optimizer}) {fmt_bytes(s.optimizer_state_bytes)}"]
    if s.master_weight_bytes:
        parts.append(f"master weights {fmt_bytes(s.master_weight_bytes)}")
    if s.workspace_bytes:
        parts.append(f"workspaces {fmt_bytes(s.workspace_bytes)}")
    parts.append(f"batch, buffers and the rest {fmt_bytes(s.batch_bytes + s.buffer_bytes + s.other_bytes)}")
    line = f"static memory {fmt_bytes(s.total_bytes)}: " + ", ".join(parts)
    line += f"; gradients {fmt_bytes(s.gradient_bytes)} are inside each peak"
    if w.device_memory_bytes is not None:
        line += f"; device {fmt_bytes(w.device_memory_bytes)} leaves {fmt_bytes(w.device_memory_bytes - s.total_bytes)}"
    return line


def _progress(i: int, n: int, r: ScheduleResult) -> None:
    if r.predicted_only:
        text = f"predicted {mib(r.predicted_peak_bytes)} MiB (predicted only)  ({r.pass_time_s:.2f}s)"
    elif r.grads_match:
        text = (f"predicted {mib(r.predicted_peak_bytes)} MiB  measured {mib(r.measured_peak_bytes)} MiB  "
                f"grads {r.grads_text()}  ({r.measure_time_s:.1f}s)")
    else:
        text = f"grads {r.grads_text()}: no peak reported"
    print(f"[{i:2d}/{n}] {r.provenance:14s} {text}", file=sys.stderr, flush=True)


def calibration_note(w: Workload) -> None:
    """Say on stderr how many op signatures were calibrated now, in how long, where the
    figures are kept."""
    cal = w.session.calibrator if w.session is not None else None
    if cal is not None and cal.calibrated_signatures:
        print(f"calibrated the scratch memory of {cal.calibrated_signatures} op signatures in "
              f"{cal.calibrate_s:.1f}s (cached in {cal.path})", file=sys.stderr)


def _stacks_text(stack: LayerStack) -> str:
    """``layer stack 'transformer.h' with L=12`` or, for several, each stack's layers."""
    if len(stack.stacks) == 1:
        return f"layer stack {stack.path!r} with L={stack.num_layers}"
    return f"{len(stack.stacks)} layer stacks, L={stack.num_layers} in all: {stack.describe()}"


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


def _split(text: str | None) -> list[str]:
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


def _whole_session(w: Workload, what: str) -> Session:
    """The session of a step traced whole (op-level choices name its nodes).

    Raises:
        ValueError: the stack was analysed from a template (``layer_reuse``).
    """
    if w.session is None:
        raise ValueError(f"{what} chooses nodes in every layer: add --trace-all-layers")
    return w.session


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run (or predict) every Megatron setting, or an op-level policy alone and with
    block N; print the table, write --json."""
    config = parallel_config(args)
    if config is not None:
        return EXIT_OK if sweep_parallel(args, config) else EXIT_FAILED
    check_policy_names(args)
    w = load(args)
    t0 = time.perf_counter()
    per_stack = w.layers_per_stack
    todo: list = list(schedules.megatron_schedules(per_stack))
    if args.selective or args.recompute_modules or args.policy:
        session = _whole_session(w, "an op-level policy")
        # the policy alone, then with block(N) (uniform leaves no stored layer)
        todo = [schedules.none(per_stack), op_partition(args, session)] + [
            op_partition(args, session, schedules.block(n, per_stack)) for n in range(1, min(per_stack))]
    none_peak = w.report(todo[0]).peak_bytes if w.predicted_only else None
    results = []
    for i, sched in enumerate(todo, 1):
        results.append(w.result(sched, none_peak))
        _progress(i, len(todo), results[-1])
    calibration_note(w)
    print(text_table(SWEEP_COLUMNS, sweep_rows(results)))
    noisy = [r for r in results if r.grads_within_run_to_run]
    if noisy:
        print(f"note: the un-rewritten step's backward is not bitwise reproducible (its gradients differ by up "
              f"to {max(r.run_to_run_grad_diff for r in noisy):.2g} between two runs with the same seed, e.g. a "
              "parallel reduction on several threads); the gradients of "
              f"{', '.join(r.provenance for r in noisy)} were compared against that difference instead of bit "
              "for bit (\"within\" in the table). One thread (torch.set_num_threads(1)) may make it reproducible.")
    print(_static_line(w), file=sys.stderr)
    print(f"{len(results)} schedules in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.json:
        rows = [dict(r.to_dict(), fits_device=fits(r, w.static, w.device_memory_bytes)) for r in results]
        write_json(args.json, {
            "model": _model_name(args),
            "description": w.description,
            "target": args.target,
            "allocator": w.allocator,
            "predicted_only": w.predicted_only,
            "layer_stack": w.stack_path,
            "num_layers": w.num_layers,
            **_stacks_meta(w),
            "static_bytes": w.static.total_bytes,
            "static": w.static.to_dict(),
            "device_memory_bytes": w.device_memory_bytes,
            "rows": rows,
        })
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK if all(r.predicted_only or r.grads_match for r in results) else EXIT_FAILED


class _DeprecatedAlias(argparse.Action):
    """An old option name that still works for one release, with a note on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        print(f"remat-pass: {option_string} is deprecated (it is K or N, not the number of layers L); "
              "use --recompute-num-layers", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_schedule_args(p: argparse.ArgumentParser, allow_all: bool = True) -> None:
    """Add ``--schedule none|uniform|block``, ``--recompute-num-layers K`` (old name
    ``--num-layers``, deprecated) and ``--all-schedules``."""
    g = p.add_argument_group("schedule")
    g.add_argument("--schedule", choices=("none", "uniform", "block"), default="none",
                   help="recompute method (Megatron-LM --recompute-method; default: %(default)s)")
    g.add_argument("--recompute-num-layers", type=int, metavar="K", dest="recompute_num_layers",
                   help="K for uniform, N for block (Megatron-LM --recompute-num-layers)")
    g.add_argument("--num-layers", type=int, metavar="K", dest="recompute_num_layers", action=_DeprecatedAlias,
                   help=argparse.SUPPRESS)
    if allow_all:
        g.add_argument("--all-schedules", action="store_true",
                       help="every Megatron setting: none, uniform K=1..L, block N=0..L")
    g.add_argument("--allocator", choices=("cpu", "cuda"),
                   help="allocator model for the predicted bytes (default: the --target's)")


def _schedules(args: argparse.Namespace, w: Workload) -> list[schedules.Schedule]:
    per_stack = w.layers_per_stack
    if getattr(args, "all_schedules", False):
        return schedules.megatron_schedules(per_stack)
    if args.schedule != "none" and args.recompute_num_layers is None:
        raise ValueError(f"--schedule {args.schedule} needs --recompute-num-layers K (the layer stack has "
                         f"L={w.num_layers})" if len(per_stack) == 1 else
                         f"--schedule {args.schedule} needs --recompute-num-layers K (applied to each of the "
                         f"layer stacks {w.session.stack.describe()})")
    return [schedules.make(args.schedule, args.recompute_num_layers, per_stack)]


def _stacks_meta(w: Workload) -> dict:
    """``{"layer_stacks": [...]}`` naming each stack and its layers when there are several."""
    if w.session is None or len(w.session.stack.stacks) == 1:
        return {}
    return {"layer_stacks": [{"path": s.path, "first_layer": s.first_layer, "num_layers": s.num_layers}
                             for s in w.session.stack.stacks]}


def _meta(args: argparse.Namespace, w: Workload) -> dict:
    meta = {"model": _model_name(args), "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "layer_stack": w.stack_path, "num_layers": w.num_layers, **_stacks_meta(w),
            "target": args.target if args.target != "cpu" else None, "predicted_only": w.predicted_only or None,
            "static_bytes": w.static.total_bytes if (args.optimizer != "none" or args.target != "cpu") else None}
    return {k: v for k, v in meta.items() if v is not None}


def _predict(w: Workload, sched: schedules.Schedule):  # noqa: ANN202
    """``(step, report)``; the step is None when the stack is analysed from a template."""
    if w.session is None:
        return None, w.report(sched)
    step, report, _ = w.session.prepare(sched, w.allocator)
    return step, report


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the rewritten graphs, saved activations and recompute segments."""
    sections = args.section or ["summary", "forward", "backward", "saved", "segments"]
    if args.graph:
        desc = load_dump(args.graph)
    else:
        w = load(args)
        if w.session is None:
            raise ValueError("inspect prints every node of the rewritten graphs: add --trace-all-layers")
        (sched,) = _schedules(args, w)
        step, report = _predict(w, sched)
        desc = describe_step(step, report, _meta(args, w))
        if args.dump:
            path = dump_step(step, report, args.dump, sched.provenance, _meta(args, w))
            print(f"wrote {path}", file=sys.stderr)
    sys.stdout.write(render(desc, sections, args.only_layer))
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown (stdout or --markdown), JSON (--json) and PNG (--png) liveness reports."""
    if args.measure and (args.meta or args.target != "cpu"):
        raise ValueError("--measure runs the step on this CPU: it needs weights (no --meta) and --target cpu")
    w = load(args)
    todo = _schedules(args, w)
    if args.png and len(todo) != 1:
        raise ValueError("--png draws one schedule: drop --all-schedules or --png")
    if (args.png or args.timeline) and w.session is None:
        raise ValueError("--png and --timeline need every step: add --trace-all-layers")
    docs, parts = [], []
    for sched in todo:
        step, report = _predict(w, sched)
        docs.append(report_json(report, step, timeline=args.timeline))
        text = report_markdown(report, step)
        measured = None
        if args.measure:
            measured = measured_step_timeline(step, w.session.joint, seed=args.seed)
            diffs = [m - p.live_bytes for p, m in zip(report.timeline, measured) if m != p.live_bytes]
            text += (f"\nMeasured (CPU profiler, per step): peak {mib(max(measured))} MiB; "
                     f"predicted {mib(report.peak_bytes)} MiB; {len(diffs)} of {len(measured)} steps differ"
                     + (f", measured minus predicted from {fmt_bytes(min(diffs))} to {fmt_bytes(max(diffs))}"
                        " (op scratch the memory model got wrong: see the op scratch line)" if diffs else "")
                     + ".\n")
        parts.append(text)
        if args.png:
            plot_timeline(report, args.png, measured, step=step)
            print(f"wrote {args.png}", file=sys.stderr)
    if len(todo) == 1:
        markdown = parts[0]
    else:
        markdown = (f"### remat-pass: predicted peaks of {_model_name(args)}\n\n" + summary_markdown(docs)
                    + "\n\n" + "\n".join(f"<details><summary>{d['schedule']['provenance']}</summary>\n\n{t}\n"
                                           "</details>\n" for d, t in zip(docs, parts)))
    if args.optimizer != "none" or args.target != "cpu" or args.device_memory:
        markdown += f"\n{_static_line(w)}\n"
    calibration_note(w)
    if args.markdown:
        _write(args.markdown, markdown)
    else:
        sys.stdout.write(markdown)
    if args.json:
        if len(docs) == 1 and not args.all_schedules:
            doc = {**docs[0], "meta": _meta(args, w)}
        else:
            doc = reports_document(docs, _meta(args, w))
        write_report(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    """CI gate: exit 1 when a predicted peak exceeds --budget or regresses past --baseline."""
    if args.budget is None and args.baseline is None:
        raise ValueError("nothing to check: give --budget SIZE and/or --baseline PATH")
    w = None
    if args.report:
        docs = read_reports(args.report)
    else:
        w = load(args)
        docs = []
        for sched in _schedules(args, w):
            step, report = _predict(w, sched)
            docs.append(report_json(report, step))
        calibration_note(w)
        if args.json:
            write_report(args.json, reports_document(docs, _meta(args, w)))
            print(f"wrote {args.json}", file=sys.stderr)
    result = gate(docs, budget=args.budget, baseline=args.baseline, max_regression=args.max_regression)
    print(result.text())
    if w is not None and any(f.check == "budget" and not f.ok for f in result.findings):
        print(_fitting_schedules(w, parse_bytes(args.budget), docs))
    if args.markdown:
        verdict = "passed" if result.ok else "FAILED"
        _write(args.markdown, f"### remat-pass check {verdict}\n\n{summary_markdown(docs)}\n\n"
                              f"```\n{result.text()}\n```\n")
    return result.exit_code


def _fitting_schedules(w: Workload, budget_bytes: int, docs: list) -> str:
    """The Megatron settings whose predicted peak fits the budget, least recompute first
    (what a failing ``check --budget`` suggests)."""
    done = {d["schedule"]["provenance"]: d for d in docs}
    rows = []
    for sched in schedules.megatron_schedules(w.layers_per_stack):
        d = done.get(sched.provenance)
        if d is None:
            step, report = _predict(w, sched)
            d = report_json(report, step)
        if d["peak_bytes"] <= budget_bytes:
            rows.append((d["recompute_flops"], d["peak_bytes"], sched.provenance))
    if not rows:
        return (f"no Megatron setting (none, uniform K, block N) fits {fmt_bytes(budget_bytes)}; "
                "`remat-pass plan --budget` finds the least peak an optimized schedule reaches")
    rows.sort()
    return (f"schedules whose predicted peak fits {fmt_bytes(budget_bytes)}, least recompute first: "
            + ", ".join(f"{name} ({mib(peak)} MiB)" for _, peak, name in rows))


def _model_for_symbols(args: argparse.Namespace):  # noqa: ANN202
    """``(model, inputs, loss_fn)`` for the symbolic model (a factory or a config)."""
    if args.target != "cpu" or args.autocast:
        raise ValueError("model (symbolic shapes) traces for --target cpu without --autocast")
    if args.config:
        config = load_config(args.config)
        spec = ModelSpec(task=args.task or default_task(config), dtype=args.dtype or "float32", meta=args.meta,
                         batch=args.batch or 2, seq=args.seq or 128, seed=args.seed, layers=args.layers)
        check_spec(config, spec)
        return build_from_config(config, spec)
    return build_factory(args.model or DEFAULT_MODEL, meta=args.meta, dtype=args.dtype, batch=args.batch, seq=args.seq,
                         layers=args.layers)


def cmd_model(args: argparse.Namespace) -> int:
    """Trace with symbolic batch / seq and print the formulas (text and LaTeX)."""
    model, inputs, loss_fn = _model_for_symbols(args)
    t0 = time.perf_counter()
    sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs), layers=args.stack)
    print(f"traced {type(model).__name__} with symbolic shapes ({time.perf_counter() - t0:.1f}s); "
          f"{_stacks_text(sm.stack)}", file=sys.stderr, flush=True)
    _profile_with_progress(sm)
    print(symbolic_model_text(sm))
    return EXIT_OK


def _profile_with_progress(sm) -> None:  # noqa: ANN001 - a SymbolicModel
    """Profile every schedule ``symbolic_model_text`` reads (cached by the model), one
    line on stderr each, so a long model shows where it is."""
    per_stack = sm.stack.layers_per_stack
    todo = list(dict.fromkeys([*schedules.megatron_schedules(per_stack),
                               schedules.uniform(max(per_stack), per_stack)]))
    t0 = time.perf_counter()
    for i, sched in enumerate(todo, 1):
        sm.profile(sched)
        print(f"[{i:2d}/{len(todo)}] symbolic liveness of {sched.provenance} ({time.perf_counter() - t0:.1f}s)",
              file=sys.stderr, flush=True)


def _budget(args: argparse.Namespace, w: Workload | None) -> int:
    """The activation budget: --budget, what --device-memory leaves, or the smaller."""
    budgets = [parse_bytes(args.budget)] if args.budget else []
    if w is not None and w.device_memory_bytes is not None:
        left = w.activation_budget()
        print(f"{_static_line(w)}", file=sys.stderr)
        budgets.append(left)
    if not budgets:
        raise ValueError("plan needs --budget SIZE (activation bytes) or --device-memory SIZE")
    return min(budgets)


def cmd_plan(args: argparse.Namespace) -> int:
    """The optimized schedule under --budget / --device-memory (or the largest batch per
    schedule); per rank and pipeline stage with --tp / --pp / --fsdp."""
    config = parallel_config(args)
    if config is not None:
        plan_parallel(args, config)
        return EXIT_OK
    if args.max_batch:
        budget = _budget(args, None)
        model, inputs, loss_fn = _model_for_symbols(args)
        sm = trace_symbolic(model, inputs, loss_fn, default_symbols(inputs), layers=args.stack)
        rows = max_batch_rows(sm, budget)
        print(f"largest batch within {budget} bytes ({fmt_bytes(budget)}), "
              f"{', '.join(f'{k}={v}' for k, v in sm.hints.items() if k != 'batch')}:")
        print(text_table(
            ["schedule", "largest batch", "peak MiB", "peak at batch+1 MiB"],
            [[r["schedule"], str(r["batch"]), mib(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
              mib(r["next_peak_bytes"])] for r in rows],
        ))
        if args.json:
            write_json(args.json, {"budget_bytes": budget, "rows": rows})
        return EXIT_OK
    if not args.budget and not args.device_memory:
        raise ValueError("plan needs --budget SIZE (activation bytes) or --device-memory SIZE")
    w = load(args)
    budget = _budget(args, w)
    if args.granularity == "op":
        return _plan_op(args, w, budget)
    t0 = time.perf_counter()
    planner = w.planner()
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        if args.json:
            write_json(args.json, {
                "budget_bytes": budget, "schedule": None, "error": str(e),
                "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                "unconstrained_peak_bytes": planner.unconstrained_peak_bytes,
            })
        raise
    result = w.result(plan.schedule)
    calibration_note(w)
    print(plan_text(plan, result, planner.calibrate_s, time.perf_counter() - t0))
    if args.json:
        doc = plan_json(plan, result)
        doc.update(static=w.static.to_dict(), static_bytes=w.static.total_bytes,
                   device_memory_bytes=w.device_memory_bytes, predicted_only=w.predicted_only)
        write_json(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return _plan_outcome(result, budget, plan.schedule.provenance, plan.predicted_peak_bytes)


def _plan_outcome(result: ScheduleResult, budget: int, provenance: str, predicted_peak_bytes: int) -> int:
    """EXIT_OK, or EXIT_FAILED saying why: the plan's gradients differ from the
    un-rewritten step, or its measured peak exceeds the budget (a predicted-only plan
    is not measured: EXIT_OK)."""
    if result.predicted_only:
        return EXIT_OK
    if not result.grads_match:
        print(f"remat-pass plan: error: the gradients of {provenance} differ from the "
              "un-rewritten step", file=sys.stderr)
        return EXIT_FAILED
    if result.measured_peak_bytes > budget:
        print(f"remat-pass plan: error: the measured peak {result.measured_peak_bytes} bytes "
              f"({fmt_bytes(result.measured_peak_bytes)}) exceeds the budget {budget} bytes ({fmt_bytes(budget)}) "
              f"by {result.measured_peak_bytes - budget} bytes; predicted {predicted_peak_bytes} bytes",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _plan_op(args: argparse.Namespace, w: Workload, budget: int) -> int:
    """``plan --granularity op``: the op-level optimum under the budget, measured when
    the step can run."""
    session = _whole_session(w, "plan --granularity op")
    t0 = time.perf_counter()
    planner = OpPlanner(session.joint, session.stack, w.report,
                        CostModel(args.flops_per_byte, timed=args.timed_costs))
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        if args.json:
            write_json(args.json, {"budget_bytes": budget, "granularity": "op", "partition": None, "error": str(e),
                                   "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                                   "unconstrained_peak_bytes": planner.unconstrained_peak_bytes})
        raise
    result = w.result(plan.partition)
    calibration_note(w)
    print(op_plan_text(plan, result, planner, time.perf_counter() - t0))
    if args.json:
        write_json(args.json, op_plan_json(plan, result))
        print(f"wrote {args.json}", file=sys.stderr)
    return _plan_outcome(result, budget, plan.partition.provenance, plan.predicted_peak_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="remat-pass",
        description="Activation recomputation as a compiler pass: predicted and measured peak memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
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
    p.add_argument("--max-regression", default="0%", metavar="FRACTION",
                   help="allowed growth over the baseline peak, e.g. 5%% or 0.05 (default: %(default)s)")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat-pass`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RematError, ValueError, ImportError, OSError) as e:
        print(f"remat-pass: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
