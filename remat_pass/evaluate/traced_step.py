"""The one builder of a traced step: what to build, how to trace it, for which target.

``trace_step(StepOptions)`` is the only place that turns options into a traced step;
``Session.create``, the command line's workload (``workload.load_workload``), the
pytest plugin and per-rank tracing (``parallel.ranks.trace_rank``, FSDP's
``parallel.plan.predict_fsdp_config``) each describe their step as ``StepOptions``:

- the model: a module with its example inputs and loss, a factory ``module:attribute``
  (``models.shipped.build``, with keyword arguments, or ``configs.build_factory`` on
  the meta device / in a dtype), or a ``transformers`` config file
  (``configs.build_from_config``: task, dtype, batch, seq, layers; built on the meta
  device when its parameters would not fit in this machine's memory);
- real, meta or fake: a model with weights is traced by ``trace.trace_joint``; one
  without (meta or fake tensors), or any model when ``fake`` or the target is CUDA,
  by ``fake_trace.trace_joint_fake`` (``fake_trace.trace_model`` decides);
- the target: the CPU, or a CUDA GPU modelled on the CPU (``cuda_target.CudaKernels``
  active while a fake step is traced);
- layer reuse: a config model without weights of more than
  ``layer_roles.TEMPLATE_LAYERS`` identical layers is traced with that many layers and
  its L-layer stack analysed by ``layer_reuse.ReusedLayers`` (``reuse_layers``).

The result, ``TracedStep``, is a frozen value: the joint graph and its layer stack
(the template's when layers are reused), the module and inputs it came from, and the
reused stack when there is one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch

from ..graph.fake_trace import trace_model
from ..graph.regions import LayerStack, assign_layers, find_layer_stacks
from ..graph.routing import bound_routing
from ..graph.trace import JointGraph
from ..liveness.layer_reuse import ReusedLayers
from ..liveness.layer_roles import TEMPLATE_LAYERS
from ..memory.cuda_target import GPUS, CudaKernels
from ..models.configs import (
    ConfigError,
    ModelSpec,
    build_factory,
    build_from_config,
    check_spec,
    default_task,
    describe,
    differing_layer,
    fits_in_memory,
    load_config,
    parameter_bytes,
    with_autocast,
)
from ..models.shipped import build
from ..formatting import fmt_bytes

TARGETS = ("cpu", "cuda")
DEFAULT_MODEL = "remat_pass.models:gpt2"


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What to build and how to trace it (see the module docstring); frozen.

    Attributes:
        model: an ``nn.Module`` (with ``example_inputs`` and ``loss_fn`` as for
            ``trace.trace_joint``), or a factory ``module:attribute`` (ignored with
            ``config``).
        example_inputs, loss_fn: the module's step (a module only).
        factory_kwargs: keyword arguments of the factory (``models.shipped.build``
            passes those it accepts); ``batch``, ``seq`` and ``layers`` join them.
        config: a ``transformers`` config JSON file; task, dtype, batch, seq, layers:
            its ``configs.ModelSpec`` (batch 1 and seq 128 unless given), and for a
            factory the dtype its parameters and inputs are converted to.
        autocast: run the forward under CPU autocast in this dtype.
        meta: build the model without weights (a factory or config).
        fake: trace with fake tensors even when the model has weights.
        target: ``"cpu"`` or ``"cuda"`` (fake, under ``cuda_target.CudaKernels``);
            gpu: a key of ``cuda_target.GPUS``.
        kernels: a context manager factory active while a fake step is traced,
            instead of the target's.
        stack: the layer stacks' module paths (None: every stack found).
        reuse_layers: analyse a config model's identical layers from a template
            (``layer_reuse``) when it applies; False: trace every layer.
        allocator: the allocator the reused stack is counted for (default: the
            target's).
        output: ``"loss"`` or ``"activation"`` (a pipeline stage, ``trace_joint``).
        seed: the weights and token ids of a config model.
        routing_capacity: predict a mixture-of-experts model for the worst routing
            with at most this many tokens per expert (``routing.bound_routing``; a
            model with weights, not a config); None: the batch's own routing.
    """

    model: Any = DEFAULT_MODEL
    example_inputs: Any = None
    loss_fn: Any = None
    factory_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: str | None = None
    task: str | None = None
    dtype: str | None = None
    autocast: str | None = None
    batch: int | None = None
    seq: int | None = None
    layers: int | None = None
    meta: bool = False
    fake: bool = False
    target: str = "cpu"
    gpu: str = "h100"
    kernels: Callable[[], ContextManager[Any]] | None = None
    stack: str | Sequence[str] | None = None
    reuse_layers: bool = False
    allocator: str | None = None
    output: str = "loss"
    seed: int = 0
    routing_capacity: int | None = None


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A traced step (``trace_step``); frozen.

    Attributes:
        joint, stack: the joint graph and its layer stacks (the template's when
            layers are reused).
        model, example_inputs, loss_fn: what was traced.
        reuse: the L-layer stack analysed from the template (None: traced whole).
        layers_per_stack: L of each layer stack, in chain order (the reused stack's L).
        description: what was built, for people.
    """

    joint: JointGraph
    stack: LayerStack
    model: torch.nn.Module
    example_inputs: Any
    loss_fn: Any
    reuse: ReusedLayers | None
    layers_per_stack: tuple[int, ...]
    description: str

    @property
    def predicted_only(self) -> bool:
        """Nothing can be run: a fake trace (a reused stack's template always is)."""
        return self.joint.fake


def check_target(target: str, gpu: str) -> None:
    """Raise unless ``target`` is one of ``TARGETS`` and ``gpu`` a key of ``GPUS``.

    Raises:
        ConfigError: names the value and the legal ones.
    """
    if target not in TARGETS:
        raise ConfigError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    if gpu not in GPUS:
        raise ConfigError(f"gpu {gpu!r} is not one of {', '.join(GPUS)}")


def trace_step(o: StepOptions, log: Callable[[str], None] | None = None) -> TracedStep:
    """Build and trace the step ``o`` describes (see the module docstring).

    Args:
        o: the options.
        log: where progress lines go (default: nowhere).

    Raises:
        ConfigError: an unknown target or GPU, a config that fails its checks
            (``configs.load_config``, ``configs.check_spec``), a factory that cannot
            build on the meta device, a routing capacity without weights.
        LayerStackNotFound: no layer stack (before anything is traced).
        UnsupportedGraph, RematError, ValueError, ImportError: as the factory and
            ``fake_trace.trace_model`` raise them.
    """
    log = log or (lambda _text: None)
    check_target(o.target, o.gpu)
    fake = o.fake or o.meta or o.target == "cuda"
    if o.routing_capacity is not None and (fake or o.config is not None):
        raise ConfigError("--routing-capacity traces the routing from a run of a model with weights on the CPU "
                          "target (built by --model or given as a module): it does not apply with --meta, "
                          "--target cuda or --config")
    if o.config is not None:
        model, inputs, loss_fn, what, fake, reused = _from_config(o, fake, log)
        if reused is not None:
            return reused
    elif isinstance(o.model, str):
        model, inputs, loss_fn = _from_factory(o)
        what = o.model
    else:
        model, inputs, loss_fn, what = o.model, o.example_inputs, o.loss_fn, type(o.model).__name__
    if o.autocast is not None:
        model = with_autocast(model, "cpu", o.autocast)
    if o.routing_capacity is not None:
        model = bound_routing(model, o.routing_capacity)
        what += f" (routing bound: at most {o.routing_capacity} tokens per expert)"
    log(f"tracing {what} ({'without weights, ' if fake else ''}target {o.target}) ...")
    joint, stack = _trace(o, model, inputs, loss_fn, fake)
    return TracedStep(joint, stack, model, inputs, loss_fn, None, stack.layers_per_stack, what)


def _trace(o: StepOptions, model: torch.nn.Module, inputs: Any, loss_fn: Any, fake: bool
           ) -> tuple[JointGraph, LayerStack]:
    """The joint graph (real or fake, under the target's kernels) and its stacks."""
    find_layer_stacks(model, o.stack)  # fail before tracing when there is none
    joint = trace_model(model, inputs, loss_fn, fake=fake, kernels=_kernels(o), output=o.output)
    return joint, assign_layers(joint, o.stack)


def _kernels(o: StepOptions) -> Callable[[], ContextManager[Any]]:
    """The kernels active while a fake step is traced: ``o.kernels``, else the
    target's (``CudaKernels`` of the GPU for ``cuda``, none for the CPU)."""
    if o.kernels is not None:
        return o.kernels
    if o.target == "cuda":
        gpu = GPUS[o.gpu]
        return lambda: CudaKernels(gpu)
    return contextlib.nullcontext


def _from_factory(o: StepOptions) -> tuple[torch.nn.Module, Any, Any]:
    """The factory's ``(model, example_inputs, loss_fn)``: on the meta device / in a
    dtype (``configs.build_factory``), else as the factory builds it."""
    kwargs = {"batch": o.batch, "seq": o.seq, "layers": o.layers, **o.factory_kwargs}
    if o.meta or o.dtype is not None:
        return build_factory(o.model, meta=o.meta, dtype=o.dtype, **kwargs)
    return build(o.model, **kwargs)


def _from_config(o: StepOptions, fake: bool, log: Callable[[str], None]
                 ) -> tuple[Any, Any, Any, str, bool, TracedStep | None]:
    """A config model: ``(model, inputs, loss_fn, what, fake, None)`` to trace whole,
    or ``(..., reused)`` when its identical layers are analysed from a template."""
    t0 = time.perf_counter()
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
    reusable = (fake and o.reuse_layers and num_layers > TEMPLATE_LAYERS
                and not getattr(config, "is_encoder_decoder", False) and o.autocast is None)
    unlike = differing_layer(config, spec) if reusable else None
    if unlike is not None:
        log(f"{unlike}: the layers are not all alike, so every one of the {num_layers} layers is traced")
        reusable = False
    what = f"{describe(config)}, task {spec.task}, {spec.dtype}, batch {spec.batch}, seq {spec.seq}"
    if not reusable:
        model, inputs, loss_fn = build_from_config(config, spec)
        return model, inputs, loss_fn, what, fake, None
    model, inputs, loss_fn = build_from_config(config, dataclasses.replace(spec, layers=TEMPLATE_LAYERS, meta=True))
    log(f"{what}: tracing {TEMPLATE_LAYERS} of its {num_layers} identical layers without weights "
        f"(target {o.target}) ...")
    joint, stack = _trace(o, model, inputs, loss_fn, fake=True)
    reuse = ReusedLayers(joint, stack, num_layers, o.allocator or o.target)
    log(f"traced the template: {len(joint.gm.graph.nodes)} joint nodes "
        f"({time.perf_counter() - t0:.1f}s); the {num_layers}-layer stack is analysed from it")
    reused = TracedStep(joint, stack, model, inputs, loss_fn, reuse, (num_layers,),
                        f"{what}; {TEMPLATE_LAYERS} layers traced, {num_layers} analysed")
    return model, inputs, loss_fn, what, True, reused
