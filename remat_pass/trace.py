"""Trace one training step (forward, loss, backward) into a single joint fx graph.

The step is traced with AOTAutograd (`torch._functorch.aot_autograd.aot_function`) as a
function of the model's parameters, buffers and input tensors, so there are no graph
breaks: the joint graph holds every aten op of the forward and of the backward. Every
node carries FakeTensor metadata in ``node.meta["val"]`` and the path of the module it
came from in ``node.meta["nn_module_stack"]`` (forward) or
``node.meta["fwd_nn_module_stack"]`` (backward, copied by AOTAutograd from the forward
node with the same ``seq_nr``).

Module paths are recorded with global module forward hooks that write
``torch.fx.traceback.current_meta["nn_module_stack"]`` while
``torch.fx.traceback.preserve_node_meta()`` is active: fx copies that field onto every
node created inside the module call, in the same ``{path: (path, type)}`` layout Dynamo
and ``make_fx(record_module_stack=True)`` use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from .errors import RematError, UnsupportedGraph
from .op_signature import RealLayout

LossFn = Callable[[Any], torch.Tensor]


@dataclasses.dataclass
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
        num_fwd_outputs: number of forward outputs (1: the scalar loss, or the output
            activation of a pipeline stage traced with ``output="activation"``).
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
        symbols: for a symbolic trace (``trace_joint(..., symbols=...)``), the user's
            name of each shape symbol (``"batch"``) -> the sympy Symbols AOTAutograd
            used for the input dimensions given that name (``(s0, s2)``); empty for a
            concrete trace.
        shape_env: the ShapeEnv of a symbolic trace (None for a concrete trace).
        fake: ``primal_values`` and ``tangent_values`` are FakeTensors (a model without
            weights: built on the meta device, under FakeTensorMode or from a config).
            The step can be rewritten and analysed, never run: every figure is
            predicted only.
        real_layouts: joint node name -> the ``op_signature.RealLayout`` its value
            really has on CPU, for the values whose real strides, storage offset or
            storage bytes differ from the traced FakeTensor's (an op whose meta function
            and kernel disagree); filled from a run of the step
            (``sweep.Session.check_runs``), empty until then. The rewrite puts them on
            its nodes, and calibration uses them.
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
    real_layouts: dict[str, RealLayout] = dataclasses.field(default_factory=dict)

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
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


_DATA_DEPENDENT_ERRORS = _data_dependent_errors()


class _JointCaptured(Exception):
    """Raised from the partition function to stop AOTAutograd once the joint exists."""

    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int):
        super().__init__("joint graph captured")
        self.joint = joint
        self.num_fwd_outputs = num_fwd_outputs


@contextlib.contextmanager
def record_module_stack(model: torch.nn.Module) -> Iterator[None]:
    """While active, fx nodes created inside a submodule's forward get
    ``meta["nn_module_stack"] = {path: (path, type_qualname), ...}`` (outermost first).

    Must be used inside ``torch.fx.traceback.preserve_node_meta()``.
    """
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    stack: list[int] = []

    def _set_meta() -> None:
        if stack:
            fx_traceback.current_meta["nn_module_stack"] = {
                paths[i]: (paths[i], type_names[i]) for i in stack
            }
        else:
            fx_traceback.current_meta.pop("nn_module_stack", None)

    type_names = {id(m): type(m).__qualname__ for m in model.modules()}

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if id(module) in paths:
            stack.append(id(module))
            _set_meta()

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack and stack[-1] == id(module):
            stack.pop()
            _set_meta()

    h_pre = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    h_post = torch.nn.modules.module.register_module_forward_hook(post_hook, always_call=True)
    try:
        yield
    finally:
        h_pre.remove()
        h_post.remove()
        stack.clear()
        fx_traceback.current_meta.pop("nn_module_stack", None)


@contextlib.contextmanager
def bind_tensors(model: torch.nn.Module, replace: dict[int, torch.Tensor]) -> Iterator[None]:
    """Temporarily put ``replace[id(t)]`` in place of every parameter / buffer ``t``.

    Each module is visited once and each tensor is swapped by identity, so shared
    modules and tied weights stay shared, and everything is restored on exit
    (``torch.func.functional_call`` does not restore a module registered twice).
    """
    undo: list[tuple[dict, str, Any]] = []
    try:
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for name, t in list(slots.items()):
                    if t is not None and id(t) in replace:
                        undo.append((slots, name, t))
                        slots[name] = replace[id(t)]
        yield
    finally:
        for slots, name, t in reversed(undo):
            slots[name] = t


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a Tensor, a tuple/list of positional arguments or a dict "
        f"of keyword arguments; got {type(example_inputs).__name__}"
    )


def _describe_value(value: Any) -> str:
    """``a tensor of shape [8, 6] (float32)``, ``a tuple of 2``, or the type's name (a
    traced tensor is named by its shape, not its internal tensor type)."""
    if isinstance(value, torch.Tensor):
        shape = ", ".join(str(d) for d in value.shape)
        return f"a tensor of shape [{shape}] ({str(value.dtype).replace('torch.', '')})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


OUTPUTS = ("loss", "activation")


def extract_output(output: Any, loss_fn: LossFn | None, kind: str) -> torch.Tensor:
    """The traced forward output: the scalar loss (``kind="loss"``, see
    ``extract_loss``) or a pipeline stage's output activation (``kind="activation"``:
    ``loss_fn(output)`` when given, else ``output``, which must be one tensor).

    Raises:
        RematError: no scalar loss, or a stage output that is not one tensor that
            requires grad.
        ValueError: ``kind`` is not one of ``OUTPUTS``.
    """
    if kind == "loss":
        return extract_loss(output, loss_fn)
    if kind != "activation":
        raise ValueError(f"output={kind!r} is not one of {OUTPUTS}")
    out = loss_fn(output) if loss_fn is not None else output
    if not isinstance(out, torch.Tensor) or not out.requires_grad or not out.is_floating_point():
        raise RematError(
            "a pipeline stage traced with output='activation' must return one floating-point "
            f"tensor that requires grad (the activation sent to the next stage); it returned "
            f"{type(out).__name__}"
        )
    return out


def extract_loss(output: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar loss of one model output.

    Args:
        output: what the model returned.
        loss_fn: ``loss_fn(output) -> scalar tensor``; None when ``output`` is the loss
            or has a ``.loss`` attribute / ``"loss"`` key (Hugging Face models).

    Raises:
        RematError: no scalar loss can be found.
    """
    loss = loss_fn(output) if loss_fn is not None else output
    if not isinstance(loss, torch.Tensor):
        if getattr(loss, "loss", None) is not None:
            loss = loss.loss
        elif isinstance(loss, dict) and "loss" in loss:
            loss = loss["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = "the loss_fn returned" if loss_fn is not None else "the model output is"
        raise RematError(
            f"the training step needs a scalar loss: {what} {_describe_value(loss)}; pass "
            "loss_fn(output) -> scalar tensor (e.g. .sum() or .mean() of it), or make the model "
            "return the loss (or an object with a .loss)"
        )
    return loss


@dataclasses.dataclass
class FlatStep:
    """One training step as a function of flat tensors, what AOTAutograd traces.

    Attributes:
        fn: ``fn(*primals) -> scalar loss``; the primals are the parameters, then the
            buffers, then the tensors of the example inputs, bound into the model by
            identity (``bind_tensors``) while it runs.
        primal_values: the tensors that were flattened, in that order.
        primal_kinds: "param", "buffer" or "input" for each primal.
        primal_labels: the parameter / buffer name or "input[i]" / "input[key]".
        arg_spec, kwarg_spec: the example inputs with each tensor replaced by
            ``("__tensor__", i)`` (i: its index among the input tensors).
        num_params_buffers: how many primals are parameters and buffers.
    """

    fn: Callable[..., torch.Tensor]
    primal_values: list[torch.Tensor]
    primal_kinds: list[str]
    primal_labels: list[str]
    arg_spec: list[Any]
    kwarg_spec: dict[str, Any]
    num_params_buffers: int


def flatten_step(model: torch.nn.Module, example_inputs: Any, loss_fn: LossFn | None,
                 output: str = "loss") -> FlatStep:
    """``loss_fn(model(*example_inputs))`` as a function of flat primals (see FlatStep);
    with ``output="activation"`` the function returns a pipeline stage's output
    activation (``extract_output``).

    Raises:
        TypeError: ``example_inputs`` is not a Tensor, tuple / list or dict.
        ValueError: ``output`` is not one of ``OUTPUTS``.
    """
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r} is not one of {OUTPUTS}")
    args, kwargs = _split_inputs(example_inputs)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    originals = [*params.values(), *buffers.values()]
    flat_inputs: list[torch.Tensor] = []
    labels: list[str] = []

    def _collect(x: Any, label: str) -> Any:
        if isinstance(x, torch.Tensor):
            flat_inputs.append(x)
            labels.append(label)
            return ("__tensor__", len(flat_inputs) - 1)
        return x

    arg_spec = [_collect(a, f"input[{i}]") for i, a in enumerate(args)]
    kwarg_spec = {k: _collect(v, f"input[{k}]") for k, v in kwargs.items()}
    n_p, n_b = len(params), len(buffers)

    def _fill(spec: Any, tensors: Sequence[torch.Tensor]) -> Any:
        if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "__tensor__":
            return tensors[spec[1]]
        return spec

    def step(*flat: torch.Tensor) -> torch.Tensor:
        ins = flat[n_p + n_b :]
        a = tuple(_fill(s, ins) for s in arg_spec)
        k = {key: _fill(s, ins) for key, s in kwarg_spec.items()}
        bound = {id(t): v for t, v in zip(originals, flat)}
        with record_module_stack(model), bind_tensors(model, bound):
            out = model(*a, **k)
        return extract_output(out, loss_fn, output)

    return FlatStep(
        fn=step,
        primal_values=[*params.values(), *buffers.values(), *flat_inputs],
        primal_kinds=["param"] * n_p + ["buffer"] * n_b + ["input"] * len(flat_inputs),
        primal_labels=[*params, *buffers, *labels],
        arg_spec=arg_spec,
        kwarg_spec=kwarg_spec,
        num_params_buffers=n_p + n_b,
    )


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
        UnsupportedGraph: the step mutates an input or buffer in place (e.g. BatchNorm
            running statistics) or returns aliases of its inputs.
        UnsupportedGraph: no gradient reaches any parameter or input (the joint graph
            would be the forward alone).
        UnsupportedGraph: a parameter, buffer or input is on the meta device: trace it
            with ``fake_trace.trace_joint_fake`` (``sweep.Session.create`` does).
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
    trace_values: list[Any] = list(flat.primal_values)
    dims_of_symbol: dict[str, list[tuple[int, int]]] = {}
    shape_env = None
    if symbols:
        dynamic, dims_of_symbol = dynamic_dims(symbols, flat)
        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
        trace_values = _symbolic_fakes(mode, flat.primal_values, dynamic)
    fake = any(isinstance(v, FakeTensor) for v in flat.primal_values)
    try:
        joint, num_fwd_outputs = capture_joint(flat.fn, trace_values, dynamic=bool(symbols))
    except UnsupportedGraph as e:
        if not fake and isinstance(e.__cause__, (RuntimeError, NotImplementedError)):
            _explain_untraceable(flat.fn, flat.primal_values, e)
        raise
    return joint_graph(flat, joint, num_fwd_outputs, model, trace_values, dims_of_symbol, shape_env,
                       fake=fake, output=output, tangent_values=tangent_values)


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

    Raises:
        UnsupportedGraph: more than one forward output, primals lost, or no gradient
            at all (see ``trace_joint``); a named size specialized.
    """
    if num_fwd_outputs != 1:
        raise UnsupportedGraph(
            f"the traced step has {num_fwd_outputs} forward outputs instead of the loss "
            "alone: it mutates an input or buffer in place (e.g. BatchNorm running "
            "statistics in train mode) or returns an alias of an input. Put such layers "
            "in eval mode or remove the mutation."
        )
    values = list(flat.primal_values if primal_values is None else primal_values)
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    primals = [n.name for n in placeholders if n.name.startswith("primals")]
    tangents = [n.name for n in placeholders if n.name.startswith("tangents")]
    named_symbols = _named_symbols(dims_of_symbol, trace_values, shape_env, flat.primal_labels)
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
        symbols=named_symbols,
        shape_env=shape_env,
        fake=fake,
        output=output,
    )


def capture_joint(step: Callable[..., torch.Tensor], trace_values: Sequence[Any],
                  dynamic: bool, fake_mode: FakeTensorMode | None = None) -> tuple[fx.GraphModule, int]:
    """AOTAutograd's joint graph of ``step`` at ``trace_values`` and its number of
    forward outputs (the partition function stops AOTAutograd once it has them).

    Args:
        step: the flat step (``FlatStep.fn``).
        trace_values: real tensors, or FakeTensors of one mode.
        dynamic: a symbolic trace (its fakes bring their own mode and ShapeEnv).
        fake_mode: the mode of fake ``trace_values`` for a concrete trace (default: a
            new mode, in which AOTAutograd fakes real tensors).

    Raises:
        UnsupportedGraph: the step depends on tensor values, or AOTAutograd cannot
            trace it.
        RematError: no parameter or input requires grad.
    """
    from torch._functorch.aot_autograd import aot_function

    def capture(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        raise _JointCaptured(joint, num_fwd_outputs)

    compiled = aot_function(step, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                            partition_fn=capture, dynamic=dynamic)
    # Tensors the model or loss_fn close over (targets, masks) become graph constants.
    fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    try:
        # a symbolic trace brings its own fake mode (in its inputs); a TracingContext
        # there would make Hugging Face models take data-dependent branches
        context = contextlib.nullcontext() if dynamic else tracing(TracingContext(fake_mode))
        with fx_traceback.preserve_node_meta(), context, _fake_tensor_log_quiet():
            compiled(*trace_values)
    except _JointCaptured as c:
        return c.joint, c.num_fwd_outputs
    except _DATA_DEPENDENT_ERRORS as e:
        raise UnsupportedGraph(
            "the training step depends on tensor values (.item(), a Python branch on a "
            "tensor, boolean-mask indexing or another op whose output shape depends on "
            f"data: {type(e).__name__}: {e}), so it cannot be traced into one static graph. "
            "Make the step shape-static, or keep that code outside the traced model."
        ) from e
    except (RuntimeError, NotImplementedError) as e:
        raise UnsupportedGraph(
            f"AOTAutograd could not trace the training step into a joint graph "
            f"({type(e).__name__}: {e}). Run the model's forward and backward eagerly to "
            "check it works; code that AOTAutograd cannot trace (reentrant "
            "torch.utils.checkpoint, custom autograd.Function without a functional "
            "backward) must be replaced or kept outside the traced model."
        ) from e
    raise RematError("AOTAutograd produced no joint graph: no parameter or input requires grad")


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """Keep FakeTensorMode's own log of a failing meta function (a 20-line traceback on
    stderr) out of the output while tracing: the error is raised to the caller, with
    its cause, as an UnsupportedGraph."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


TRACE_FIXES = {
    "aten._grouped_mm": (
        "transformers' mixture-of-experts layers call it by default "
        "(config._experts_implementation = 'grouped_mm'), and its meta function accepts only "
        "bfloat16 here; build the model with config._experts_implementation = 'batched_mm' "
        "(or 'eager'), or trace it in bfloat16"
    ),
}
"""Ops that run eagerly but whose meta (shape) function refuses the inputs, with the
fix to name (op overload packet -> what to do)."""


class _FakeCheck(TorchDispatchMode):
    """Runs every op eagerly and again on fake copies of its inputs; keeps the first op
    whose fake run (its meta function, which tracing uses) fails: ``(op, error)``."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: tuple[Any, BaseException] | None = None
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failed is None:
            try:
                fake_args, fake_kwargs = tree_map_only(torch.Tensor, self.fake.from_tensor, (args, kwargs))
                with self.fake:
                    func(*fake_args, **fake_kwargs)
            except Exception as e:  # noqa: BLE001 - any failure of the meta function is the finding
                self.failed = (func, e)
        return out


def _explain_untraceable(step: Callable[..., torch.Tensor], primal_values: Sequence[torch.Tensor],
                         error: UnsupportedGraph) -> None:
    """Find the op that made tracing fail and raise an UnsupportedGraph naming it.

    The step is run eagerly once (forward and backward, parameter ``.grad`` restored)
    with every op also run on fake tensors; the first op that runs eagerly but not on
    fake tensors is the one tracing cannot pass. Returns without raising when every op
    passes (the error is elsewhere) or the eager step fails too.

    Raises:
        UnsupportedGraph: naming the op, its error, and the fix when ``TRACE_FIXES``
            knows one; chained to the original error.
    """
    grads = [p.grad for p in primal_values]
    check = _FakeCheck()
    try:
        with check, _fake_tensor_log_quiet():
            step(*primal_values).backward()
    except Exception:  # noqa: BLE001 - the step fails eagerly too: the original error stands
        return
    finally:
        for p, g in zip(primal_values, grads):
            p.grad = g
    if check.failed is None:
        return
    op, cause = check.failed
    packet = str(op.overloadpacket) if hasattr(op, "overloadpacket") else str(op)
    fix = TRACE_FIXES.get(packet, "")
    raise UnsupportedGraph(
        f"{op} runs eagerly on these inputs but cannot be traced: its meta function, which "
        f"AOTAutograd runs on fake tensors, fails ({type(cause).__name__}: {cause}). "
        + (f"Fix: {fix}." if fix else
           "Keep that op outside the traced model, or use inputs (dtype, device) its meta function accepts.")
    ) from error.__cause__


def flatten_primals(values: Sequence[Any], kinds: Sequence[str],
                    labels: Sequence[str]) -> tuple[list[Any], list[str], list[str]]:
    """Flatten tensor-subclass values as AOTAutograd flattens its inputs.

    A traceable wrapper subclass (``DTensor``) becomes the values of the attributes its
    ``__tensor_flatten__`` names, in that order and recursively: inner tensors keep the
    kind of the value; other attributes (the ``DeviceMesh``) get kind ``"opaque"``.
    Plain tensors pass through.

    Returns:
        ``(values, kinds, labels)`` with one entry per joint-graph primal.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out_v: list[Any] = []
    out_k: list[str] = []
    out_l: list[str] = []

    def visit(v: Any, kind: str, label: str) -> None:
        if isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v):
            attrs, _ = v.__tensor_flatten__()
            for i, attr in enumerate(attrs):
                visit(getattr(v, attr), kind, label if i == 0 else f"{label}.{attr}")
        elif isinstance(v, torch.Tensor):
            out_v.append(v), out_k.append(kind), out_l.append(label)
        else:
            out_v.append(v), out_k.append("opaque"), out_l.append(label)

    for v, k, lab in zip(values, kinds, labels):
        visit(v, k, lab)
    return out_v, out_k, out_l


def _drop_opaque_gradients(joint: fx.GraphModule, kinds: Sequence[str], num_fwd_outputs: int) -> None:
    """AOTAutograd returns an opaque primal (a device mesh) as its own "gradient"; make
    that gradient output None, as for any primal without a gradient."""
    out = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    changed = False
    for i, kind in enumerate(kinds):
        j = num_fwd_outputs + i
        if kind == "opaque" and j < len(outs) and outs[j] is not None:
            outs[j] = None
            changed = True
    if changed:
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


def _named_symbols(dims_of_symbol: Mapping[str, list[tuple[int, int]]], trace_values: Sequence[Any],
                   shape_env: Any, primal_labels: Sequence[str]) -> dict[str, Any]:
    """The user's name of each symbol -> the sympy Symbols AOTAutograd used for it.

    Raises:
        UnsupportedGraph: the trace specialized a named size to one value.
    """
    named: dict[str, Any] = {}
    for name, dims in dims_of_symbol.items():
        exprs = []
        for flat_index, dim in dims:
            size = trace_values[flat_index].shape[dim]
            expr = shape_env.replace(size.node.expr) if isinstance(size, torch.SymInt) else size
            if not getattr(expr, "is_Symbol", False):
                raise UnsupportedGraph(
                    f"the traced step specializes symbol {name!r} (input dimension "
                    f"{(primal_labels[flat_index], dim)}) to {expr}: the model branches on "
                    "that size, so its graph holds only for that value; trace it with "
                    "concrete shapes"
                )
            if expr not in exprs:
                exprs.append(expr)
        named[name] = tuple(exprs)
    return named


def dynamic_dims(symbols: Mapping[str, Any], flat: FlatStep) -> tuple[dict[int, set[int]], dict[str, list[tuple[int, int]]]]:
    """The primal dimensions a symbolic trace makes dynamic.

    Returns:
        ``(flat index -> dynamic dims, name -> [(flat index, dim)])``.

    Raises:
        ValueError: an entry names no tensor input, no dimension of it, or a dimension
            whose example size is below 2.
    """
    dims_of_symbol: dict[str, list[tuple[int, int]]] = {}
    dynamic: dict[int, set[int]] = {}
    arg_spec, kwarg_spec = flat.arg_spec, flat.kwarg_spec
    for name, entries in symbols.items():
        if isinstance(entries, tuple) and len(entries) == 2 and isinstance(entries[1], int):
            entries = [entries]
        dims_of_symbol[name] = []
        for key, dim in entries:
            spec = arg_spec[key] if isinstance(key, int) and 0 <= key < len(arg_spec) else (
                kwarg_spec.get(key) if isinstance(key, str) else None
            )
            if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "__tensor__"):
                raise ValueError(
                    f"symbol {name!r}: {key!r} is not a tensor input; tensor inputs are "
                    f"positions {[i for i, a in enumerate(arg_spec) if isinstance(a, tuple)]} "
                    f"and keywords {[k for k, a in kwarg_spec.items() if isinstance(a, tuple)]}"
                )
            flat_index = flat.num_params_buffers + spec[1]
            value = flat.primal_values[flat_index]
            if not 0 <= dim < value.dim():
                raise ValueError(
                    f"symbol {name!r}: input {key!r} has {value.dim()} dimensions, no dimension {dim}"
                )
            if value.shape[dim] < 2:
                raise ValueError(
                    f"symbol {name!r}: the example size of input {key!r} dimension {dim} is "
                    f"{value.shape[dim]}; symbolic sizes need an example size >= 2"
                )
            dims_of_symbol[name].append((flat_index, dim))
            dynamic.setdefault(flat_index, set()).add(dim)
    return dynamic, dims_of_symbol


def symbolic_context(value: torch.Tensor, dims: set[int]) -> StatelessSymbolicContext:
    """The context that makes dimensions ``dims`` of ``value`` fresh symbols."""
    return StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(value.dim())]
    )


def _symbolic_fakes(mode: FakeTensorMode, primal_values: Sequence[torch.Tensor],
                    dynamic: Mapping[int, set[int]]) -> list[Any]:
    """Fake primals for a symbolic trace: parameters and buffers static, the named input
    dimensions dynamic (one fresh symbol each; AOTAutograd's guards unify the dimensions
    of one name)."""
    fakes: list[Any] = []
    memo: dict[int, Any] = {}
    for i, v in enumerate(primal_values):
        if i in dynamic:
            fake = memo[id(v)] if id(v) in memo else mode.from_tensor(
                v, symbolic_context=symbolic_context(v, dynamic[i]))
        else:
            fake = mode.from_tensor(v, static_shapes=True)
        memo.setdefault(id(v), fake)
        fakes.append(fake)
    return fakes
