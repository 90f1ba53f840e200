"""The per-rank commands: ``sweep`` and ``plan`` with ``--tp --sp --pp --microbatches
--pipeline-schedule --vpp --fsdp`` (Megatron-LM's parallel sizes).

``sweep`` prints one row per (rank, setting): the rank's stages, predicted peak
activation bytes, static bytes, the bytes other microbatches in flight hold, how many
are in flight and where the peak is (``parallel_plan.predict_config``: every rank
traced in this process under a fake process group); ``--measure`` runs the ranks on
gloo (``distributed.measure_config``, ``fsdp_measure.measure_fsdp``). ``plan
--device-memory`` chooses per stage (``parallel_plan.plan_stages``) and prints
Megatron-LM's flags where they can express the plan. ``cli_sweep`` and ``cli_plan`` dispatch here and
turn the results into exit codes; bad settings raise ``InvalidOption`` (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from ..parallel.distributed import RunOptions, measure_config
from ..errors import InfeasibleBudget
from ..formatting import fmt_bytes, mib, parse_bytes, text_table
from ..parallel.fsdp_measure import measure_fsdp
from ..models.configs import ModelSpec, build_factory, build_from_config, default_task, load_config
from ..parallel.hf_plans import rank_step_model
from ..parallel.ranks import ParallelConfig, validate
from ..parallel.plan import FSDP_COLUMNS, PREDICTION_COLUMNS, fsdp_rows, megatron_flags, plan_stages, predict_config
from ..parallel.plan import predict_fsdp_config, prediction_json, prediction_rows, stage_plan_text
from ..report.documents import write_document

DEFAULT_PARALLEL_MODEL = "remat_pass.models:tiny_llama"


def model_spec(args: argparse.Namespace) -> str:
    """``--model``, or the default model of the per-rank commands."""
    return args.model or DEFAULT_PARALLEL_MODEL


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Add the parallel sizes (Megatron-LM's names) that make the command per rank."""
    g = p.add_argument_group("parallelism (per-rank prediction; default model: " + DEFAULT_PARALLEL_MODEL + ")")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size t (default: 1)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp 2 or more)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size p (default: 1)")
    g.add_argument("--microbatches", type=int, default=1, help="microbatches m per step (default: 1)")
    g.add_argument("--pipeline-schedule", default="1f1b", help="1f1b, gpipe or interleaved (default: %(default)s)")
    g.add_argument("--vpp", type=int, default=1, help="model chunks per rank v (interleaved)")
    g.add_argument("--fsdp", type=int, default=1, help="FSDP2 data-parallel size d (default: 1)")


def parallel_config(args: argparse.Namespace) -> ParallelConfig | None:
    """The ParallelConfig the options ask for, None when they ask for one device."""
    config = ParallelConfig(tp=args.tp, sp=args.sp, pp=args.pp, microbatches=args.microbatches,
                            pipeline_schedule=args.pipeline_schedule, vpp=args.vpp, fsdp=args.fsdp)
    if config == ParallelConfig():
        return None
    without_weights = getattr(args, "config", None) or getattr(args, "meta", False) or getattr(args, "dtype", None)
    unsupported = [flag for flag, given in (
        ("--measure with --config / --meta / --dtype", without_weights and getattr(args, "measure", False)),
        ("--fsdp with --config / --meta / --dtype", without_weights and config.fsdp > 1),
        ("--target cuda", getattr(args, "target", "cpu") != "cpu"), ("--autocast", getattr(args, "autocast", None)),
        ("--stack", getattr(args, "stack", None)),
        ("--selective / --recompute-modules / --policy", any(getattr(args, o, None) for o in (
            "selective", "recompute_modules", "policy")))) if given]
    if unsupported:
        raise ValueError(f"the per-rank commands (--tp, --pp, --fsdp) predict a --model factory or a --config on "
                         f"the CPU target, and measure a factory with weights; {', '.join(unsupported)} are not "
                         "supported with them yet")
    return config


def load_parallel(args: argparse.Namespace, config: ParallelConfig) -> tuple[Any, Any]:
    """Build the model for a per-rank command and validate ``config`` against it.

    Raises:
        ValueError: the factory returns a ``loss_fn`` (each rank's step splits the batch
            into microbatches and its last stage computes the loss: the model must take
            the targets and return the loss, ``forward(ids, targets)``, as
            ``torch.distributed.pipelining``'s last stage does).
        InvalidOption: ``config`` against the model (``parallel.ranks.validate``).
    """
    if getattr(args, "config", None):
        config_ = load_config(args.config)
        spec = ModelSpec(task=args.task or default_task(config_), dtype=args.dtype or "float32", meta=args.meta,
                         batch=args.batch or 1, seq=args.seq or 128, layers=args.layers)
        model, inputs, loss_fn = build_from_config(config_, spec)
    else:
        model, inputs, loss_fn = build_factory(model_spec(args), meta=getattr(args, "meta", False),
                                               dtype=getattr(args, "dtype", None), batch=args.batch, seq=args.seq,
                                               layers=args.layers)
    if loss_fn is not None:
        raise ValueError(f"the per-rank commands (--tp, --pp, --fsdp) split the batch into microbatches and compute "
                         f"the loss on the last stage, so the model must take the targets and return the loss "
                         f"(forward(ids, targets) -> loss, e.g. remat_pass.models:tiny_llama); {model_spec(args)} "
                         f"returns a loss_fn, which closes over the whole batch's targets")
    model, inputs = rank_step_model(model, inputs)
    batch = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    validate(config, model, batch.shape[0], batch.shape[1] if batch.dim() > 1 else None)
    return model, inputs


def sweep_parallel(args: argparse.Namespace, config: ParallelConfig) -> bool:
    """Per-rank predicted peaks of every Megatron setting (fake process group, no
    processes); with --measure, the same ranks run on gloo and are measured."""
    model, inputs = load_parallel(args, config)
    t0 = time.perf_counter()
    if config.fsdp > 1:
        return sweep_fsdp(args, config, model, inputs)
    alike = bool(getattr(args, "meta", False) or getattr(args, "config", None))
    preds = predict_config(model, inputs, config, allocator=args.allocator or "cpu", alike=alike)
    traced = f"{config.pp * config.fsdp} ranks traced (one per tensor-parallel group, whose ranks hold shards " \
        f"of the same shapes; one middle stage for the alike ones)" if alike else f"{config.world_size} ranks traced"
    print(f"{config.name}: {traced} with the fake process group "
          f"({time.perf_counter() - t0:.1f}s); peaks are activation bytes of one step "
          f"({config.microbatches} microbatches), static = parameters, buffers, batch", file=sys.stderr)
    print(text_table(PREDICTION_COLUMNS, prediction_rows(preds)))
    rows = [prediction_json(config, p) for i in range(len(preds[0])) for rank_preds in preds for p in [rank_preds[i]]]
    ok = True
    if args.measure:
        settings = [(p.schedule.split("(")[0], None if p.schedule == "none" else int(p.schedule.split("=")[1][:-1]))
                    for p in preds[0]]
        options = RunOptions(model_spec(args), _factory_kwargs(args), tuple(settings), repeats=args.repeats)
        measured = {(r.schedule, r.rank): r for r in measure_config(config, options)}
        print(text_table(MEASURED_COLUMNS, [measured_row(r["rank"], r["schedule"], r["predicted_peak_bytes"],
                                                          measured[(r["schedule"], r["rank"])]) for r in rows]))
        for r in rows:
            m = measured[(r["schedule"], r["rank"])]
            r.update(measured_peak_bytes=m.measured_peak_bytes, measured_runs_bytes=list(m.measured_runs_bytes),
                     grads_equal=m.grads_equal)
            ok = ok and m.grads_equal
    if args.json:
        write_document(args.json, "remat-pass-sweep-ranks",
                       {"model": model_spec(args), "config": dataclasses.asdict(config), "rows": rows})
        print(f"wrote {args.json}", file=sys.stderr)
    return ok


MEASURED_COLUMNS = ["rank", "schedule", "predicted MiB", "measured MiB", "error B", "error %", "runs", "grads"]


def measured_row(rank: int, schedule: str, predicted: int, m: Any) -> list[str]:
    """A row of the --measure table: the rank's predicted and measured (least of its
    runs) peaks in MiB, their difference in bytes (MiB hides a few KiB) and percent."""
    got = m.measured_peak_bytes
    err = predicted - got
    return [str(rank), schedule, mib(predicted), mib(got), f"{err:+,}", f"{100 * err / got:+.2f}" if got else "",
            str(len(m.measured_runs_bytes)), "equal" if m.grads_equal else "DIFFER"]


def _factory_kwargs(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    return tuple((k, v) for k, v in (("batch", args.batch), ("seq", args.seq), ("layers", args.layers)) if v is not None)


def sweep_fsdp(args: argparse.Namespace, config: ParallelConfig, model: Any, inputs: Any) -> bool:
    """An FSDP2 rank's predicted peak under every Megatron setting (one trace: every
    rank has the same shapes); with --measure, ``none`` measured on d gloo ranks
    (eager ``fully_shard``: no recompute to measure)."""
    t0 = time.perf_counter()
    preds = predict_fsdp_config(model, inputs, config)
    print(f"{config.name}: one rank's step traced ({time.perf_counter() - t0:.1f}s); peaks are activation bytes "
          "with FSDP2's gathered parameters and reduce-scatter buffers, static = sharded parameters; only none is "
          "checked against a measurement (eager fully_shard has no recompute)", file=sys.stderr)
    print(text_table(FSDP_COLUMNS, fsdp_rows(config, preds)))
    rows = [{"config": config.name, "schedule": p.schedule, "ranks": list(range(config.fsdp)),
             "predicted_peak_bytes": p.prediction.peak_bytes, "static_bytes": p.prediction.static_bytes,
             "peak_at": p.prediction.where, "recompute_flops": p.recompute_flops} for p in preds]
    ok = True
    if args.measure:
        options = RunOptions(model_spec(args), _factory_kwargs(args), (("none", None),), repeats=args.repeats)
        measured = measure_fsdp(config, options)
        print(text_table(MEASURED_COLUMNS, [measured_row(m.rank, m.schedule, m.predicted_peak_bytes, m)
                                            for m in measured]))
        rows[0]["measured_peak_bytes"] = [m.measured_peak_bytes for m in measured]
        ok = all(m.grads_equal for m in measured)
    if args.json:
        write_document(args.json, "remat-pass-sweep-ranks",
                       {"model": model_spec(args), "config": dataclasses.asdict(config), "rows": rows})
        print(f"wrote {args.json}", file=sys.stderr)
    return ok


def plan_parallel(args: argparse.Namespace, config: ParallelConfig) -> None:
    """Least recompute per stage within --device-memory, as Megatron-LM flags where
    they can express it."""
    if args.device_memory is None:
        raise ValueError("a per-rank plan needs --device-memory SIZE (e.g. 80GiB): the memory of one device")
    device = parse_bytes(args.device_memory)
    model, inputs = load_parallel(args, config)
    if config.fsdp > 1:
        plan_fsdp(config, model, inputs, device)
        return
    alike = bool(getattr(args, "meta", False) or getattr(args, "config", None))
    preds = predict_config(model, inputs, config, allocator=args.allocator or "cpu", alike=alike)
    plan = plan_stages(preds, device)
    print(stage_plan_text(config, plan))
    if args.json:
        write_document(args.json, "remat-pass-plan", {
                       "config": dataclasses.asdict(config), "device_memory_bytes": device,
                               "expressible": plan.expressible, "megatron_flags": plan.flags,
                               "shared_setting": plan.shared, "gain_flops": plan.gain_flops,
                               "rows": [prediction_json(config, p) for p in plan.chosen]})


def plan_fsdp(config: ParallelConfig, model: Any, inputs: Any, device_memory_bytes: int) -> None:
    """The least-recompute setting whose FSDP2 peak + sharded parameters fit the device
    (every rank alike), as Megatron-LM flags."""
    preds = predict_fsdp_config(model, inputs, config)
    fits = [p for p in preds if p.prediction.peak_bytes + p.prediction.static_bytes <= device_memory_bytes]
    if not fits:
        least = min(preds, key=lambda p: p.prediction.peak_bytes + p.prediction.static_bytes)
        need = least.prediction.peak_bytes + least.prediction.static_bytes
        raise InfeasibleBudget(f"an FSDP2 rank needs at least {fmt_bytes(need)} (activation peak under "
                               f"{least.schedule} + sharded parameters); the device has {fmt_bytes(device_memory_bytes)}",
                               least_feasible_peak_bytes=need, budget_bytes=device_memory_bytes)
    best = min(fits, key=lambda p: (p.recompute_flops, p.prediction.peak_bytes))
    print(f"{config.name}: least recompute within {fmt_bytes(device_memory_bytes)} (activation peak + sharded "
          "parameters; optimizer states not counted)")
    print(text_table(FSDP_COLUMNS, fsdp_rows(config, [best])))
    method, _, rest = best.schedule.partition("(")
    print("Megatron-LM: " + megatron_flags(method, int(rest.split("=")[1].rstrip(")")) if rest else None))


