"""Measure every rank of a parallel step: run the rewritten stage graphs over real
process groups and compare with the prediction.

Each rank (``launch.run_ranks``) builds the model from its factory, traces its own
stages (``parallel.trace_rank``: the real process group, so the functional collectives
name it), rewrites them under each recompute schedule and runs one training step of
its pipeline schedule with ``pipeline_step``: the rank's actions in order, the stages'
forward / backward graphs run by ``measure.run_graph`` (each value freed after its last
use), activations and gradients sent with ``isend`` / received with ``irecv`` (a send
is waited after the next action's receive; distinct tags per stage boundary, direction
and microbatch). This is the runtime ``pipeline.compose`` models. One warm-up step,
then ``repeats`` measured steps, each under the CPU profiler's allocator events
(``measure.profiled_peak_cpu``, collector paused) or, on CUDA, ``max_memory_allocated``
above the start of the step.

Gradients: the accumulated gradients of every schedule are compared bit for bit with
those of ``none`` on the same rank, and with the single-process model (eager autograd
of the full model over the same microbatches; under TP the local shard, partial sums
of replicated parameters all-reduced over the tensor-parallel group), bitwise where no
reduction is split across ranks, else within ``SINGLE_PROCESS_RTOL`` (the sums run in
another order).

gloo on CPU: a collective's input and backend scratch are released by gloo's worker
thread at a time that varies from run to run (``costs.COLLECTIVE_RULES``), so a single
TP run can measure more than the prediction; rows carry every repeat and the minimum.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .launch import run_ranks
from ..measure.run import grads_bitwise_equal, profiled_peak_cpu, run_graph
from ..models.shipped import build
from .hf_plans import rank_step_model
from .ranks import ParallelConfig, StageGraph, microbatches, predict_rank, stage_inputs, stage_schedule, trace_rank
from .ranks import validate
from .pipeline_schedule import Action
from ..recompute.rewrite import RewrittenStep, rewrite

SINGLE_PROCESS_RTOL = 1e-5  # relative to the largest |gradient| of the parameter


@dataclasses.dataclass(frozen=True)
class RankRow:
    """One (configuration, recompute schedule, rank) of a measured run (bytes).

    Attributes:
        config: ``ParallelConfig.name``; schedule: the recompute schedule's provenance.
        rank, stages: the rank and the pipeline stages it holds.
        predicted_peak_bytes: ``pipeline.compose`` of this rank's own trace.
        measured_peak_bytes: the least of ``measured_runs_bytes``.
        measured_runs_bytes: the peak of every measured step.
        grads_bitwise_vs_none: gradients bitwise equal to this rank's ``none`` run.
        grads_bitwise_vs_single_process: bitwise equal to the single-process model.
        max_grad_diff_vs_single_process: largest |difference| from it.
        grads_equal: bitwise equal to ``none``, and equal to the single-process model
            (bitwise without TP, else within ``SINGLE_PROCESS_RTOL``).
        peak_action, peak_node: where the predicted peak is; in_flight: the most
            microbatches a stage of the rank held at once (predicted).
        static_bytes: parameters, buffers and inputs of its stages.
    """

    config: str
    schedule: str
    rank: int
    stages: tuple[int, ...]
    predicted_peak_bytes: int
    measured_peak_bytes: int
    measured_runs_bytes: tuple[int, ...]
    grads_bitwise_vs_none: bool
    grads_bitwise_vs_single_process: bool
    max_grad_diff_vs_single_process: float
    grads_equal: bool
    peak_action: str
    peak_node: str
    in_flight: int
    static_bytes: int


@dataclasses.dataclass
class _StageRun:
    """What ``pipeline_step`` needs of one stage."""

    graph: StageGraph
    step: RewrittenStep
    statics: list[Any]        # parameters, buffers, opaque primals (before the inputs)
    x_index: int | None       # primal index of the received activation
    tangent_shape: tuple[int, ...]
    tangent_dtype: torch.dtype
    device: torch.device


def _stage_run(graph: StageGraph, step: RewrittenStep) -> _StageRun:
    kinds = graph.joint.primal_kinds
    first_input = kinds.index("input")
    tangent = next(n for n in graph.joint.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents"))
    val = tangent.meta["val"]
    return _StageRun(graph, step, list(graph.joint.primal_values[:first_input]),
                     None if graph.first else first_input, tuple(val.shape), val.dtype,
                     graph.joint.primal_values[0].device)


def _tag(receiving_stage: int, kind: str, microbatch: int, m: int) -> int:
    return (receiving_stage * 2 + (0 if kind == "F" else 1)) * m + microbatch


def pipeline_step(config: ParallelConfig, rank: int, runs: dict[int, _StageRun],
                  mbs: Sequence[tuple[torch.Tensor, ...]], loss_tangent: torch.Tensor,
                  accumulators: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
    """One training step of ``rank``: its actions over all microbatches (module
    docstring). Returns stage -> accumulated parameter gradients (in ``param_indices``
    order). With ``accumulators`` (zeros allocated before the step: Megatron's static
    ``main_grad``) every backward's gradients are added into them and freed.
    """
    rank_step = _RankStep(config, rank, runs, mbs, loss_tangent, dict(accumulators or {}))
    for k, a in enumerate(config.actions(rank)):
        if a.kind == "F":
            rank_step.forward(k, a)
        else:
            rank_step.backward(k, a)
    rank_step.release_sends(None)
    return rank_step.acc


class _RankStep:
    """The state of one rank's step while ``pipeline_step`` runs its actions: what each
    stage keeps for backward per microbatch, the sends not yet waited, the accumulated
    gradients. Every tensor a method holds is deleted as soon as it is no longer
    needed, so that the graphs (``measure.run_graph``), not this runner, decide when a
    value dies."""

    def __init__(self, config: ParallelConfig, rank: int, runs: dict[int, _StageRun],
                 mbs: Sequence[tuple[torch.Tensor, ...]], loss_tangent: torch.Tensor,
                 acc: dict[int, list[Any]]) -> None:
        self.config, self.runs, self.mbs, self.loss_tangent, self.acc = config, runs, mbs, loss_tangent, acc
        self.m, self.tp_index = config.microbatches, config.coords(rank)[1]
        self.in_flight: dict[tuple[int, int], Any] = {}
        self.pending: list[tuple[int, Any, torch.Tensor]] = []  # (release action, work, tensor)
        self.releases = config.releases(rank)

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage`` in this rank's tensor-parallel position."""
        return (stage % self.config.pp) * self.config.tp + self.tp_index

    def release_sends(self, k: int | None) -> None:
        """Wait (and drop) the sends released at action k (None: all)."""
        keep = []
        for item in self.pending:
            if k is None or item[0] == k:
                item[1].wait()
            else:
                keep.append(item)
        self.pending[:] = keep
        del keep

    def forward(self, k: int, a: Action) -> None:
        """Action k, a forward: receive the activation, run the stage's forward graph,
        keep what backward reads, send the output on."""
        m, run = self.m, self.runs[a.stage]
        g, step = run.graph, run.step
        x = None
        if not g.first:
            x = torch.empty(g.boundary_shape, dtype=run.tangent_dtype, device=run.device)
            dist.irecv(x, self.rank_of(a.stage - 1), tag=_tag(a.stage, "F", a.microbatch, m)).wait()
        self.release_sends(k)
        args = [*run.statics, *stage_inputs(g.first, g.last, self.mbs[a.microbatch], x)]
        keep_x = x if (x is not None and run.x_index in step.backward_primal_indices) else None
        del x
        out = run_graph(step.forward, args)
        y, saved = out[0], out[step.num_fwd_outputs:]
        del out
        self.in_flight[(a.stage, a.microbatch)] = (saved, keep_x)
        del saved, keep_x
        if not g.last:
            work = dist.isend(y, self.rank_of(a.stage + 1), tag=_tag(a.stage + 1, "F", a.microbatch, m))
            self.pending.append((self.releases[k], work, y))
            del work
        del y

    def backward(self, k: int, a: Action) -> None:
        """Action k, a backward: receive the output gradient, run the stage's backward
        graph, send the input gradient back, add the parameter gradients up."""
        m, run = self.m, self.runs[a.stage]
        g, step = run.graph, run.step
        if g.last:
            tangent = self.loss_tangent
        else:
            tangent = torch.empty(run.tangent_shape, dtype=run.tangent_dtype, device=run.device)
            dist.irecv(tangent, self.rank_of(a.stage + 1), tag=_tag(a.stage, "B", a.microbatch, m)).wait()
        self.release_sends(k)
        saved, x = self.in_flight.pop((a.stage, a.microbatch))
        primals = [*run.statics, *stage_inputs(g.first, g.last, self.mbs[a.microbatch], x)]
        bw_args = [*saved, *[primals[i] for i in step.backward_primal_indices], tangent]
        del saved, x, primals, tangent
        grads = run_graph(step.backward, bw_args)
        if not g.first:
            gx = grads[run.x_index]
            work = dist.isend(gx, self.rank_of(a.stage - 1), tag=_tag(a.stage - 1, "B", a.microbatch, m))
            self.pending.append((self.releases[k], work, gx))
            del work
            del gx
        new = [grads[i] for i in g.joint.param_indices]
        del grads
        if a.stage not in self.acc:
            self.acc[a.stage] = new
        else:
            grad = None
            for i, grad in enumerate(new):
                if grad is not None:
                    self.acc[a.stage][i].add_(grad)
            del grad  # a loop variable would keep the last gradient alive
        del new


class _SettledCollectives:
    """Measurement-only run of a step's functional collectives: each collective gets a
    view of its input that only we and the c10d Work reference; at its wait_tensor we
    wait, then spin until that view and the output are referenced by us alone, i.e.
    gloo's worker thread has destroyed the Work and everything it owned (its input and
    output references, gloo's copies): had the executor dropped the output first, the
    worker's drop would free it on a thread the profiler does not record.
    The Work's buffers are then freed before the graph goes on, as the liveness rules
    assume, instead of whenever the worker thread gets to drop its reference."""

    def __init__(self, timeout_s: float = 10.0):
        self.views: dict[int, torch.Tensor] = {}
        self.timeout_s = timeout_s

    def collective(self, op: Any) -> Any:
        def run(inp: torch.Tensor, *rest: Any) -> torch.Tensor:
            view = inp.view(inp.shape)
            out = op(view, *rest)
            self.views[id(out)] = view
            return out

        return run

    def wait(self, t: torch.Tensor) -> torch.Tensor:
        import time

        out = torch.ops._c10d_functional.wait_tensor.default(t)
        view = self.views.pop(id(t), None)
        t0 = time.monotonic()
        for held in (view, out):  # the input's view, then the output (an all_reduce's Work holds it)
            while held is not None and held._use_count() > 1 and time.monotonic() - t0 < self.timeout_s:
                time.sleep(0)
        del view
        return out

    def step(self, step: RewrittenStep) -> RewrittenStep:
        """A copy of ``step`` whose collectives run settled (the graphs are copied)."""

        def patch(gm: Any) -> Any:
            gm = copy.deepcopy(gm)
            for n in gm.graph.nodes:
                if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
                    continue
                if n.target.namespace != "_c10d_functional":
                    continue
                n.target = self.wait if n.target._schema.name.endswith("wait_tensor") else self.collective(n.target)
            gm.recompile()
            return gm

        return dataclasses.replace(step, forward=patch(step.forward), backward=patch(step.backward))


def _single_process_grads(model: torch.nn.Module, mbs: Sequence[tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    """Eager autograd of the full model over the microbatches (losses summed)."""
    ref = copy_for_reference(model)
    for mb in mbs:
        ref(*mb).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def copy_for_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with no gradients, for the single-process reference step."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    return ref


def _expected_local(graph: StageGraph, label: str, full: torch.Tensor, tp: int, tp_index: int) -> tuple[Any, bool]:
    """The single-process gradient of one stage parameter as this rank holds it:
    ``(tensor, maybe_partial)``: the shard of a sharded DTensor; for a replicated
    DTensor the full gradient, which the rank holds whole where the parameter's input
    is replicated (a row-parallel bias) and as a partial sum where it is sharded (a
    sequence-parallel norm): ``_compare`` takes the held or the summed one."""
    param = dict(graph.module.named_parameters())[label]
    if not isinstance(param, DTensor):
        return full, False
    placement = param.placements[0]
    if isinstance(placement, Shard):
        return full.chunk(tp, dim=placement.dim)[tp_index], False
    return full, isinstance(placement, Replicate)


def _compare(graphs: dict[int, StageGraph], grads: dict[int, list[Any]], reference: dict[str, Any],
             config: ParallelConfig, rank: int, tp_group: Any) -> tuple[bool, float]:
    """(bitwise equal, largest |difference| relative to the parameter's largest |grad|)
    of a rank's gradients against the single-process model."""
    bitwise, worst = True, 0.0
    for s, g in graphs.items():
        labels = [g.joint.primal_labels[i] for i in g.joint.param_indices]
        for label, got in zip(labels, grads[s]):
            full = reference[g.param_names[label]]
            want, partial = _expected_local(g, label, full, config.tp, config.coords(rank)[1])
            if got.shape != want.shape and got.shape == full.shape:
                # torch 2.13: the AOT-traced backward of a row-parallel embedding is
                # embedding_dense_backward over the full vocabulary (num_weights global),
                # so the rank returns the whole gradient, not its shard
                want = full
            if partial:  # summed on every rank alike (a collective); the held or the summed one counts
                summed = got.clone()
                dist.all_reduce(summed, group=tp_group)
                got = min((got, summed), key=lambda t: float((t.double() - want.double()).abs().max()))
            if not grads_bitwise_equal([got], [want]):
                bitwise = False
                scale = float(want.abs().max()) or 1.0
                worst = max(worst, float((got.double() - want.double()).abs().max()) / scale)
    return bitwise, worst


def _tp_group(graphs: Any) -> Any:
    """The tensor-parallel process group (that of any DTensor parameter), or None."""
    for g in graphs:
        for p in g.module.parameters():
            if isinstance(p, DTensor):
                return p.device_mesh.get_group()
    return None


def _grads_equal(a: dict[int, list[Any]], b: dict[int, list[Any]]) -> bool:
    return all(grads_bitwise_equal(a[s], b[s]) for s in a)


def _measure(fn: Any, device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return profiled_peak_cpu(fn)[0]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How ``rank_main`` runs.

    Attributes:
        factory: ``module:factory`` of the model; factory_kwargs: its arguments.
        schedules: ``(method, K or N)`` recompute schedules, applied to every stage;
            ``("none", None)`` is run first whatever the order.
        repeats: measured steps per schedule (the least is ``measured_peak_bytes``).
        grad_accumulator: ``"in_step"`` or ``"static"`` (``pipeline.compose``).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
    """

    factory: str
    factory_kwargs: tuple[tuple[str, Any], ...]
    schedules: tuple[tuple[str, int | None], ...]
    repeats: int = 1
    grad_accumulator: str = "in_step"
    device: str = "cpu"


def rank_main(rank: int, world: int, config: ParallelConfig, options: RunOptions) -> list[RankRow]:
    """What each rank runs (``launch.run_ranks``): trace, then for every schedule
    predict, warm up, measure and compare gradients. Returns one RankRow per schedule."""
    model, inputs, _ = build(options.factory, **dict(options.factory_kwargs))
    model, inputs = rank_step_model(model, inputs)
    validate(config, model, inputs[0].shape[0], inputs[0].shape[1])
    if options.device == "cuda":  # nccl: one GPU per rank (not run on this project's CPU machines)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    graphs = {g.stage: g for g in trace_rank(model, inputs, config, rank)}
    mbs = microbatches(inputs, config.microbatches)
    reference = _single_process_grads(model, mbs)
    tp_group = _tp_group(graphs.values())
    loss_tangent = torch.ones((), device=options.device)
    settle = _SettledCollectives()
    todo = [("none", None)] + [s for s in options.schedules if s != ("none", None)]
    rows, none_grads = [], None
    for method, k in todo:
        pred = predict_rank(list(graphs.values()), config, rank, method, k,
                            "cuda" if options.device == "cuda" else "cpu", options.grad_accumulator)
        runs = {s: _stage_run(g, settle.step(rewrite(g.joint, g.stack, stage_schedule(method, k, g.stack.num_layers))))
                for s, g in graphs.items()}
        result: dict[str, Any] = {}

        def once() -> None:
            accs = None
            if options.grad_accumulator == "static":
                accs = result["static"]
            result["grads"] = pipeline_step(config, rank, runs, mbs, loss_tangent, accs)

        peaks = []
        for i in range(1 + options.repeats):
            if options.grad_accumulator == "static":
                result["static"] = {s: [torch.zeros_like(g.joint.primal_values[j]) for j in g.joint.param_indices]
                                    for s, g in graphs.items()}
            result.pop("grads", None)  # freed here, not inside the measured window
            dist.barrier()
            if i == 0:
                once()
            else:
                peaks.append(_measure(once, options.device))
        grads = result["grads"]
        if none_grads is None:
            none_grads = grads
        bitwise_sp, diff = _compare(graphs, grads, reference, config, rank, tp_group)
        vs_none = _grads_equal(grads, none_grads)
        close = bitwise_sp if config.tp == 1 else diff <= SINGLE_PROCESS_RTOL
        if (method, k) in options.schedules:
            rows.append(RankRow(config.name, pred.schedule, rank, pred.stages, pred.peak_bytes, min(peaks),
                                tuple(peaks), vs_none, bitwise_sp, diff, vs_none and close, pred.peak.action,
                                pred.peak.node, pred.peak.in_flight, pred.static_bytes))
    return rows


def measure_config(config: ParallelConfig, options: RunOptions, deadline_s: float = 900,
                   start_method: str = "spawn") -> list[RankRow]:
    """Launch ``config.world_size`` ranks (``launch.run_ranks``) and return every rank's
    rows, by schedule then rank.

    Raises:
        RankFailed: a rank raised, died or hung (every rank is ended first).
    """
    backend = "nccl" if options.device == "cuda" else "gloo"
    results = run_ranks(rank_main, config.world_size, (config, options), deadline_s=deadline_s,
                        backend=backend, start_method=start_method)
    rows = [r for rank in sorted(results) for r in results[rank]]
    order = {s: i for i, s in enumerate(dict.fromkeys(r.schedule for r in rows))}
    return sorted(rows, key=lambda r: (order[r.schedule], r.rank))
