"""A training step as the command line describes it, ready to predict and plan.

``load_workload(WorkloadOptions)`` builds the model (a factory, or a ``transformers``
config file; with weights, or without on the meta device; in a dtype or under
autocast) and traces it for the target (the CPU, or a CUDA GPU modelled with
``cuda_target``), both by the one builder (``traced_step.trace_step``, given
``WorkloadOptions.step_options``), and adds the static memory (parameters, optimizer
states, master weights, workspaces) and the device's activation budget. Every check of
the input runs before anything is traced.

Two ways to analyse the step:

- the whole model is traced (``sweep.Session``): a real model on the CPU target can
  also be run and measured; a fake one (no weights, or the CUDA target on a machine
  without a GPU) is predicted only;
- a config model of more than ``layer_roles.TEMPLATE_LAYERS`` identical layers
  without weights is traced with that many layers and the L-layer stack is analysed by
  ``layer_reuse.ReusedLayers`` (exact, and fast at 70B scale); ``trace_all_layers``
  traces every layer instead.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

from ..recompute import schedule as schedules
from ..memory.calibration import CalibrationOptions
from ..models.configs import ConfigError, available_memory_bytes
from ..memory.cuda_target import GPUS, CudaAllocatorModel
from ..formatting import fmt_bytes, parse_bytes
from ..liveness.layer_reuse import ReusedLayers, ReusedLayersModel
from ..liveness.timeline import MemoryReport, analyze
from ..recompute.rewrite import rewrite
from ..plan.planner import Planner
from ..recompute.schedule import Schedule
from ..memory.static_memory import StaticMemory, StaticOptions, activation_budget, static_memory, static_tensors
from .schedule_result import ScheduleResult, predicted_result
from .session import Session
from .traced_step import DEFAULT_MODEL, TARGETS, StepOptions, TracedStep, check_target, trace_step
from ..graph.trace import JointGraph

__all__ = ["DEFAULT_MODEL", "TARGETS", "Workload", "WorkloadOptions", "check_options", "fits", "load_workload"]


@dataclasses.dataclass(frozen=True)
class WorkloadOptions:
    """What to build, for which device, beside which static memory (frozen).

    Attributes:
        model: a factory ``module:attribute`` (ignored with ``config``).
        config: a ``transformers`` config JSON file.
        task: ``configs.TASKS``; None: from the config.
        meta: build without weights (predicted only).
        dtype: parameter dtype (``float32``, ``bfloat16``, ``float16``); None: as built.
        autocast: run the forward under autocast in this dtype (parameters stay fp32).
        batch, seq, layers: the example batch and the number of layers (None: the
            factory's or config's own; a config's batch defaults to 1, seq to 128).
        stack: the layer stacks' module paths (None: every stack found).
        calibrate: calibrate op scratch on this CPU (a step with weights on the CPU
            target; ``calibration``); False: the formula table only.
        calibration_cache: the calibration cache's folder (None: the default).
        seed: weights, token ids and dropout masks.
        target: ``"cpu"`` or ``"cuda"``; gpu: a key of ``cuda_target.GPUS``.
        optimizer, master_weights: ``static_memory.StaticOptions``.
        device_memory: the device's memory as text (``80GiB``); None: unknown.
        trace_all_layers: trace every layer even when layers could be reused.
        allocator: count storages as this allocator does (``"cpu"`` / ``"cuda"``;
            default: the target's); ``cuda`` with the CPU target keeps the CPU trace.
        factory_kwargs: more keyword arguments of the factory, as ``(name, value)`` pairs
            (``remat-pass megatron`` passes a Megatron-LM command's model shape).
        routing_capacity: a mixture-of-experts model predicted for the worst routing
            with at most this many tokens per expert (``StepOptions``).
    """

    model: str = DEFAULT_MODEL
    config: str | None = None
    task: str | None = None
    meta: bool = False
    dtype: str | None = None
    autocast: str | None = None
    batch: int | None = None
    seq: int | None = None
    layers: int | None = None
    stack: tuple[str, ...] | None = None
    calibrate: bool = True
    calibration_cache: str | None = None
    seed: int = 0
    target: str = "cpu"
    gpu: str = "h100"
    optimizer: str = "none"
    master_weights: bool = False
    device_memory: str | None = None
    trace_all_layers: bool = False
    allocator: str | None = None
    factory_kwargs: tuple[tuple[str, Any], ...] = ()
    routing_capacity: int | None = None

    def step_options(self) -> StepOptions:
        """What to build and trace, for the one builder (``traced_step.trace_step``)."""
        return StepOptions(model=self.model, config=self.config, task=self.task, dtype=self.dtype,
                           autocast=self.autocast, batch=self.batch, seq=self.seq, layers=self.layers,
                           meta=self.meta, target=self.target, gpu=self.gpu, stack=self.stack,
                           reuse_layers=not self.trace_all_layers, allocator=self.allocator, seed=self.seed,
                           factory_kwargs=dict(self.factory_kwargs), routing_capacity=self.routing_capacity)


def check_options(o: WorkloadOptions) -> int | None:
    """Every check that needs no model: returns the device memory in bytes (or None).

    Raises:
        ConfigError: an unknown target, GPU or optimizer, a contradiction (autocast with
            a non-fp32 dtype, master weights without an optimizer), or a device memory
            that is not a size.
    """
    check_target(o.target, o.gpu)
    StaticOptions(o.optimizer)  # raises ValueError for an unknown optimizer
    if o.autocast is not None and o.dtype not in (None, "float32"):
        raise ConfigError(f"--autocast {o.autocast} keeps fp32 parameters; it contradicts --dtype {o.dtype}")
    if o.autocast is not None and o.target == "cuda":
        raise ConfigError(
            "--autocast with --target cuda is not modelled: CUDA's autocast runs softmax, layer_norm, pow, "
            "rsqrt, exp, sum and others in fp32 where CPU autocast does not (aten/src/ATen/autocast_mode.cpp), "
            "and this CPU build cannot trace CUDA autocast; use --dtype bfloat16, or --target cpu")
    if o.allocator not in (None, "cpu", "cuda") or (o.target == "cuda" and o.allocator == "cpu"):
        raise ConfigError(f"--allocator {o.allocator} contradicts --target {o.target}")
    if o.master_weights and o.optimizer == "none":
        raise ConfigError("--master-weights keeps an fp32 copy for the optimizer: give --optimizer too")
    if o.device_memory is None:
        return None
    try:
        size = parse_bytes(o.device_memory)
    except ValueError as e:
        raise ConfigError(f"--device-memory {o.device_memory!r}: {e}") from e
    if size <= 0:
        raise ConfigError(f"--device-memory {o.device_memory!r} must be a positive size such as 80GiB")
    return size


@dataclasses.dataclass
class Workload:
    """A traced step with its static memory (see the module docstring).

    Attributes:
        options: what was asked for.
        step: the traced step (``traced_step.trace_step``; the template's when layers
            are reused).
        session: the whole step's Session (None when layers are reused).
        allocator: ``"cpu"`` or ``"cuda"`` (the target's).
        static: the static memory.
        device_memory_bytes: the device's memory (None: not given).
        description: what was built and traced, for people.
    """

    options: WorkloadOptions
    step: TracedStep
    session: Session | None
    allocator: str
    static: StaticMemory
    device_memory_bytes: int | None
    description: str

    @property
    def reuse(self) -> ReusedLayers | None:
        """The L-layer stack analysed from a template (None when traced whole)."""
        return self.step.reuse

    @property
    def num_layers(self) -> int:
        """L."""
        return sum(self.layers_per_stack)

    @property
    def layers_per_stack(self) -> tuple[int, ...]:
        """L of each layer stack, in chain order (one entry for one stack)."""
        return self.step.layers_per_stack

    @property
    def stack_path(self) -> str:
        """The layer stack's module path."""
        return self.step.stack.path

    @property
    def predicted_only(self) -> bool:
        """Nothing can be run: every figure is predicted."""
        return self.step.predicted_only

    @property
    def joint(self) -> JointGraph:
        """The traced joint graph (the template's when layers are reused)."""
        return self.step.joint

    def report(self, schedule: Schedule) -> MemoryReport:
        """The predicted MemoryReport of ``schedule`` under the target's allocator."""
        if self.session is None:
            return self.step.reuse.report(schedule)
        return self.session.report(schedule, self.allocator)

    def result(self, schedule: Schedule, none_peak_bytes: int | None = None) -> ScheduleResult:
        """Predicted and, when the step can run, measured result of ``schedule``."""
        if not self.predicted_only:
            return dataclasses.replace(self.session.evaluate(schedule, strict=False),
                                       static_bytes=self.static.total_bytes, static=self.static.to_dict())
        t0 = time.perf_counter()
        report = self.report(schedule)
        if none_peak_bytes is None:
            none_peak_bytes = self.report(schedules.none(self.layers_per_stack)).peak_bytes
        return predicted_result(schedule, report, none_peak_bytes, time.perf_counter() - t0, self.static)

    def activation_budget(self) -> int | None:
        """Bytes the device leaves for the step's peak (None: no device memory given).

        Raises:
            RematError: the static memory alone exceeds the device.
        """
        if self.device_memory_bytes is None:
            return None
        return activation_budget(self.device_memory_bytes, self.static)

    def planner(self) -> Planner:
        """The Planner of this step (predicted with the target's allocator)."""
        model = ReusedLayersModel.create(self.reuse) if self.reuse is not None else None
        return Planner(self.joint, self.step.stack, self.report, model=model)


def load_workload(o: WorkloadOptions, log: Callable[[str], None] | None = None) -> Workload:
    """Build and trace the step ``o`` describes (see the module docstring).

    Args:
        o: the options.
        log: where progress lines go (default: stderr).

    Raises:
        ConfigError: bad input (checked before any tracing; see ``check_options``,
            ``configs.load_config``, ``configs.check_spec``).
        RematError, ValueError, ImportError, OSError: as the factory, the trace or
            the static memory raise them.
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    device_memory = check_options(o)
    allocator = o.allocator or o.target
    static_options = StaticOptions(o.optimizer, o.master_weights, allocator, CudaAllocatorModel(GPUS[o.gpu]))
    t0 = time.perf_counter()
    step = trace_step(o.step_options(), log)
    if step.reuse is not None:
        tensors = step.reuse.static_tensors()
        other = _other_static(step.reuse.static_bytes(), tensors, static_options)
        static = static_memory(tensors, static_options, other)
        return Workload(o, step, None, allocator, static, device_memory, step.description)
    check_fits_this_machine(step)
    calibration = CalibrationOptions(cache_dir=o.calibration_cache) if o.calibrate else None
    # a step that cannot run gets no peak (it is refused, naming the node), and every
    # rewrite takes the real layouts of that run, calibrated or not
    session = Session.of_step(step, o.seed, calibration, check_runs_first=True)
    session.check_runs()
    stack = session.stack
    stacks = (f"layer stack {stack.path!r} with L={stack.num_layers}" if len(stack.stacks) == 1 else
              f"{len(stack.stacks)} layer stacks, L={stack.num_layers} in all: {stack.describe()}")
    log(f"traced {type(step.model).__name__}: {len(step.joint.gm.graph.nodes)} joint nodes, {stacks} "
        f"({time.perf_counter() - t0:.1f}s)")
    for note in step.joint.notes:
        log(f"note: {note}")
    tensors = static_tensors(step.joint.primal_values, step.joint.primal_kinds)
    step_static = session.report(schedules.none(stack.layers_per_stack), allocator).static_bytes
    static = static_memory(tensors, static_options, _other_static(step_static, tensors, static_options))
    return Workload(o, step, session, allocator, static, device_memory, step.description)


RUN_MEMORY_FRACTION = 0.9
"""A step is run here only when its predicted bytes (``none``'s peak + static memory,
op scratch by the formula table) are under this fraction of the available memory."""


def check_fits_this_machine(step: TracedStep, available: int | None = None) -> None:
    """Refuse, before anything runs, a step whose un-rewritten peak cannot fit in this
    machine's memory (a ``--seq 100000`` on a small model would otherwise swap for many
    minutes): the estimate is liveness of the ``none`` rewrite with the ATen formula
    table (no op is run), static memory included.

    Args:
        step: the traced step (real tensors: it would be run and measured).
        available: bytes available (default: ``configs.available_memory_bytes``; None
            there: not checked).

    Raises:
        ConfigError: the estimate exceeds ``RUN_MEMORY_FRACTION`` of ``available``; the
            message gives both and the ways out (--meta, a smaller shape).
    """
    available = available_memory_bytes() if available is None else available
    if available is None or step.predicted_only:  # a fake trace runs nothing
        return
    report = analyze(rewrite(step.joint, step.stack, schedules.none(step.stack.layers_per_stack)))
    need = report.peak_bytes + report.static_bytes
    if need > RUN_MEMORY_FRACTION * available:
        raise ConfigError(
            f"running this step needs about {fmt_bytes(need)} (the un-rewritten peak {fmt_bytes(report.peak_bytes)} "
            f"+ static {fmt_bytes(report.static_bytes)}, predicted without running anything) and this machine has "
            f"{fmt_bytes(available)} available: add --meta to predict every setting without running it, or give "
            "a smaller --batch / --seq")


def _other_static(step_static_bytes: int, tensors: Any, options: StaticOptions) -> int:
    """The step's static bytes that are not primals (tangents, graph constants)."""
    primals = static_memory(tensors, StaticOptions(allocator=options.allocator))
    return step_static_bytes - primals.parameter_bytes - primals.buffer_bytes - primals.batch_bytes


def fits(result: ScheduleResult, static: StaticMemory, device_memory_bytes: int | None) -> bool | None:
    """Whether static memory plus the predicted peak fit the device (None: unknown)."""
    if device_memory_bytes is None or result.predicted_peak_bytes is None:
        return None
    return static.total_bytes + result.predicted_peak_bytes <= device_memory_bytes

