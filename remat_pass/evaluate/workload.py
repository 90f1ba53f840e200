"""A training step as the command line describes it, ready to predict and plan.

``load_workload(WorkloadOptions)`` builds the model (a factory, or a ``transformers``
config file; with weights, or without on the meta device; in a dtype or under
autocast), traces it for the target (the CPU, or a CUDA GPU modelled with
``cuda_target``), and adds the static memory (parameters, optimizer states, master
weights, workspaces) and the device's activation budget. Every check of the input runs
before anything is traced.

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

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable

from ..recompute import schedule as schedules
from ..memory.calibration import CalibrationOptions
from ..models.configs import (
    ConfigError,
    ModelSpec,
    build_factory,
    build_from_config,
    check_spec,
    differing_layer,
    default_task,
    describe,
    fits_in_memory,
    load_config,
    parameter_bytes,
    with_autocast,
)
from ..memory.cuda_target import GPUS, CudaAllocatorModel, CudaKernels
from ..formatting import fmt_bytes, parse_bytes
from ..liveness.layer_reuse import ReusedLayers, ReusedLayersModel
from ..liveness.layer_roles import TEMPLATE_LAYERS
from ..liveness.timeline import MemoryReport
from ..plan.planner import Planner
from ..recompute.schedule import Schedule
from ..memory.static_memory import StaticMemory, StaticOptions, activation_budget, static_memory, static_tensors
from .schedule_result import ScheduleResult, predicted_result
from .session import Session
from ..graph.trace import JointGraph

TARGETS = ("cpu", "cuda")
DEFAULT_MODEL = "remat_pass.models:gpt2"


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


def check_options(o: WorkloadOptions) -> int | None:
    """Every check that needs no model: returns the device memory in bytes (or None).

    Raises:
        ConfigError: an unknown target, GPU or optimizer, a contradiction (autocast with
            a non-fp32 dtype, master weights without an optimizer), or a device memory
            that is not a size.
    """
    if o.target not in TARGETS:
        raise ConfigError(f"target {o.target!r} is not one of {', '.join(TARGETS)}")
    if o.gpu not in GPUS:
        raise ConfigError(f"gpu {o.gpu!r} is not one of {', '.join(GPUS)}")
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
        session: the whole step traced (None when layers are reused).
        reuse: the L-layer stack analysed from a template (None when traced whole).
        allocator: ``"cpu"`` or ``"cuda"`` (the target's).
        static: the static memory.
        device_memory_bytes: the device's memory (None: not given).
        description: what was built and traced, for people.
    """

    options: WorkloadOptions
    session: Session | None
    reuse: ReusedLayers | None
    allocator: str
    static: StaticMemory
    device_memory_bytes: int | None
    description: str

    @property
    def num_layers(self) -> int:
        """L."""
        return self.reuse.num_layers if self.reuse is not None else self.session.stack.num_layers

    @property
    def layers_per_stack(self) -> tuple[int, ...]:
        """L of each layer stack, in chain order (one entry for one stack)."""
        return (self.reuse.num_layers,) if self.reuse is not None else self.session.stack.layers_per_stack

    @property
    def stack_path(self) -> str:
        """The layer stack's module path."""
        return (self.reuse.stack if self.reuse is not None else self.session.stack).path

    @property
    def predicted_only(self) -> bool:
        """Nothing can be run: every figure is predicted."""
        return self.reuse is not None or self.session.predicted_only

    @property
    def joint(self) -> JointGraph:
        """The traced joint graph (the template's when layers are reused)."""
        return self.reuse.template if self.reuse is not None else self.session.joint

    def report(self, schedule: Schedule) -> MemoryReport:
        """The predicted MemoryReport of ``schedule`` under the target's allocator."""
        if self.reuse is not None:
            return self.reuse.report(schedule)
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
        if self.reuse is not None:
            model = ReusedLayersModel.create(self.reuse)
            return Planner(self.reuse.template, self.reuse.stack, self.reuse.report, model=model)
        return Planner(self.session.joint, self.session.stack, self.report)


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
    gpu = GPUS[o.gpu]
    static_options = StaticOptions(o.optimizer, o.master_weights, allocator, CudaAllocatorModel(gpu))
    fake = o.meta or o.target == "cuda"
    kernels: Callable[[], Any] = (lambda: CudaKernels(gpu)) if o.target == "cuda" else contextlib.nullcontext
    t0 = time.perf_counter()
    if o.config is not None:
        config = load_config(o.config)
        spec = ModelSpec(task=o.task or default_task(config), dtype=o.dtype or "float32", meta=o.meta,
                         batch=o.batch or 1, seq=o.seq or 128, seed=o.seed, layers=o.layers)
        check_spec(config, spec)
        num_layers = spec.layers or config.num_hidden_layers
        if not spec.meta and not fits_in_memory(parameter_bytes(config, spec)):
            log(f"the parameters ({fmt_bytes(parameter_bytes(config, spec))}) would not fit in this machine's "
                "memory: building on the meta device (predicted only)")
            spec = dataclasses.replace(spec, meta=True)
            fake = True
        reusable = (fake and not o.trace_all_layers and num_layers > TEMPLATE_LAYERS
                    and not getattr(config, "is_encoder_decoder", False) and o.autocast is None)
        unlike = differing_layer(config, spec) if reusable else None
        if unlike is not None:
            log(f"{unlike}: the layers are not all alike, so every one of the {num_layers} layers is traced")
            reusable = False
        what = f"{describe(config)}, task {spec.task}, {spec.dtype}, batch {spec.batch}, seq {spec.seq}"
        if reusable:
            template_spec = dataclasses.replace(spec, layers=TEMPLATE_LAYERS, meta=True)
            model, inputs, loss_fn = build_from_config(config, template_spec)
            log(f"{what}: tracing {TEMPLATE_LAYERS} of its {num_layers} identical layers without weights "
                f"(target {o.target}) ...")
            session = Session.create(model, inputs, loss_fn, layers=o.stack, seed=o.seed, fake=True, kernels=kernels)
            reuse = ReusedLayers(session.joint, session.stack, num_layers, allocator)
            log(f"traced the template: {len(session.joint.gm.graph.nodes)} joint nodes "
                f"({time.perf_counter() - t0:.1f}s); the {num_layers}-layer stack is analysed from it")
            static = static_memory(reuse.static_tensors(), static_options,
                                   _other_static(reuse.static_bytes(), reuse.static_tensors(), static_options))
            return Workload(o, None, reuse, allocator, static, device_memory,
                            f"{what}; {TEMPLATE_LAYERS} layers traced, {num_layers} analysed")
        model, inputs, loss_fn = build_from_config(config, spec)
    else:
        model, inputs, loss_fn = build_factory(o.model, meta=o.meta, dtype=o.dtype, batch=o.batch, seq=o.seq,
                                               layers=o.layers)
        what = o.model
    if o.autocast is not None:
        model = with_autocast(model, "cpu", o.autocast)
    log(f"tracing {what} ({'without weights, ' if fake else ''}target {o.target}) ...")
    calibration = CalibrationOptions(cache_dir=o.calibration_cache) if o.calibrate else None
    session = Session.create(model, inputs, loss_fn, layers=o.stack, seed=o.seed, fake=fake, kernels=kernels,
                             calibration=calibration)
    # a step that cannot run gets no peak (it is refused, naming the node), and every
    # rewrite takes the real layouts of that run, calibrated or not
    session = dataclasses.replace(session, check_runs_first=True)
    session.check_runs()
    stack = session.stack
    stacks = (f"layer stack {stack.path!r} with L={stack.num_layers}" if len(stack.stacks) == 1 else
              f"{len(stack.stacks)} layer stacks, L={stack.num_layers} in all: {stack.describe()}")
    log(f"traced {type(model).__name__}: {len(session.joint.gm.graph.nodes)} joint nodes, {stacks} "
        f"({time.perf_counter() - t0:.1f}s)")
    tensors = static_tensors(session.joint.primal_values, session.joint.primal_kinds)
    step_static = session.report(schedules.none(session.stack.layers_per_stack), allocator).static_bytes
    static = static_memory(tensors, static_options, _other_static(step_static, tensors, static_options))
    return Workload(o, session, None, allocator, static, device_memory, what)


def _other_static(step_static_bytes: int, tensors: Any, options: StaticOptions) -> int:
    """The step's static bytes that are not primals (tangents, graph constants)."""
    primals = static_memory(tensors, StaticOptions(allocator=options.allocator))
    return step_static_bytes - primals.parameter_bytes - primals.buffer_bytes - primals.batch_bytes


def fits(result: ScheduleResult, static: StaticMemory, device_memory_bytes: int | None) -> bool | None:
    """Whether static memory plus the predicted peak fit the device (None: unknown)."""
    if device_memory_bytes is None or result.predicted_peak_bytes is None:
        return None
    return static.total_bytes + result.predicted_peak_bytes <= device_memory_bytes

