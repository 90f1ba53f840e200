"""Per-rank graphs of a parallelised model: pipeline stages, tensor / sequence parallelism.

A ``ParallelConfig`` (Megatron-LM's sizes: ``--tensor-model-parallel-size``,
``--sequence-parallel``, ``--pipeline-model-parallel-size``,
``--virtual-pipeline-model-parallel-size``, microbatches, plus FSDP2's data-parallel
size) is validated against the model; ``trace_rank`` builds rank r's pipeline stages
(``stages.split_stages``: Megatron's even split, the embedding on the first stage, the head and
loss on the last), applies the model's tensor-parallel plan
(``torch.distributed.tensor.parallel.parallelize_module``, torchtitan's recipe) over
the rank's tensor-parallel group and traces each stage with its real boundary
(``trace_joint(..., output="activation")``, through the one builder of a traced step,
``evaluate.traced_step.trace_step``): local shapes, functional collectives.

Ranks are ordered with tensor parallelism innermost: rank = pp_index * tp + tp_index
(Megatron-LM's default order). Tracing needs a process group of the full world: the
real one inside a rank, or ``fake_process_group(rank, world)`` to plan every rank in
one process without communicating (``torch.testing._internal.distributed.fake_pg``;
the graph equals a real rank's, node for node).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import sys
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..recompute import schedule as schedules
from ..graph.costs import node_flops
from ..errors import InvalidOption, LayerStackNotFound
from .pipeline import RankPeak, StageProfile, compose, stage_profile
from .stages import StageModule, middle_stage_key, numbered_facts, split_stages, stack_of
from .pipeline_schedule import (
    PIPELINE_SCHEDULES,
    Action,
    rank_actions,
    send_releases,
    stage_layers,
    validate_schedule,
)
from ..graph.regions import LayerStack, find_layer_stack
from ..recompute.rewrite import rewrite
from ..graph.trace import JointGraph
from ..evaluate.traced_step import StepOptions, trace_step


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions of one training step.

    Attributes:
        tp: tensor-parallel size t (Megatron ``--tensor-model-parallel-size``).
        sp: sequence parallelism (``--sequence-parallel``; needs t >= 2).
        pp: pipeline-parallel size p.
        microbatches: m, microbatches per step (the batch is split into m).
        pipeline_schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
        vpp: model chunks per rank v (interleaved only).
        fsdp: FSDP2 data-parallel size d (``fully_shard`` per layer and the root).
    """

    tp: int = 1
    sp: bool = False
    pp: int = 1
    microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    vpp: int = 1
    fsdp: int = 1

    @property
    def world_size(self) -> int:
        """Ranks in the step: t x p x d."""
        return self.tp * self.pp * self.fsdp

    @property
    def num_stages(self) -> int:
        """Pipeline stages p x v."""
        return self.pp * self.vpp

    @property
    def name(self) -> str:
        """A short name: ``tp2-sp``, ``pp2-1f1b-m4``, ``tp2xpp2-1f1b-m4``, ``fsdp2``."""
        parts = []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("-sp" if self.sp else ""))
        if self.pp > 1:
            sched = self.pipeline_schedule + (f"-v{self.vpp}" if self.vpp > 1 else "")
            parts.append(f"pp{self.pp}-{sched}-m{self.microbatches}")
        if self.fsdp > 1:
            parts.append(f"fsdp{self.fsdp}")
        return "x".join(parts) or "single"

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_index, tp_index)`` of ``rank`` (tensor parallelism innermost)."""
        return rank // self.tp, rank % self.tp

    def stages_of(self, rank: int) -> list[int]:
        """Global stages held by ``rank``: pp_index + c * p for c = 0..v-1."""
        pp_index = self.coords(rank)[0]
        return [c * self.pp + pp_index for c in range(self.vpp)]

    def actions(self, rank: int) -> list[Action]:
        """The rank's forward/backward order (``pipeline_schedule.rank_actions``)."""
        pp_index = self.coords(rank)[0]
        if self.pp == 1:
            return [a for j in range(self.microbatches) for a in (Action(0, "F", j), Action(0, "B", j))]
        return rank_actions(self.pipeline_schedule, pp_index, self.pp, self.microbatches, self.vpp)


    def releases(self, rank: int) -> list[int]:
        """Where the rank waits each action's send (``pipeline_schedule.send_releases``)."""
        if self.pp == 1:
            return [k + 1 for k in range(2 * self.microbatches)]
        return list(_releases(self.pipeline_schedule, self.pp, self.microbatches, self.vpp)[self.coords(rank)[0]])


@functools.lru_cache(maxsize=64)
def _releases(schedule: str, p: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    acts = [rank_actions(schedule, r, p, m, v) for r in range(p)]
    return tuple(tuple(r) for r in send_releases(acts, p * v))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(config: ParallelConfig, model: nn.Module, batch: int, seq: int | None = None) -> None:
    """Check ``config`` against the model and the global batch.

    Raises:
        InvalidOption: a size below 1; TP not dividing the heads, key/value heads,
            hidden, FFN or vocabulary size, or the sequence under SP; SP without TP;
            a model without ``tensor_parallel_plan`` under TP, or with neither ``pipeline_layout`` nor a layer stack under PP
            (``stages.stack_of``); PP x VPP not dividing the layers (or larger);
            microbatches not dividing the batch, or fewer than the stages under 1F1B;
            FSDP on a model without a layer stack (nothing to wrap per layer), or FSDP
            combined with TP / PP. Each message names the setting and its legal values.
    """
    for name in ("tp", "pp", "microbatches", "vpp", "fsdp"):
        if getattr(config, name) < 1:
            raise InvalidOption(f"--{name.replace('_', '-')} {getattr(config, name)}: must be 1 or more")
    if config.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise InvalidOption(f"--pipeline-schedule {config.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}")
    if config.sp and config.tp < 2:
        raise InvalidOption("--sp (sequence parallelism) shards along the tensor-parallel group: it needs --tp 2 or more")
    if config.tp > 1:
        _validate_tp(config, model, seq)
    if config.pp > 1 or config.vpp > 1:
        _, num_layers = stack_of(model)
        stage_layers(num_layers, config.num_stages)
        validate_schedule(config.pipeline_schedule, config.pp, config.microbatches, config.vpp)
    if batch % config.microbatches:
        raise InvalidOption(f"--microbatches {config.microbatches} does not divide the global batch {batch}: "
                            f"legal values are {_divisors(batch)}, or a --batch that {config.microbatches} divides "
                            f"(e.g. --batch {config.microbatches * max(1, batch // config.microbatches)})")
    if config.fsdp > 1:
        if config.tp > 1 or config.pp > 1:
            raise InvalidOption("--fsdp together with --tp or --pp is not supported: give FSDP alone")
        try:
            find_layer_stack(model)
        except LayerStackNotFound as e:
            raise InvalidOption(f"--fsdp wraps each layer with fully_shard, but {e}") from e
        if batch % config.fsdp:
            raise InvalidOption(f"--fsdp {config.fsdp} does not divide the global batch {batch} (one shard of the "
                                f"batch per rank): legal values are {_divisors(batch)}")


def _validate_tp(config: ParallelConfig, model: nn.Module, seq: int | None) -> None:
    if not hasattr(model, "tensor_parallel_plan"):
        raise InvalidOption(f"--tp needs a model with a tensor-parallel plan: {type(model).__name__} has no "
                            "tensor_parallel_plan (e.g. remat_pass.models:tiny_llama) nor transformers' _tp_plan")
    model.tensor_parallel_plan(config.sp)  # a plan it cannot apply is refused here, named
    shape = getattr(model, "shape", {})
    for key in ("heads", "kv_heads", "dim", "ffn", "vocab"):
        n = shape.get(key)
        if n is not None and n % config.tp:
            legal = _divisors(math.gcd(*[shape[k] for k in ("heads", "kv_heads", "dim", "ffn", "vocab") if k in shape]))
            raise InvalidOption(f"--tp {config.tp} does not divide the model's {key} = {n} (tensor parallelism "
                                f"splits it across ranks); legal --tp values: {legal}")
    if config.sp and seq is not None and seq % config.tp:
        raise InvalidOption(f"--sp shards the sequence: --tp {config.tp} does not divide seq = {seq}; legal --tp "
                            f"values: {[d for d in _divisors(seq) if d > 1]}")


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A fake default process group (rank ``rank`` of ``world_size``) for tracing a
    rank's graph in this process: collectives return without communicating.

    Raises:
        InvalidOption: a process group already exists in this process.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InvalidOption("a process group already exists in this process; plan ranks in a fresh process")
    excepthook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]: " (once per rank traced)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation and redistribution caches: their entries
    hold DeviceMeshes (equal by shape, not by process group), so the next rank traced
    in this process would reuse the previous rank's meshes and the names of process
    groups destroyed with it ("Could not resolve the process group registered under
    the name 3" when a TP x PP rank's groups are named differently)."""
    from torch.distributed.tensor import debug as dtensor_debug
    from torch.distributed.tensor import _redistribute

    dtensor_debug._clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def tp_mesh(config: ParallelConfig, device: str = "cpu") -> Any:
    """The rank's tensor-parallel DeviceMesh (None without TP); call it on every rank
    of an initialised process group (it creates the subgroups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if config.tp == 1:
        return None
    if config.pp == 1:
        return init_device_mesh(device, (config.tp,), mesh_dim_names=("tp",))
    return init_device_mesh(device, (config.pp, config.tp), mesh_dim_names=("pp", "tp"))["tp"]


def apply_tensor_parallel(module: nn.Module, mesh: Any, sequence_parallel: bool) -> nn.Module:
    """Parallelise ``module`` in place with its ``tensor_parallel_plan`` over ``mesh``."""
    from torch.distributed.tensor.parallel import parallelize_module

    top, per_layer = module.tensor_parallel_plan(sequence_parallel)
    if top:
        parallelize_module(module, mesh, top)
    if per_layer:
        for layer in module.get_submodule(module.pipeline_layout.stack):
            parallelize_module(layer, mesh, per_layer)
    return module


def microbatches(inputs: Any, m: int) -> list[tuple[torch.Tensor, ...]]:
    """Split a tuple of batch-first tensors into ``m`` microbatches (``torch.chunk``)."""
    tensors = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    parts = [t.chunk(m, dim=0) for t in tensors]
    return [tuple(p[j] for p in parts) for j in range(m)]


@dataclasses.dataclass
class StageGraph:
    """One pipeline stage as rank r traced it.

    Attributes:
        stage: global stage index; first / last: its position.
        module: the stage's module (tensor-parallel when t > 1).
        joint: its joint graph; stack: its layer stack (L / (p v) layers).
        param_names: the stage's parameter names -> the full model's.
        boundary_shape: shape of the activation it receives ([] on the first stage).
    """

    stage: int
    first: bool
    last: bool
    module: nn.Module
    joint: JointGraph
    stack: LayerStack
    param_names: dict[str, str]
    boundary_shape: tuple[int, ...]


def stage_inputs(first: bool, last: bool, microbatch: tuple[torch.Tensor, ...],
                 activation: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A stage's inputs for one microbatch: the token ids on the first stage, the
    received activation on the others; the targets on the last."""
    ids, targets = microbatch[0], microbatch[1] if len(microbatch) > 1 else None
    head = (ids,) if first else (activation,)
    return head + ((targets,) if last and targets is not None else ())


def trace_rank(model: nn.Module, inputs: Any, config: ParallelConfig, rank: int,
               alike_stages: dict[Any, StageGraph] | None = None) -> list[StageGraph]:
    """Rank ``rank``'s pipeline stages, parallelised and traced (module docstring).

    Needs an initialised default process group of ``config.world_size`` ranks (real,
    or ``fake_process_group``).

    Args:
        model: the full model (weights as on every rank); it is copied, not changed.
        inputs: the global batch ``(ids, targets)``; each stage is traced on
            microbatch 0.
        config: validated with ``validate`` first.
        rank: the global rank.
        alike_stages: None, or a cache shared by the calls of one prediction: a middle
            stage (neither first nor last) whose ``stages.middle_stage_key`` is in it is
            not traced again; its graph stands for this stage (the predictions need
            only its shapes; its module and parameter names are this stage's own).

    Returns:
        One StageGraph per stage the rank holds, in stage order.
    """
    device = next(model.parameters()).device
    mesh = tp_mesh(config, "cpu" if device.type == "meta" else device.type)  # a meta model: its fakes are CPU
    mb = microbatches(inputs, config.microbatches)[0]
    out = []
    stages = config.stages_of(rank)
    if config.num_stages == 1:
        path, _ = stack_of(model) if hasattr(model, "pipeline_layout") else (None, 0)
        pieces = [StageModule(0, copy.deepcopy(model), {n: n for n, _ in model.named_parameters()}, path, (), None)]
    else:
        pieces = split_stages(model, mb, stages, config.num_stages)
    numbered = numbered_facts(model) if alike_stages is not None else set()
    for piece in pieces:
        s, module = piece.stage, piece.module
        first, last = s == 0, s == config.num_stages - 1
        if mesh is not None:
            apply_tensor_parallel(module, mesh, config.sp)
        key = middle_stage_key(piece, numbered) if alike_stages is not None and not (first or last) else None
        if key in (alike_stages or {}):
            out.append(dataclasses.replace(alike_stages[key], stage=s, module=module, param_names=piece.param_names))
            continue
        shape: tuple[int, ...] = ()
        x = None
        if not first:
            b, seq, *rest = piece.boundary_shape
            shape = (b, seq // config.tp if config.sp else seq, *rest)
            x = torch.randn(shape, dtype=piece.boundary_dtype, generator=torch.Generator().manual_seed(s))
            x = x.to(device).requires_grad_()
        traced = trace_step(StepOptions(
            model=module, example_inputs=stage_inputs(first, last, mb, x), output="loss" if last else "activation",
            stack=piece.stack))
        out.append(StageGraph(s, first, last, module, traced.joint, traced.stack, piece.param_names, shape))
        if key is not None:
            alike_stages[key] = out[-1]
    return out


@dataclasses.dataclass(frozen=True)
class RankPrediction:
    """The predicted step of one rank under one recompute schedule.

    Attributes:
        rank: global rank; stages: the stages it holds.
        schedule: the recompute schedule's provenance (applied to every stage).
        peak: the composed peak (``pipeline.RankPeak``).
        static_bytes: parameters, buffers and inputs of its stages (local shards).
        profiles: stage -> StageProfile.
        recompute_flops: FLOPs recomputed in the rank's step (all microbatches).
    """

    rank: int
    stages: tuple[int, ...]
    schedule: str
    peak: RankPeak
    static_bytes: int
    profiles: dict[int, StageProfile]
    recompute_flops: int = 0

    @property
    def peak_bytes(self) -> int:
        """Predicted peak activation bytes of the rank's step."""
        return self.peak.peak_bytes


def stage_schedule(method: str, recompute_num_layers: int | None, num_layers: int) -> schedules.Schedule:
    """The recompute schedule of one stage (Megatron-LM applies ``--recompute-method``
    and ``--recompute-num-layers`` per pipeline stage, to its L / p layers)."""
    return schedules.make(method, recompute_num_layers, num_layers)


def predict_rank(stage_graphs: list[StageGraph], config: ParallelConfig, rank: int, method: str,
                 recompute_num_layers: int | None = None, allocator: str = "cpu",
                 grad_accumulator: str = "in_step", threads: int | None = None,
                 profile_cache: dict[Any, tuple[JointGraph, StageProfile, int]] | None = None) -> RankPrediction:
    """Rewrite each of the rank's stages under the schedule and compose its peak.

    ``threads``: the rank's intra-op threads (``stage_profile``); None: this process's.
    ``profile_cache``: None, or a dict shared by the calls of one prediction: a stage
    whose joint graph (the same object: ``trace_rank``'s ``alike_stages``), position
    and setting are in it takes that StageProfile (renumbered) and recompute FLOPs
    instead of being rewritten again (the cache holds the joint graph, so its ``id``
    is not reused while the cache lives); the composition is still the rank's own.

    Raises:
        InvalidSchedule: K / N outside the stage's layers.
    """
    profiles = {}
    provenance = ""
    flops = 0
    for sg in stage_graphs:
        sched = stage_schedule(method, recompute_num_layers, sg.stack.num_layers)
        provenance = sched.provenance
        key = (id(sg.joint), sg.first, sg.last, method, recompute_num_layers, allocator, threads)
        if profile_cache is not None and key in profile_cache:
            _, profile, stage_flops = profile_cache[key]
            profiles[sg.stage] = dataclasses.replace(profile, stage=sg.stage)
            flops += stage_flops
            continue
        step = rewrite(sg.joint, sg.stack, sched)
        profiles[sg.stage] = stage_profile(step, sg.joint.primal_kinds, sg.stage, sg.first, sg.last, allocator,
                                           threads)
        stage_flops = sum(int(node_flops(n)) for n in step.backward.graph.nodes
                          if step.kind_of.get(n.name) == "recompute")
        flops += stage_flops
        if profile_cache is not None:
            profile_cache[key] = (sg.joint, profiles[sg.stage], stage_flops)
    peak = compose(profiles, config.actions(rank), config.releases(rank), grad_accumulator)
    static = sum(p.static_bytes for p in profiles.values())
    return RankPrediction(rank, tuple(profiles), provenance, peak, static, profiles, flops * config.microbatches)
