"""Plan every rank of a parallel step without processes, and choose per-stage recompute.

``predict_config`` traces each rank in turn under a fake process group
(``parallel.fake_process_group``) and predicts its step under each Megatron-LM
recompute setting (``none``, ``uniform`` K = 1..L_stage, ``block`` N = 0..L_stage,
applied per pipeline stage as Megatron applies ``--recompute-num-layers``).
``plan_stages`` picks, for every rank, the setting with the least recompute FLOPs whose
peak fits the device (activation peak + static memory <= ``--device-memory``), and
says whether Megatron-LM's flags can express the result: its flags are one setting for
every stage, so they can when all stages chose the same one; otherwise the per-stage
plan is printed with its gain over the best setting every stage can share.
``predict_fsdp_config`` predicts an FSDP2 step (``fsdp.predict_fsdp``) under each
setting: every rank runs the same shapes (its 1/d of the batch), so one trace serves
all d ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.nn as nn

from ..recompute import schedule as schedules
from ..recompute.schedule import megatron_flags  # noqa: F401 - also this module's public name
from ..graph.costs import node_flops
from ..errors import InfeasibleBudget
from ..formatting import fmt_bytes, mib, text_table
from .fsdp import FsdpPrediction, predict_fsdp
from .ranks import ParallelConfig, RankPrediction, fake_process_group, microbatches, predict_rank, trace_rank
from .launch import RANK_THREADS
from ..graph.regions import find_layer_stack
from ..recompute.rewrite import rewrite
from ..evaluate.traced_step import StepOptions, trace_step


def stage_schedules(num_layers: int) -> list[tuple[str, int | None]]:
    """Megatron-LM's settings for a stage of L layers: none, uniform K = 1..L, block
    N = 1..L (block N = 0 recomputes nothing, like none)."""
    return [(s.method, s.recompute_num_layers) for s in schedules.megatron_schedules(num_layers)
            if not (s.method == "block" and s.recompute_num_layers == 0)]


def predict_config(model: nn.Module, inputs: Any, config: ParallelConfig,
                   settings: Sequence[tuple[str, int | None]] | None = None,
                   allocator: str = "cpu", grad_accumulator: str = "in_step",
                   threads: int = RANK_THREADS, alike: bool = False) -> list[list[RankPrediction]]:
    """Every rank's predicted step under every setting, traced with the fake process
    group one rank at a time (no processes, nothing communicated).

    Args:
        model, inputs: the full model and the global batch ``(ids, targets)``.
        config: validated with ``parallel.validate``.
        settings: ``(method, K or N)`` per setting; default ``stage_schedules(L_stage)``.
        threads: each rank's intra-op threads; default ``launch.RANK_THREADS``, the
            count the measured gloo ranks run with (not this process's).
        alike: trace what is alike once. One rank per pipeline position
            (tensor-parallel index 0) gives its predictions to the other ranks of its
            tensor-parallel group: they hold shards of the same shapes (``validate``
            makes t divide every split size), so their graphs differ only in the names
            of their process groups. One middle stage (neither first nor last) stands
            for every middle stage with the same ``stages.middle_stage_key`` (the
            activation it receives, its layers' module evidence). Both are checked
            against tracing each in tests/parallel/test_parallel_plan.py.

    Returns:
        ``[rank][setting]`` RankPredictions.
    """
    out: list[list[RankPrediction]] = []
    alike_stages: dict[Any, Any] | None = {} if alike else None
    profile_cache: dict[Any, Any] | None = {} if alike else None
    for rank in range(config.world_size):
        if alike and config.coords(rank)[1] > 0:
            out.append([dataclasses.replace(p, rank=rank) for p in out[rank - config.coords(rank)[1]]])
            continue
        with fake_process_group(rank, config.world_size):
            graphs = trace_rank(model, inputs, config, rank, alike_stages)
        todo = list(settings) if settings is not None else stage_schedules(graphs[0].stack.num_layers)
        out.append([predict_rank(graphs, config, rank, m, k, allocator, grad_accumulator, threads, profile_cache)
                    for m, k in todo])
    return out


@dataclasses.dataclass(frozen=True)
class FsdpSettingPrediction:
    """One FSDP2 rank's predicted step under one recompute setting.

    Attributes:
        schedule: the setting's provenance (``uniform(K=2)``).
        prediction: ``fsdp.FsdpPrediction`` (peak, where, sharded static bytes, hooks).
        recompute_flops: FLOPs recomputed in the rank's step.
    """

    schedule: str
    prediction: FsdpPrediction
    recompute_flops: int


def predict_fsdp_config(model: nn.Module, inputs: Any, config: ParallelConfig,
                        settings: Sequence[tuple[str, int | None]] | None = None) -> list[FsdpSettingPrediction]:
    """An FSDP2 rank's predicted step (``fully_shard`` per layer and the root, world
    d = ``config.fsdp``) under every setting, from one trace of its 1/d of the batch
    (every rank has the same shapes, so the same prediction).

    Args:
        model, inputs: the full model (loss inside) and the global batch.
        config: validated with ``parallel.validate`` (FSDP alone).
        settings: ``(method, K or N)``; default ``stage_schedules(L)``.

    Returns:
        One FsdpSettingPrediction per setting, in order. Only ``none`` is checked by a
        measurement (``fsdp_measure``: the eager FSDP2 step has no recompute).
    """
    local = microbatches(inputs, config.fsdp)[0]
    stack_path, _ = find_layer_stack(model)
    traced = trace_step(StepOptions(model=model, example_inputs=local, stack=stack_path))
    joint, stack = traced.joint, traced.stack
    out = []
    for method, k in (list(settings) if settings is not None else stage_schedules(stack.num_layers)):
        sched = schedules.make(method, k, stack.num_layers)
        step = rewrite(joint, stack, sched)
        flops = sum(int(node_flops(n)) for n in step.backward.graph.nodes if step.kind_of.get(n.name) == "recompute")
        out.append(FsdpSettingPrediction(sched.provenance, predict_fsdp(
            step, joint.primal_values, joint.primal_kinds, joint.primal_labels, stack_path, stack.num_layers,
            config.fsdp), flops))
    return out


FSDP_COLUMNS = ["ranks", "schedule", "peak MiB", "static MiB", "peak at"]


def fsdp_rows(config: ParallelConfig, preds: Sequence[FsdpSettingPrediction]) -> list[list[str]]:
    """Table rows (``FSDP_COLUMNS``); static = the rank's sharded parameters."""
    ranks = f"0-{config.fsdp - 1}"
    return [[ranks, p.schedule, mib(p.prediction.peak_bytes), mib(p.prediction.static_bytes), p.prediction.where]
            for p in preds]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The plan of a parallel step under a device-memory size.

    Attributes:
        device_memory_bytes: the device's memory.
        chosen: per rank, the RankPrediction chosen (least recompute that fits).
        shared: the one setting every rank can use with the least total recompute
            (None when no single setting fits every rank).
        expressible: Megatron-LM's flags express ``chosen`` (all ranks chose alike).
        flags: the flags of ``chosen`` when expressible, else of ``shared``.
        gain_flops: recompute FLOPs ``shared`` costs more than ``chosen`` (summed
            over ranks; 0 when expressible).
    """

    device_memory_bytes: int
    chosen: tuple[RankPrediction, ...]
    shared: str | None
    expressible: bool
    flags: str
    gain_flops: int


def _setting(p: RankPrediction) -> tuple[str, int | None]:
    if p.schedule == "none":
        return ("none", None)
    method, rest = p.schedule.split("(", 1)
    return (method, int(rest.split("=")[1].rstrip(")")))


def plan_stages(predictions: Sequence[Sequence[RankPrediction]], device_memory_bytes: int) -> StagePlan:
    """Choose per rank the least-recompute setting whose peak + static bytes fit.

    Raises:
        InfeasibleBudget: a rank fits under no setting (carries that rank's least
            peak + static bytes).
    """
    chosen = []
    for rank_preds in predictions:
        fits = [p for p in rank_preds if p.peak_bytes + p.static_bytes <= device_memory_bytes]
        if not fits:
            least = min(rank_preds, key=lambda p: p.peak_bytes + p.static_bytes)
            raise InfeasibleBudget(
                f"rank {least.rank} (stages {list(least.stages)}) needs at least "
                f"{fmt_bytes(least.peak_bytes + least.static_bytes)} (activation peak {fmt_bytes(least.peak_bytes)} "
                f"under {least.schedule} + static {fmt_bytes(least.static_bytes)}); the device has "
                f"{fmt_bytes(device_memory_bytes)}",
                least_feasible_peak_bytes=least.peak_bytes + least.static_bytes, budget_bytes=device_memory_bytes)
        chosen.append(min(fits, key=lambda p: (p.recompute_flops, p.peak_bytes)))
    by_setting: dict[tuple[str, int | None], list[RankPrediction]] = {}
    for rank_preds in predictions:
        for p in rank_preds:
            by_setting.setdefault(_setting(p), []).append(p)
    common = [(sum(p.recompute_flops for p in ps), s) for s, ps in by_setting.items()
              if len(ps) == len(predictions) and all(p.peak_bytes + p.static_bytes <= device_memory_bytes for p in ps)]
    shared = min(common, key=lambda c: (c[0], str(c[1])))[1] if common else None
    # Megatron's flags express the plan when one setting costs every rank no more
    # recompute than its own best (settings that tie, e.g. uniform K=1 and block N=L)
    expressible = shared is not None and all(
        s.recompute_flops <= c.recompute_flops for s, c in zip(by_setting[shared], chosen))
    if expressible:
        chosen = list(by_setting[shared])
    gain = 0 if expressible or shared is None else (
        sum(p.recompute_flops for p in by_setting[shared]) - sum(p.recompute_flops for p in chosen))
    return StagePlan(device_memory_bytes, tuple(chosen),
                     None if shared is None else by_setting[shared][0].schedule, expressible,
                     megatron_flags(*shared) if shared is not None else "(no single setting fits every stage)",
                     gain)


PREDICTION_COLUMNS = ["rank", "stages", "schedule", "peak MiB", "static MiB", "held MiB", "in flight", "peak at"]


def prediction_rows(predictions: Sequence[Sequence[RankPrediction]]) -> list[list[str]]:
    """Table rows, by setting then rank (``PREDICTION_COLUMNS``)."""
    rows = []
    n = len(predictions[0]) if predictions else 0
    for i in range(n):
        for rank_preds in predictions:
            p = rank_preds[i]
            rows.append([str(p.rank), ",".join(map(str, p.stages)), p.schedule, mib(p.peak_bytes),
                         mib(p.static_bytes), mib(p.peak.held_bytes), str(p.peak.in_flight),
                         f"{p.peak.action} {p.peak.node}"])
    return rows


def prediction_json(config: ParallelConfig, p: RankPrediction) -> dict[str, Any]:
    """One JSON row of a predicted rank (bytes)."""
    return {"config": config.name, "schedule": p.schedule, "rank": p.rank, "stage": list(p.stages),
            "predicted_peak_bytes": p.peak_bytes, "static_bytes": p.static_bytes,
            "held_bytes": p.peak.held_bytes, "accumulator_bytes": p.peak.accumulator_bytes,
            "buffer_bytes": p.peak.buffer_bytes, "microbatch_bytes": p.peak.microbatch_bytes,
            "in_flight": p.peak.in_flight, "peak_action": p.peak.action, "peak_node": p.peak.node,
            "recompute_flops": p.recompute_flops}


def stage_plan_text(config: ParallelConfig, plan: StagePlan) -> str:
    """The plan as text: one row per rank, then the Megatron-LM flags or the
    per-stage plan and its gain."""
    rows = [[str(p.rank), ",".join(map(str, p.stages)), p.schedule, mib(p.peak_bytes), mib(p.static_bytes),
             mib(p.peak_bytes + p.static_bytes), f"{p.recompute_flops:.3g}"] for p in plan.chosen]
    lines = [f"{config.name}: least recompute per stage within {fmt_bytes(plan.device_memory_bytes)} "
             "(activation peak + parameters, buffers and batch; optimizer states not counted)",
             text_table(["rank", "stages", "schedule", "peak MiB", "static MiB", "total MiB", "recompute FLOPs"], rows)]
    if plan.expressible:
        lines.append(f"Megatron-LM: {plan.flags}")
    else:
        lines.append("Megatron-LM cannot express this plan (its recompute flags are one setting for every stage).")
        if plan.shared is not None:
            lines.append(f"Best single setting: {plan.shared} ({plan.flags}); the per-stage plan saves "
                         f"{plan.gain_flops:.3g} recompute FLOPs per step over it.")
        else:
            lines.append("No single Megatron setting fits every stage.")
    return "\n".join(lines)
