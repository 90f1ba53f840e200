"""Trace one training step (forward, loss, backward) into a single joint fx graph.

The step is traced with AOTAutograd (`torch._functorch.aot_autograd.aot_function`) as a
function of the model's parameters, buffers and input tensors, so there are no graph
breaks: the joint graph holds every aten op of forward and backward. Every node carries
FakeTensor metadata (``meta["val"]``) and its module path (``meta["nn_module_stack"]``;
backward: ``meta["fwd_nn_module_stack"]``, copied from the forward node of its ``seq_nr``).

The step is flattened first (``flat_step``: module paths recorded while it runs), a
symbolic trace gets its fake primals from ``shape_symbols``, and a step that runs
eagerly but cannot be traced is explained by ``untraceable``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..errors import RematError, UnsupportedGraph
from .buffer_updates import move_buffer_updates
from .data_scalars import SPECIALIZED_OPS, capture_specialized, error_line
from .routing import ROUTING_NOTE
from .flat_step import FlatStep, LossFn, flatten_primals, flatten_step
from .op_signature import RealLayout
from .shape_symbols import named_symbols, symbolic_trace_values
from .trace_context import constant_values_mode, cpu_decompositions, cpu_kernel_layouts, eager_semantics
from .untraceable import explain_untraceable, known_trace_error, quiet_fake_tensor_log


class RealLayouts(Mapping[str, RealLayout]):
    """Joint node name -> the ``op_signature.RealLayout`` its value really has, from
    one run of the un-rewritten step (``measure.run.reference_run``): the values whose
    real strides, storage offset or storage bytes differ from the traced FakeTensor's
    (an op whose meta function and kernel disagree), and the values of the arguments an
    op's memory depends on (``op_signature.VALUE_ARGUMENTS``). A frozen value: a
    rewrite given it (``rewrite.rewrite(..., layouts)``) puts each layout on the nodes
    holding that value, where the memory model and calibration read it. Empty
    (``RealLayouts()``): no run, the traced layouts stand.

    Example:
        >>> layouts = RealLayouts({"mm": RealLayout((4, 1), 0, 64)})
        >>> layouts["mm"].stride, len(RealLayouts()), layouts == RealLayouts(dict(layouts))
        ((4, 1), 0, True)
    """

    __slots__ = ("_layouts",)

    def __init__(self, layouts: Mapping[str, RealLayout] | None = None):
        object.__setattr__(self, "_layouts", types.MappingProxyType(dict(layouts or {})))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RealLayouts is frozen")

    def __getitem__(self, name: str) -> RealLayout:
        return self._layouts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __repr__(self) -> str:
        return f"RealLayouts({dict(self._layouts)!r})"


@dataclasses.dataclass(frozen=True)
class JointGraph:
    """One training step as a joint forward+backward fx graph.

    Attributes:
        gm: the joint GraphModule. Placeholders are ``primals_*`` (one per flat input,
            in the order of ``primal_values``) then ``tangents_*``; the output is a flat
            list: ``num_fwd_outputs`` forward outputs (the loss, or a pipeline stage's
            output activation) then one gradient per primal (None where the primal does
            not require grad, and for opaque primals).
        primals: names of the primal placeholders, in order.
        tangents: names of the tangent placeholders, in order.
        num_fwd_outputs: number of forward outputs: the scalar loss (or the output
            activation of a pipeline stage traced with ``output="activation"``), then
            the new value of each buffer or input the step writes in place
            (``buffer_updates``; 1 when it writes none).
        primal_values: the real values fed to the primals: parameters, then buffers,
            then the tensors of the example inputs. A tensor subclass (a DTensor
            parameter under tensor parallelism) is flattened as AOTAutograd flattens it
            (``__tensor_flatten__``): its inner tensors (the local shard) and its
            opaque attributes (the device mesh) each fill one primal.
        primal_kinds: "param", "buffer" or "input" for each primal, or "opaque" for a
            non-tensor attribute of a flattened tensor subclass.
        primal_labels: the parameter / buffer name or "input[i]" for each primal
            (``name.attr`` for the parts of a flattened subclass other than the first).
        tangent_values: the real tangents: ``ones_like(loss)``, or for a stage the
            incoming gradient of its output activation (``ones`` unless given).
        output: ``"loss"`` (a whole training step) or ``"activation"`` (a pipeline
            stage that is not the last: forward output 0 is the activation sent to the
            next stage and its tangent is the gradient received from it).
        model: the traced module (its parameters are the "param" primals); None for a
            graph that Dynamo captured (the torch.compile backend sees no module, and
            ``primal_values`` / ``tangent_values`` are then its fake example values).
        buffer_updates: for each forward output after the loss, the index of the
            primal (a buffer or input) whose new value it is: the step writes it in
            place (BatchNorm's running statistics in train mode), traced functionally
            (``buffer_updates.move_buffer_updates``); every node reads the value from
            before the step, and running the step leaves the primal as it was
            (``measure.run`` reports the new values). Empty: no write.
        specialized: the data-dependent scalars (``.item()``) the graph holds as
            constants, each ``"... = value at file:line"``: the graph, and every figure
            of it, holds for this batch (and any batch giving the same values).
        routing: the routing a bound router took instead of the batch's (``routing.bound_routing``).
        symbols: for a symbolic trace (``trace_joint(..., symbols=...)``), the user's
            name of each shape symbol (``"batch"``) -> the sympy Symbols AOTAutograd
            used for the input dimensions given that name (``(s0, s2)``); empty for a
            concrete trace.
        shape_env: the ShapeEnv of a symbolic trace (None for a concrete trace).
        fake: ``primal_values`` and ``tangent_values`` are FakeTensors (a model without
            weights: built on the meta device, under FakeTensorMode or from a config).
            The step can be rewritten and analysed, never run: every figure is
            predicted only.

    A frozen value: nothing assigns to its fields after construction. What a run of
    the step shows (the real layouts of its values) is a value of its own
    (``RealLayouts``, from ``measure.run.reference_run``), passed to the rewrite.
    """

    gm: fx.GraphModule
    primals: list[str]
    tangents: list[str]
    num_fwd_outputs: int
    primal_values: list[torch.Tensor]
    primal_kinds: list[str]
    primal_labels: list[str]
    tangent_values: list[torch.Tensor]
    model: torch.nn.Module | None
    symbols: dict[str, Any] = dataclasses.field(default_factory=dict)
    shape_env: Any = None
    fake: bool = False
    output: str = "loss"
    buffer_updates: tuple[int, ...] = ()
    specialized: tuple[str, ...] = ()
    routing: str | None = None

    @property
    def notes(self) -> tuple[str, ...]:
        """What every output about this step must say besides its figures: the batch
        values the graph is specialized to (``specialized``), the buffers it writes."""
        which = "the bound routing" if self.routing else "this batch"
        out = ((self.routing,) if self.routing else ()) + tuple(
            f"the graph holds for {which} only: traced specialized to {s}" for s in self.specialized)
        if self.buffer_updates:
            written = [self.primal_labels[i] for i in self.buffer_updates]
            out += (f"the step writes {len(written)} buffers / inputs in place ({', '.join(written[:3])}"
                    f"{', ...' if len(written) > 3 else ''}): their new values are forward outputs, counted "
                    "until the step ends",)
        return out

    @property
    def num_user_outputs(self) -> int:
        """Forward outputs before the buffers' new values (1: the loss or activation)."""
        return self.num_fwd_outputs - len(self.buffer_updates)

    @property
    def num_params(self) -> int:
        """Number of primals that are model parameters (their indices:
        ``param_indices``; they are the first primals unless a flattened tensor subclass
        interleaves opaque primals)."""
        return self.primal_kinds.count("param")

    @property
    def param_indices(self) -> tuple[int, ...]:
        """Indices of the primals (and of their gradient outputs) that are parameters."""
        return tuple(i for i, kind in enumerate(self.primal_kinds) if kind == "param")


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


_DATA_DEPENDENT_ERRORS = _data_dependent_errors()


class _JointCaptured(Exception):
    """Raised from the partition function to stop AOTAutograd once the joint exists."""

    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int):
        super().__init__("joint graph captured")
        self.joint = joint
        self.num_fwd_outputs = num_fwd_outputs


def trace_joint(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    symbols: Mapping[str, Any] | None = None,
    output: str = "loss",
    tangent_values: Sequence[torch.Tensor] | None = None,
) -> JointGraph:
    """Trace ``loss = loss_fn(model(*example_inputs)); loss.backward()`` as one joint graph.

    Args:
        model: the module; it is traced in its current mode (``train()`` for dropout).
        example_inputs: a Tensor, a tuple of positional arguments or a dict of keyword
            arguments. Tensors among them become primals; other values are constants.
        loss_fn: maps the model output to a scalar loss; None if the output is the loss
            or carries ``.loss``.
        symbols: None (default) for concrete shapes. Otherwise the input dimensions
            that become named symbols: ``{"batch": [("input_ids", 0), ("labels", 0)],
            "seq": ("input_ids", 1)}``; each entry is ``(key, dim)`` or a list of them,
            ``key`` a positional index (int) or a keyword name (str) of
            ``example_inputs``. Parameters and buffers keep static shapes. The example
            sizes are only hints (each must be >= 2); every size in the graph becomes a
            sympy expression of the symbols (``JointGraph.symbols`` maps the names).
            Tensors the loss or model build from outside the inputs keep their
            concrete shape, so keep every shape-carrying tensor among the inputs.
        output: ``"loss"`` (default): the step ends in a scalar loss. ``"activation"``:
            a pipeline stage that is not the last (GPipe / 1F1B, Huang et al. 2019;
            Narayanan et al. 2021): the model returns the activation it sends to the
            next stage (``loss_fn`` may pick it out of the output), its tangent is the
            gradient that stage sends back, and every example input that requires grad
            (the activation received from the previous stage) gets a gradient output.
        tangent_values: with ``output="activation"``, the incoming gradient (one
            tensor of the output's shape); default ``ones``. Its values matter only for
            running the step, not for its graph or memory.

    Tensor-subclass parameters (DTensor under ``torch.distributed.tensor.parallel``)
    are desugared by AOTAutograd into their local shards and opaque attributes (the
    device mesh); ``primal_values`` is flattened the same way and an opaque primal's
    gradient output (AOTAutograd returns the placeholder itself) becomes None. The
    joint graph then holds the rank's local shapes and its functional collectives.

    Returns:
        The JointGraph (AOTAutograd's joint graph before partitioning). A model built
        under ``FakeTensorMode`` (FakeTensor parameters) traces too; its JointGraph has
        ``fake=True`` (predicted, never run).

    Raises:
        UnsupportedGraph: the step returns aliases of its inputs, or writes a
            parameter, a value that requires grad or a tensor's metadata in place (a
            write of a buffer's or input's values, BatchNorm's running statistics in
            train mode, is traced: ``JointGraph.buffer_updates``).
        UnsupportedGraph: no gradient reaches any parameter or input (the joint graph
            would be the forward alone).
        UnsupportedGraph: a primal is on the meta device (trace with ``trace_joint_fake``).
        UnsupportedGraph: a data-dependent op that cannot be specialized (``.item()`` values
            are: ``JointGraph.specialized``), named with its Python line; flex attention.
        RematError: no scalar loss.
        ValueError: a ``symbols`` entry names no tensor input or dimension.
        UnsupportedGraph: the step specializes a symbol to one value (code that
            branches on that size), so the graph is not valid for other sizes.

    Example:
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)])
        >>> j = trace_joint(m, (torch.randn(3, 4),), lambda y: y.sum())
        >>> j.primals[:2], j.num_fwd_outputs
        (['primals_1', 'primals_2'], 1)
    """
    flat = flatten_step(model, example_inputs, loss_fn, output)
    refuse_meta_tensors(flat)
    trace_values, dims_of_symbol, shape_env = symbolic_trace_values(flat, symbols)
    fake = any(isinstance(v, FakeTensor) for v in flat.primal_values)
    joint, num_fwd_outputs, specialized = _capture_real(flat, trace_values, bool(symbols), fake)
    return dataclasses.replace(joint_graph(flat, joint, num_fwd_outputs, model, trace_values, dims_of_symbol, shape_env,
                               fake=fake, output=output, tangent_values=tangent_values, specialized=specialized),
                               routing=getattr(model, ROUTING_NOTE, None))


def _capture_real(flat: FlatStep, trace_values: Sequence[Any], dynamic: bool, fake: bool
                  ) -> tuple[fx.GraphModule, int, tuple[str, ...]]:
    """``capture_joint`` of ``flat``; a step with real values that asks for a tensor's
    value (``.item()``) is captured again specialized to the batch's values
    (``data_scalars.capture_specialized``); a step that still cannot be traced is
    explained (``untraceable``: the op and its Python line).

    Returns:
        ``(joint, num_fwd_outputs, the specialized scalars)``.
    """
    specialized: tuple[str, ...] = ()
    try:
        joint, num_fwd_outputs = capture_joint(flat.fn, trace_values, dynamic=dynamic)
    except UnsupportedGraph as e:
        if not fake and isinstance(e.__cause__, _DATA_DEPENDENT_ERRORS):
            try:
                (joint, num_fwd_outputs), specialized = capture_specialized(
                    lambda fn: capture_joint(fn, trace_values, dynamic=dynamic),
                    flat.fn, flat.primal_values, flat.primal_kinds, e)
            except UnsupportedGraph as again:  # not only .item(): name the first op and its line
                explain_untraceable(flat.fn, flat.primal_values, again, SPECIALIZED_OPS)
                raise
        else:
            if not fake and isinstance(e.__cause__, (RuntimeError, NotImplementedError)):
                explain_untraceable(flat.fn, flat.primal_values, e)
            raise
    return joint, num_fwd_outputs, specialized


def refuse_meta_tensors(flat: FlatStep) -> None:
    """Raise when a primal is a plain tensor on the meta device.

    AOTAutograd would make it a FakeTensor on device ``meta``, where ops that have a
    Python meta decomposition (``aten::nll_loss``, ``dropout``, ...) lose their autograd
    kernel: the joint graph silently comes out without its backward.

    Raises:
        UnsupportedGraph: names the first meta primal and the function to use instead.
    """
    for label, v in zip(flat.primal_labels, flat.primal_values):
        if v.is_meta and not isinstance(v, FakeTensor):
            raise UnsupportedGraph(
                f"{label} is on the meta device; trace_joint needs real or fake tensors. "
                "Trace a model without weights with remat_pass.trace_joint_fake (it makes fake "
                "tensors on the target device; Session.create and the command line's --meta do this)"
            )


def joint_graph(
    flat: FlatStep,
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    model: torch.nn.Module,
    trace_values: Sequence[Any],
    dims_of_symbol: Mapping[str, list[tuple[int, int]]],
    shape_env: Any,
    primal_values: Sequence[torch.Tensor] | None = None,
    fake: bool = False,
    output: str = "loss",
    tangent_values: Sequence[torch.Tensor] | None = None,
    specialized: Sequence[str] = (),
) -> JointGraph:
    """The JointGraph of a captured joint graph, after checking it is a training step.

    Args:
        flat: the flattened step that was traced.
        joint, num_fwd_outputs: what ``capture_joint`` returned.
        model: the traced module.
        trace_values: the values the primals were traced with.
        dims_of_symbol, shape_env: the symbolic trace's named dimensions and ShapeEnv
            (empty / None for concrete shapes).
        primal_values: the values to keep as ``JointGraph.primal_values`` (default:
            ``flat.primal_values``).
        fake: the primal values are FakeTensors; the tangents are then the fake values of
            the tangent placeholders instead of real ``ones``.
        output, tangent_values: see ``trace_joint`` (a pipeline stage's activation
            output and the gradient it receives). Tensor-subclass primals (DTensor) are
            flattened as AOTAutograd flattens them (``flatten_primals``).
        specialized: the data-dependent scalars the graph was specialized to
            (``data_scalars.capture_specialized``).

    Raises:
        UnsupportedGraph: more than one forward output, primals lost, or no gradient
            at all (see ``trace_joint``); a named size specialized.
    """
    tangents = [n.name for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    num_fwd_outputs, updates = move_buffer_updates(joint, num_fwd_outputs, flat.primal_labels,
                                                   flat.primal_kinds, len(tangents))
    values = list(flat.primal_values if primal_values is None else primal_values)
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    primals = [n.name for n in placeholders if n.name.startswith("primals")]
    symbols = named_symbols(dims_of_symbol, trace_values, shape_env, flat.primal_labels)
    values, kinds, labels = flatten_primals(values, flat.primal_kinds, flat.primal_labels)
    if len(primals) != len(values):
        raise UnsupportedGraph(
            f"the joint graph has {len(primals)} primals for {len(values)} inputs"
        )
    _drop_opaque_gradients(joint, kinds, num_fwd_outputs)
    grads = list(joint.graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
    if not any(isinstance(g, fx.Node) for g in grads):
        raise UnsupportedGraph(
            "the joint graph has no backward: no gradient reaches any parameter or input, "
            "so it is not a training step. Make sure the loss depends on parameters that "
            "require grad (a model on the meta device must be traced with trace_joint_fake)"
        )
    if fake:
        tangent_values = [joint.graph.find_nodes(op="placeholder", target=t)[0].meta["val"] for t in tangents]
    else:
        tangent_values = _tangent_values(joint, tangents, tangent_values)
    return JointGraph(
        gm=joint,
        primals=primals,
        tangents=tangents,
        num_fwd_outputs=num_fwd_outputs,
        primal_values=values,
        primal_kinds=kinds,
        primal_labels=labels,
        tangent_values=tangent_values,
        model=model,
        symbols=symbols,
        shape_env=shape_env,
        fake=fake,
        output=output,
        buffer_updates=updates,
        specialized=tuple(specialized),
    )


def capture_joint(step: Callable[..., torch.Tensor], trace_values: Sequence[Any],
                  dynamic: bool, fake_mode: FakeTensorMode | None = None) -> tuple[fx.GraphModule, int]:
    """AOTAutograd's joint graph of ``step`` at ``trace_values`` and its number of
    forward outputs (the partition function stops AOTAutograd once it has them).

    Args:
        step: the flat step (``FlatStep.fn``).
        trace_values: real tensors, or FakeTensors of one mode.
        dynamic: a symbolic trace (its fakes bring their own mode and ShapeEnv).
        fake_mode: the mode of fake ``trace_values`` for a concrete trace (default:
            ``trace_context.constant_values_mode``, small constants' values known).

    Collectives are traced as functional ones, no-op dropout as eager's (``trace_context.eager_semantics``).

    Raises:
        UnsupportedGraph: the step depends on tensor values, or AOTAutograd cannot
            trace it.
        RematError: no parameter or input requires grad.
    """
    from torch._functorch.aot_autograd import aot_function

    def capture(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        raise _JointCaptured(joint, num_fwd_outputs)

    compiled = aot_function(step, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                            partition_fn=capture, dynamic=dynamic, decompositions=cpu_decompositions(trace_values))
    fake_mode = fake_mode or constant_values_mode()  # closed-over tensors become graph constants
    try:
        # a symbolic trace brings its own fake mode (in its inputs); a TracingContext
        # there would make Hugging Face models take data-dependent branches
        context = contextlib.nullcontext() if dynamic else tracing(TracingContext(fake_mode))
        with fx_traceback.preserve_node_meta(), context, quiet_fake_tensor_log(), eager_semantics(), \
                cpu_kernel_layouts(trace_values):
            compiled(*trace_values)
    except _JointCaptured as c:
        return c.joint, c.num_fwd_outputs
    except _DATA_DEPENDENT_ERRORS as e:
        op = getattr(e, "func", None)
        raise UnsupportedGraph(
            f"the training step depends on tensor values{f' ({op})' if op is not None else ''}"
            f" at {error_line(e) or 'an unknown line'} (.item(), a Python branch on a "
            "tensor, boolean-mask indexing or another op whose output shape depends on "
            f"data: {type(e).__name__}: {e}), so it cannot be traced into one static graph. "
            "Make the step shape-static, or keep that code outside the traced model "
            "(a model with real weights is traced specialized to its batch's .item() values)."
        ) from e
    except (RuntimeError, NotImplementedError) as e:
        known = known_trace_error(e)
        if known is not None:
            raise UnsupportedGraph(known) from e
        raise UnsupportedGraph(
            f"AOTAutograd could not trace the training step into a joint graph "
            f"({type(e).__name__}: {e}). Run the model's forward and backward eagerly to "
            "check it works; code that AOTAutograd cannot trace (reentrant "
            "torch.utils.checkpoint, custom autograd.Function without a functional "
            "backward) must be replaced or kept outside the traced model."
        ) from e
    raise RematError("AOTAutograd produced no joint graph: no parameter or input requires grad")


def _drop_opaque_gradients(joint: fx.GraphModule, kinds: Sequence[str], num_fwd_outputs: int) -> None:
    """AOTAutograd returns an opaque primal (a device mesh) as its own "gradient"; make
    that gradient output None, as for any primal without a gradient."""
    out = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    opaque = [j for j, kind in enumerate(kinds, num_fwd_outputs) if kind == "opaque" and j < len(outs) and outs[j] is not None]
    for j in opaque:
        outs[j] = None
    if opaque:
        out.args = (outs,)
        joint.graph.lint()
        joint.recompile()


def _tangent_values(joint: fx.GraphModule, tangents: Sequence[str],
                    given: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``given`` (checked against the placeholders' shapes), or ``ones`` of each tangent
    placeholder's shape (the gradient of a scalar loss).

    Raises:
        ValueError: ``given`` does not match the tangents in number or shape.
    """
    out = []
    if given is not None and len(given) != len(tangents):
        raise ValueError(f"tangent_values: {len(given)} tensors for {len(tangents)} tangents")
    for i, name in enumerate(tangents):
        val = joint.graph.find_nodes(op="placeholder", target=name)[0].meta["val"]
        shape = [d.node.hint if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
        if given is not None:
            if list(given[i].shape) != shape:
                raise ValueError(f"tangent_values[{i}] has shape {list(given[i].shape)}; the output has {shape}")
            out.append(given[i])
        else:
            out.append(torch.ones(shape, dtype=val.dtype, device=val.device))
    return out
