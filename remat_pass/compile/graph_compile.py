"""The compile transitions of one training graph (``graph_state``): a Captured graph
compiled through AOTAutograd with this project's partition, run as fx code or by
Inductor, or un-rewritten.

1. AOTAutograd (``torch._dynamo.backends.common.aot_autograd``, which calls
   ``aot_module_simplified``) traces the joint forward+backward graph and calls the
   partition of this compile (``_Partition``: ``graph_state.plan``) instead of its own
   (``default_partition`` / ``min_cut_rematerialization_partition``).
2. The forward and backward graphs are handed back in AOTAutograd's calling convention
   (``Planned.aot_graphs``).
3. They run as plain fx code (``compiler="eager"``: the ``aot_eager`` executor, which
   frees each value at its last use) or are compiled by Inductor
   (``compiler="inductor"``: ``compile_fx`` with the partition as
   ``custom_partitioner_fn``; ``inductor_hooks`` keeps each graph's generated code and
   keeps Inductor from fusing kernels of different layers).

A compile in which no partition ran (AOTAutograd compiled an inference graph) ends in
``Inference``; one that raised a RematError ends in ``Plain`` when ``on_error`` says so.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import TracingContext

from ..errors import RematError
from .compiled_graphs import GraphReport
from .graph import RematFallbackWarning
from .graph_schedule import GraphScheduler
from .graph_state import (Captured, Compiled, Inference, InductorCode, Plain, Planned, Recorded, example_values,
                          plan)
from .graph_transforms import output_roles
from .inductor_hooks import capture_inner_compile


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """What one compile ends in: the graph's state and the GraphReports its partition
    made (one per partition AOTAutograd ran, in order; none for an inference graph or
    an un-rewritten one)."""

    state: Compiled | Plain | Inference
    reports: tuple[GraphReport, ...]


class _Partition:
    """AOTAutograd's ``partition_fn`` for one compile: plans the captured graph
    (``graph_state.plan``) and hands back its forward and backward; keeps the plan and
    the output roles read while the forward compiles, for the state the compile ends in.
    Local to one ``compile_graph`` call."""

    def __init__(self, captured: Captured, scheduler: GraphScheduler, earlier: Sequence[GraphReport]):
        self.captured, self.scheduler, self.earlier = captured, scheduler, tuple(earlier)
        self.plans: list[Planned] = []
        self.roles = captured.roles

    def __call__(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The joint graph -> ``(forward, backward)``; ``kwargs``:
        ``static_lifetime_input_indices`` (parameters; used only for labels). Raises as
        ``graph_state.plan``."""
        static = tuple(kwargs.get("static_lifetime_input_indices") or ())
        planned = plan(self.captured, joint, num_fwd_outputs, static, self.scheduler,
                       self.earlier + tuple(p.report for p in self.plans))
        self.plans.append(planned)
        return planned.aot_graphs()

    def forward_compiling(self) -> None:
        """Read AOTAutograd's output metadata (``TracingContext.fw_metadata``) while the
        forward compiles (``output_roles``); without metadata, the roles of the previous
        compile are kept, or the default ones taken."""
        if not self.plans:
            return  # an inference graph
        p = self.plans[-1]
        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is not None or not self.roles[0]:
            self.roles = output_roles(meta, p.step.num_fwd_outputs, len(p.joint.tangents))

    def result(self, run: Callable[..., Any], code: InductorCode | None) -> CompileResult:
        """The state the compile ends in, with the reports of its partitions."""
        if not self.plans:
            return CompileResult(Inference(self.captured, run), ())
        state = Compiled(self.plans[-1], run, self.roles[0], self.roles[1], code)
        return CompileResult(state, tuple(p.report for p in self.plans))


def compile_graph(captured: Captured, scheduler: GraphScheduler, earlier: Sequence[GraphReport],
                  inputs: Sequence[Any] | None = None) -> CompileResult:
    """Captured -> Compiled (rewritten) | Inference (no partition ran) | Plain (a
    RematError, ``on_error="fallback"``: ``fall_back``).

    Args:
        captured: the graph (with ``forced``: the step plan's schedule).
        scheduler: the backend's GraphScheduler (its options: ``compiler``, ``on_error``).
        earlier: the GraphReports of the graphs compiled before, in compile order.
        inputs: Dynamo's example inputs (the first compile); default: tensors made
            from the captured stand-ins (``graph_state.example_values``, a recompile).

    Raises:
        RematError: as ``graph_state.plan``, with ``on_error="raise"``.
    """
    options = scheduler.options
    inputs = list(inputs) if inputs is not None else example_values(captured.example_inputs)
    try:
        if options.compiler == "inductor":
            return _compile_inductor(captured, scheduler, earlier, inputs)
        return _compile_eager(captured, scheduler, earlier, inputs)
    except RematError as e:
        if options.on_error != "fallback":
            raise
        return CompileResult(fall_back(captured, e, options.compiler, inputs), ())


def _compile_eager(captured: Captured, scheduler: GraphScheduler, earlier: Sequence[GraphReport],
                   inputs: list[Any]) -> CompileResult:
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    part = _Partition(captured, scheduler, earlier)

    def forward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        part.forward_compiling()
        return boxed_nop(gm, example_inputs)

    run = aot_autograd(fw_compiler=forward_compiler, bw_compiler=boxed_nop, partition_fn=part,
                       keep_inference_input_mutations=True)(captured.gm, inputs)
    return part.result(run, None)


def _compile_inductor(captured: Captured, scheduler: GraphScheduler, earlier: Sequence[GraphReport],
                      inputs: list[Any]) -> CompileResult:
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    part = _Partition(captured, scheduler, earlier)
    code = InductorCode()

    class _Partitioner(CustomPartitionerFn):
        def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kw: Any):
            kw.pop("compiler", None)
            return part(joint, joint_inputs, **kw)

        def uuid(self) -> None:
            return None  # no caching: every compile must run the partition (and report)

    def on_code(kind: str, text: str) -> None:
        if not part.plans:
            return  # an inference graph
        setattr(code, kind, text)
        if kind == "forward":
            part.forward_compiling()

    # The caches would key on the partitioner object (not picklable: it holds this
    # compile's state) and a hit would skip the partition, and with it the report.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        run = compile_fx(
            captured.gm, inputs, inner_compile=capture_inner_compile(on_code),
            config_patches={"custom_partitioner_fn": _Partitioner(), "fx_graph_cache": False},
        )
    return part.result(run, code)


def fall_back(state: Captured | Compiled | Recorded, error: Exception, compiler: str,
              inputs: Sequence[Any] | None = None) -> Plain:
    """Captured | Compiled | Recorded -> Plain: the graph compiled without this pass
    (AOTAutograd's partition, or Inductor's with ``compiler="inductor"``) because of
    ``error``, with a ``RematFallbackWarning``; ``inputs`` as ``compile_graph``."""
    if isinstance(state, Recorded):
        state = state.compiled
    captured = state.planned.captured if isinstance(state, Compiled) else state
    reason = f"{type(error).__name__}: {error}"
    warnings.warn(f"remat-pass: graph {captured.graph_id} runs un-rewritten (on_error='fallback') because "
                  f"of {reason}", RematFallbackWarning, stacklevel=3)
    inputs = list(inputs) if inputs is not None else example_values(captured.example_inputs)
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return Plain(captured, compile_fx(captured.gm, inputs), reason)
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    run = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                       keep_inference_input_mutations=True)(captured.gm, inputs)
    return Plain(captured, run, reason)
