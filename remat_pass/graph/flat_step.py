"""A training step (model, example inputs, loss) as a function of flat primals, what
AOTAutograd traces: the inputs split into tensors and constants, parameters and buffers
bound by identity, the loss or a pipeline stage's output picked out of the model
output, module paths recorded, tensor subclasses flattened as AOTAutograd flattens them.

Module paths are recorded with global module forward hooks that write
``torch.fx.traceback.current_meta["nn_module_stack"]`` while
``torch.fx.traceback.preserve_node_meta()`` is active: fx copies that field onto every
node created inside the module call, in the same ``{path: (path, type)}`` layout Dynamo
and ``make_fx(record_module_stack=True)`` use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx.traceback as fx_traceback

from ..errors import RematError

LossFn = Callable[[Any], torch.Tensor]


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



def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a step's example inputs: a tensor (one positional
    argument), a tuple / list (positional) or a dict (keyword arguments).

    Raises:
        TypeError: anything else.
    """
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
    args, kwargs = split_inputs(example_inputs)
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
