"""Flags that contradict each other or do not apply to the command, refused before any
model is built (exit 2, the flags named with what is allowed).

Argparse checks each flag alone; this module checks them together: a value that only
one mode of a command reads (``--recompute-num-layers`` with ``--schedule none``, ``--gpu``
without ``--target cuda``, ``--measure`` on one device) would otherwise be silently
ignored, and the figures would not be those the user asked for.
"""

from __future__ import annotations

import argparse

# the per-rank flags and the value each has when not given (cli/parallel.add_parallel_args)
PER_RANK_DEFAULTS = {"tp": 1, "sp": False, "pp": 1, "microbatches": 1, "pipeline_schedule": "1f1b", "vpp": 1,
                     "fsdp": 1}
MODEL_FLAGS = ("model", "config", "batch", "seq", "layers", "stack", "task", "dtype", "autocast")


def _given(args: argparse.Namespace, name: str) -> bool:
    """Whether ``--name`` was given (its value is not argparse's default None / False)."""
    value = getattr(args, name, None)
    return value not in (None, False, ())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def per_rank_requested(args: argparse.Namespace) -> bool:
    """Whether any per-rank flag (--tp --sp --pp --microbatches --pipeline-schedule --vpp
    --fsdp) was given: the command then describes every rank, not one device."""
    return any(getattr(args, f, d) != d for f, d in PER_RANK_DEFAULTS.items())


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other or that this command would ignore.

    Raises:
        ValueError: the flags named, with the combination that is allowed.
    """
    command = args.command
    all_schedules = getattr(args, "all_schedules", False)
    if all_schedules and (_given(args, "schedule") or _given(args, "recompute_num_layers")):
        raise ValueError("--all-schedules evaluates every Megatron setting; drop --schedule / "
                         "--recompute-num-layers, or drop --all-schedules to evaluate one")
    if _given(args, "recompute_num_layers") and getattr(args, "schedule", None) in (None, "none"):
        raise ValueError("--recompute-num-layers is K for --schedule uniform or N for --schedule block; "
                         "--schedule none recomputes nothing and takes no K")
    if _given(args, "task") and not _given(args, "config"):
        raise ValueError("--task chooses the model class of a --config file; a --model factory builds its own model")
    if _given(args, "gpu") and getattr(args, "target", "cpu") != "cuda":
        raise ValueError(f"--gpu {args.gpu} describes the device of --target cuda; add --target cuda "
                         "(the default target, cpu, has no GPU)")
    if command == "inspect" and _given(args, "graph"):
        given = [_flag(f) for f in MODEL_FLAGS if _given(args, f)]
        if given:
            raise ValueError(f"--graph reads a dump instead of tracing a model; {', '.join(given)} do not apply to it")
    if command == "check":
        if _given(args, "report"):
            given = [_flag(f) for f in MODEL_FLAGS if _given(args, f)]
            if given:
                raise ValueError(f"--report checks a report file instead of tracing a model; "
                                 f"{', '.join(given)} do not apply to it")
        if _given(args, "max_regression") and not _given(args, "baseline"):
            raise ValueError("--max-regression is the growth allowed over --baseline; give --baseline PATH")
    if command == "sweep" and getattr(args, "measure", False) and not per_rank_requested(args):
        raise ValueError("--measure launches the ranks of a per-rank sweep (--tp / --pp / --fsdp); a sweep on "
                         "one device always measures every setting")
    for name in ("json", "markdown", "png", "dump"):
        if getattr(args, name, None) == "-":
            raise ValueError(f"{_flag(name)} -: standard output is not supported; give a file path")
    if getattr(args, "module_kind", None) and not (getattr(args, "recompute_modules", None)
                                                   or getattr(args, "selective", False)):
        raise ValueError("--module-kind names the modules of a kind for --recompute-modules (or --selective); "
                         "alone it changes nothing")
    if command == "report":
        if getattr(args, "png", None) and all_schedules:
            raise ValueError("--png draws one schedule: drop --all-schedules or --png")
        if getattr(args, "measure", False) and (getattr(args, "meta", False) or getattr(args, "target", "cpu") != "cpu"):
            raise ValueError("--measure runs the step on this CPU: it needs weights (no --meta) and --target cpu")
