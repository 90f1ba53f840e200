"""The command line's shared options: the model, target and static memory
(``--model`` / ``--config``, ``--target``, ``--device-memory``, ...) and the schedule
(``--schedule``, ``--recompute-num-layers``, ``--all-schedules``), the traced step they
describe (``workload.load_workload``), and the exit codes every command returns.

``cli_sweep``, ``cli_report`` and ``cli_plan`` build on it; ``cli`` puts the options on
its subcommands.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from ..recompute import schedule as schedules
from ..memory.calibration import CACHE_ENV
from ..models.configs import DTYPES, TASKS, ModelSpec
from ..models.shipped import load_factory
from ..memory.cuda_target import GPUS
from ..formatting import fmt_bytes
from ..report.gate import EXIT_FAILED, EXIT_OK  # noqa: F401 - the exit codes every command returns
from ..memory.static_memory import OPTIMIZERS
from ..evaluate.session import Session
from ..evaluate.workload import DEFAULT_MODEL, TARGETS, Workload, WorkloadOptions, load_workload

DEFAULT_GPU = WorkloadOptions.gpu  # the GPU --target cuda predicts for without --gpu

EXIT_USAGE = 2  # bad input; EXIT_OK (0) and EXIT_FAILED (1: a gate or gradient check failed) are the gate's


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
    g.add_argument("--batch", type=positive_int,
                   help=f"batch size passed to the factory (default: the factory's; --config: {ModelSpec.batch})")
    g.add_argument("--seq", type=positive_int,
                   help=f"sequence length passed to the factory (default: the factory's; --config: {ModelSpec.seq})")
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
    g.add_argument("--routing-capacity", type=positive_int, metavar="TOKENS",
                   help="a mixture-of-experts model: predict and measure the worst routing with at most TOKENS "
                        "tokens per expert instead of this batch's (every router top-k is forced to it)")
    g.add_argument("--trace-all-layers", action="store_true",
                   help="trace every layer of a large --meta model instead of analysing it from a few")
    t = p.add_argument_group("target and static memory")
    t.add_argument("--target", choices=TARGETS, default="cpu",
                   help="device to predict for: cpu (measurable here) or cuda (kernels and allocator modelled; "
                   "predicted only on a machine without a GPU) (default: %(default)s)")
    t.add_argument("--gpu", choices=tuple(GPUS), help=f"the GPU of --target cuda (default: {DEFAULT_GPU})")
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
        seed=args.seed, target=args.target, gpu=args.gpu or DEFAULT_GPU, optimizer=args.optimizer,
        master_weights=args.master_weights, device_memory=args.device_memory,
        trace_all_layers=args.trace_all_layers, allocator=getattr(args, "allocator", None),
        factory_kwargs=tuple(getattr(args, "factory_kwargs", {}).items()),
        routing_capacity=getattr(args, "routing_capacity", None))


def model_name(args: argparse.Namespace) -> str:
    """The config file or factory the model arguments name."""
    return args.config or args.model or DEFAULT_MODEL


def load(args: argparse.Namespace) -> Workload:
    """Build and trace the step of the model arguments (prints what it does to stderr,
    then, before any figure, the defaults that shape a --config model's figures)."""
    w = load_workload(workload_options(args))
    line = config_defaults_line(args) or factory_defaults_line(args)  # once the model is built, before any figure
    if line:
        print(line, file=sys.stderr)
    return w


def config_defaults_line(args: argparse.Namespace) -> str | None:
    """For a --config model, one line naming the example shape, dtype and target its
    figures are for, saying which came from defaults rather than flags (a 70B plan without
    --seq is for ``ModelSpec.seq`` tokens); None without --config.

    Example:
        >>> ns = argparse.Namespace(config="c.json", batch=None, seq=4096, dtype=None, target="cpu")
        >>> config_defaults_line(ns)
        'c.json: batch 1 (default; --batch), seq 4096, dtype float32 (default; --dtype), target cpu'
    """
    if not getattr(args, "config", None):
        return None
    return ", ".join([f"{args.config}: " + _value("batch", args.batch, ModelSpec.batch),
                      _value("seq", args.seq, ModelSpec.seq), _value("dtype", args.dtype, "float32"),
                      f"target {args.target}"])


def _value(name: str, given: object, default: object) -> str:
    return f"{name} {given}" if given is not None else f"{name} {default} (default; --{name})"


def factory_defaults_line(args: argparse.Namespace) -> str | None:
    """For a --model factory, the same line as ``config_defaults_line``: the batch, seq
    and layers its figures are for, those not given taken from the factory's own
    defaults (read from its signature), the dtype and the target; None for --config or
    a factory whose signature cannot be read.

    Example:
        >>> ns = argparse.Namespace(config=None, model="remat_pass.models:tiny_gpt", batch=2, seq=None,
        ...                         layers=None, dtype=None, target="cpu")
        >>> factory_defaults_line(ns)
        'remat_pass.models:tiny_gpt: batch 2, seq 128 (default; --seq), layers 8 (default; --layers), dtype as built (--dtype), target cpu'
    """
    if getattr(args, "config", None):
        return None
    spec = getattr(args, "model", None) or DEFAULT_MODEL
    try:
        params = inspect.signature(load_factory(spec)).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        return None
    parts = [_value(name, getattr(args, name, None), params[name].default) for name in ("batch", "seq", "layers")
             if name in params and params[name].default is not inspect.Parameter.empty]
    parts.append(f"dtype {args.dtype}" if args.dtype else "dtype as built (--dtype)")
    return f"{spec}: " + ", ".join(parts + [f"target {args.target}"])


def static_line(w: Workload) -> str:
    """One line: the step's static memory by part, and what --device-memory leaves."""
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
        left = w.device_memory_bytes - s.total_bytes
        line += (f"; device {fmt_bytes(w.device_memory_bytes)} leaves {fmt_bytes(left)} for activations" if left >= 0
                 else f"; device {fmt_bytes(w.device_memory_bytes)} does not hold the static memory alone "
                      f"({fmt_bytes(-left)} short): no schedule fits")
    return line


def calibration_note(w: Workload) -> None:
    """Say on stderr how many op signatures were calibrated now, in how long, where the
    figures are kept."""
    cal = w.session.calibrator if w.session is not None else None
    if cal is not None and cal.calibrated_signatures:
        print(f"calibrated the scratch memory of {cal.calibrated_signatures} op signatures in "
              f"{cal.calibrate_s:.1f}s (cached in {cal.path})", file=sys.stderr)


def whole_session(w: Workload, what: str) -> Session:
    """The session of a step traced whole (op-level choices name its nodes).

    Raises:
        ValueError: the stack was analysed from a template (``layer_reuse``).
    """
    if w.session is None:
        raise ValueError(f"{what} chooses nodes in every layer: add --trace-all-layers")
    return w.session


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
    g.add_argument("--schedule", choices=("none", "uniform", "block"),
                   help="recompute method (Megatron-LM --recompute-method; default: none)")
    g.add_argument("--recompute-num-layers", type=int, metavar="K", dest="recompute_num_layers",
                   help="K for uniform, N for block (Megatron-LM --recompute-num-layers)")
    g.add_argument("--num-layers", type=int, metavar="K", dest="recompute_num_layers", action=_DeprecatedAlias,
                   help=argparse.SUPPRESS)
    if allow_all:
        g.add_argument("--all-schedules", action="store_true",
                       help="every Megatron setting: none, uniform K=1..L, block N=0..L")
    g.add_argument("--allocator", choices=("cpu", "cuda"),
                   help="allocator model for the predicted bytes (default: the --target's)")


def chosen_schedules(args: argparse.Namespace, w: Workload) -> list[schedules.Schedule]:
    """The schedules the schedule options ask for (every Megatron setting with
    --all-schedules).

    Raises:
        ValueError: --schedule uniform / block without --recompute-num-layers.
        InvalidSchedule: a K or N the layer stack does not allow.
    """
    per_stack = w.layers_per_stack
    if getattr(args, "all_schedules", False):
        return schedules.megatron_schedules(per_stack)
    method = args.schedule or "none"
    if method != "none" and args.recompute_num_layers is None:
        raise ValueError(f"--schedule {args.schedule} needs --recompute-num-layers K (the layer stack has "
                         f"L={w.num_layers})" if len(per_stack) == 1 else
                         f"--schedule {args.schedule} needs --recompute-num-layers K (applied to each of the "
                         f"layer stacks {w.session.stack.describe()})")
    return [schedules.make(method, args.recompute_num_layers, per_stack)]


def stacks_meta(w: Workload) -> dict:
    """``{"layer_stacks": [...]}`` naming each stack and its layers when there are several."""
    if w.session is None or len(w.session.stack.stacks) == 1:
        return {}
    return {"layer_stacks": [{"path": s.path, "first_layer": s.first_layer, "num_layers": s.num_layers}
                             for s in w.session.stack.stacks]}


def report_meta(args: argparse.Namespace, w: Workload) -> dict:
    """The ``meta`` of a report: the model, its arguments and layer stacks, the target
    (fields that do not apply are left out)."""
    meta = {"model": model_name(args), "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "layer_stack": w.stack_path, "num_layers": w.num_layers, **stacks_meta(w),
            "target": args.target if args.target != "cpu" else None, "predicted_only": w.predicted_only or None,
            "static_bytes": w.static.total_bytes if (args.optimizer != "none" or args.target != "cpu") else None,
            "notes": list(w.session.joint.notes) if w.session is not None and w.session.joint.notes else None}
    return {k: v for k, v in meta.items() if v is not None}


def predict(w: Workload, sched: schedules.Schedule):  # noqa: ANN202
    """``(step, report)``; the step is None when the stack is analysed from a template."""
    if w.session is None:
        return None, w.report(sched)
    step, report, _ = w.session.prepare(sched, w.allocator)
    return step, report


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made), saying so on stderr."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
