"""Measure FSDP2 ranks: eager ``fully_shard`` steps (every layer of the stack and the
root) on a real process group, against ``fsdp.predict_fsdp``.

Each rank (``launch.run_ranks``) traces its local step (its share of the batch, the
unsharded model) and predicts it, then shards the model, runs one warm-up and
``repeats`` measured steps under the CPU profiler's allocator events
(``measure.profile_memory_events``) and reports the peak and the maximum inside each
FSDP hook's ``record_function`` range (``FSDP::pre_forward (layers.2)`` ...), the
least over the repeats. Gradients: the full gradient gathered from the shards against
the single-process model (the mean over the ranks' batches), within
``distributed.SINGLE_PROCESS_RTOL``. Only ``none`` is measured: the eager FSDP2 step
has no recompute.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..recompute import schedule as schedules
from .distributed import SINGLE_PROCESS_RTOL, RunOptions, copy_for_reference
from .fsdp import predict_fsdp
from .launch import run_ranks
from ..measure.allocator_events import profile_memory_events, running_bytes
from ..models.shipped import build
from .hf_plans import rank_step_model
from .ranks import ParallelConfig, microbatches, validate
from ..graph.regions import assign_layers, find_layer_stack
from ..recompute.rewrite import rewrite
from ..graph.trace import trace_joint


@dataclasses.dataclass(frozen=True)
class FsdpRow:
    """One FSDP2 rank (bytes): predicted (``fsdp.predict_fsdp``) and measured peaks,
    the predicted and measured maximum inside each FSDP hook, and the gradients (the
    full gradient gathered from the shards against the single-process model: the
    mean over the ranks' batches, within ``SINGLE_PROCESS_RTOL``)."""

    config: str
    schedule: str
    rank: int
    predicted_peak_bytes: int
    predicted_where: str
    measured_peak_bytes: int
    measured_runs_bytes: tuple[int, ...]
    hooks: tuple[tuple[str, int, int], ...]  # (hook, predicted, measured maximum)
    static_bytes: int
    max_grad_diff_vs_single_process: float
    grads_equal: bool


def _hook_name(range_name: str) -> str | None:
    """``FSDP::pre_forward (layers.2)`` -> ``pre_forward(layer 2)``; root ranges have no
    module name; post-backward ranges of one unit are merged."""
    if not range_name.startswith("FSDP::"):
        return None
    kind, _, fqn = range_name[len("FSDP::"):].partition(" ")
    fqn = fqn.strip("()")
    if kind == "root_post_backward_callback":
        return "post_backward(root)"
    if kind.startswith("post_backward") and kind != "post_backward_accumulate":
        kind = "post_backward"
    if kind not in ("pre_forward", "pre_backward", "post_backward"):
        return None
    unit = "root" if not fqn else f"layer {fqn.rsplit('.', 1)[-1]}"
    return f"{kind}({unit})"


def _hook_maxima(events: list[Any]) -> dict[str, int]:
    """The largest running sum of allocated bytes inside each FSDP hook's ranges."""
    times, running = running_bytes(events)
    out: dict[str, int] = {}
    for e in events:
        name = _hook_name(e.name())
        if name is None:
            continue
        i0 = bisect.bisect_left(times, e.start_ns())
        i1 = bisect.bisect_right(times, e.start_ns() + e.duration_ns())
        before = running[i0 - 1] if i0 > 0 else 0
        out[name] = max(out.get(name, 0), before, *running[i0:i1])
    return out


def fsdp_rank_main(rank: int, world: int, config: ParallelConfig, options: RunOptions) -> FsdpRow:
    """One FSDP2 rank (``launch.run_ranks``): predict from its local step's trace, then
    ``fully_shard`` every layer and the root, warm up and measure eager steps."""
    model, inputs, _ = build(options.factory, **dict(options.factory_kwargs))
    model, inputs = rank_step_model(model, inputs)
    validate(config, model, inputs[0].shape[0], inputs[0].shape[1])
    shards = microbatches(inputs, world)
    local = shards[rank]
    stack_path, _ = find_layer_stack(model)
    joint = trace_joint(model, local, None)
    stack = assign_layers(joint, stack_path)
    pred = predict_fsdp(rewrite(joint, stack, schedules.none(stack.num_layers)), joint.primal_values,
                        joint.primal_kinds, joint.primal_labels, stack_path, stack.num_layers, world)
    del joint
    reference = copy_for_reference(model)
    for batch in shards:
        reference(*batch).backward()
    full = {n: p.grad / world for n, p in reference.named_parameters()}
    mesh = init_device_mesh(options.device, (world,))
    for layer in model.get_submodule(stack_path):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def once() -> None:
        model(*local).backward()

    peaks, hooks = [], {}
    for i in range(1 + options.repeats):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        if i == 0:
            once()
            continue
        events = profile_memory_events(once)
        peaks.append(max([0, *running_bytes(events)[1]]))
        for k, v in _hook_maxima(events).items():
            hooks[k] = min(hooks.get(k, v), v)  # the least over repeats, as the peak
    worst = 0.0
    for n, p in model.named_parameters():
        got = p.grad.full_tensor()
        worst = max(worst, float((got.double() - full[n].double()).abs().max()) / (float(full[n].abs().max()) or 1.0))
    return FsdpRow(config.name, "none", rank, pred.peak_bytes, pred.where, min(peaks), tuple(peaks),
                   tuple((h, v, hooks.get(h, -1)) for h, v in pred.hooks), pred.static_bytes, worst,
                   worst <= SINGLE_PROCESS_RTOL)


def measure_fsdp(config: ParallelConfig, options: RunOptions, deadline_s: float = 900,
                 start_method: str = "spawn") -> list[FsdpRow]:
    """Launch ``config.fsdp`` FSDP2 ranks and return their rows, by rank.

    Raises:
        RankFailed: a rank raised, died or hung (every rank is ended first).
    """
    backend = "nccl" if options.device == "cuda" else "gloo"
    results = run_ranks(fsdp_rank_main, config.fsdp, (config, options), deadline_s=deadline_s,
                        backend=backend, start_method=start_method)
    return [results[r] for r in sorted(results)]
