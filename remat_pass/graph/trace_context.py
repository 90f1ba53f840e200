"""What ``trace.capture_joint`` traces a concrete step under: a fake mode in which values
computed only from the graph's constants are known, and ``torch.distributed``'s
collectives traced as functional collectives.

**Known constant values** (``constant_values_mode``). A real tensor the step reads that
is not one of its inputs (a tensor the model closes over, ``torch.get_rng_state()``)
becomes a constant of the graph: every run of the graph reads the value it had when
traced. FakeTensorMode propagates the values of such constants through the ops on them
(``fake_tensor.py``, ``FakeTensor.constant``) but only for tensors of at most
``CONSTANT_NUMEL_LIMIT`` (1) element, so a check such as Megatron-Core's
``torch.all(cpu_rng_state == torch.get_rng_state()).item()``
(``CudaRNGStatesTracker.fork``, ``tensor_parallel/random.py``) is refused as
data-dependent although its value is fixed by the graph's constants. Here constants of up
to ``KNOWN_NUMEL_LIMIT`` elements keep their values through the ops computed only from
constants, so such a scalar is known when tracing (the graph is specialized to it, as
for any Python value it reads); the ops themselves stay in the graph, and a value that
depends on an input (a primal) is unknown as before.

**Functional collectives** (``functional_collectives``). ``torch.distributed``'s in-place
collectives (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
their ``_base`` forms) traced by AOTAutograd become effectful ``c10d`` ops threaded by an
effect token (an extra input and forward output) whose c10d ``Work`` nobody waits on.
While tracing they are the functional collectives Dynamo maps them to
(``torch.distributed._functional_collectives.traceable_collective_remaps``): the
collective, ``wait_tensor``, and a copy into the tensor, so the graph has no token and
the collectives are the ones ``graph.costs.collective_rule`` models. Asynchronous calls
(``async_op=True``: Megatron-Core's column-parallel backward overlaps its input
gradient's all-reduce with the weight gradient and waits on the handle after) are traced
the same way, waited where they are issued, and return a completed handle: left as they
were, each was an effectful ``c10d.allreduce_`` whose result the graph read before it
arrived (on a real gloo group of two ranks, gradients differed run to run).

**No-op dropout** (``eager_no_op_dropout``). Eager ``at::dropout`` returns its input
itself when ``p == 0`` or not training (``_dropout`` in ATen's ``Dropout.cpp``), but the
decomposition AOTAutograd traces (``torch/_decomp/decompositions.py``, ``dropout``)
returns ``input.clone()``: one more activation per call, kept for backward when it is
saved (Megatron's attention dropout at p = 0: b x heads x s^2 x 4 bytes per layer).
While tracing, such a call returns its input, as eager does, so the graph holds no copy.

**Dropout's backward as the CPU kernel runs it** (``cpu_decompositions``). The meta
function of ``aten.native_dropout_backward`` returns a contiguous gradient, but its CPU
kernel is ``grad * mask * scale`` (``native/Dropout.cpp``), whose output takes the layout
of ``grad`` (after a conv1d, a transpose). A graph traced with the contiguous layout can
hold a ``view`` that the real tensors refuse (the step cannot run) or a copy they do not
make. A step traced for the CPU traces it as those two multiplications, whose meta
functions follow the kernels' strides; the same ops, values and bytes as the kernel.

**Batch norm's output layout** (``cpu_kernel_layouts``). Batch norm's meta functions
(train and eval) give the output the strides of a non-contiguous input (a transposed
view), but the CPU kernel allocates it in the input's suggested memory format
(contiguous, or channels-last for a channels-last input: ``batch_norm_cpu``,
``native/Normalization.cpp``). A later op traced on the wrong layout fails on the real
tensors (group norm's kernel requires a contiguous input; its ``contiguous()`` was
elided), and so does its backward's gradient. On a CPU trace such an input is copied
into its suggested format first: one copy that eager does not make, counted (the
figures are of the traced step), where the step would otherwise not run. The kernel
then reduces over another layout than eager's: gradients equal to the traced step's
bit for bit, to eager's within rounding (1e-6 relative in the tests).

**Softplus's backward of two layouts** (``cpu_decompositions``). Given a gradient in one
layout (a transposed group norm's) and an input in another, ``aten.softplus_backward``'s
meta function gives a contiguous output where the CPU kernel's TensorIterator follows
the gradient's layout; the graph then holds a ``view`` the real tensors refuse. On a CPU
trace the input is first copied into the gradient's layout (``empty_like(grad)``), so
both operands agree and meta and kernel give the same strides: one copy of the input
that eager does not make, counted; the same kernel on the same values (gradients within
rounding of eager's: 1.2e-7 seen, bitwise equal to the traced step's).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

KNOWN_NUMEL_LIMIT = 1 << 16
"""The most elements a constant (or a value computed from constants) may have for its
value to be kept while tracing (the CPU generator's state has 5,056)."""


def _known_value(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.layout == torch.strided
            and t.device.type != "meta" and t.numel() <= KNOWN_NUMEL_LIMIT)


def _validate_and_convert(self: FakeTensorMode, func: Any, converter: Any, flat_args: Any, args_spec: Any) -> Any:
    validated, fakes = FakeTensorMode.validate_and_convert_non_fake_tensors(self, func, converter, flat_args, args_spec)
    for real, fake in zip(flat_args, validated):
        if _known_value(real) and isinstance(fake, FakeTensor) and fake.constant is None and not real.requires_grad:
            fake.constant = real  # a constant of the graph: its value is known
    return validated, fakes


def _may_turn_const(self: FakeTensorMode, t: torch.Tensor) -> bool:
    return _known_value(t) and not self.is_our_fake(t)


def constant_values_mode(shape_env: Any = None) -> FakeTensorMode:
    """A ``FakeTensorMode(allow_non_fake_inputs=True)`` in which real tensors (the graph's
    constants) of up to ``KNOWN_NUMEL_LIMIT`` elements, and the values of ops computed
    only from them, are known (see the module docstring); ``shape_env``: a
    ``ShapeEnv`` for symbolic sizes (None: static).

    The mode is a FakeTensorMode, not a subclass (higher-order ops such as
    ``with_effects`` register their fake implementations for that class): its two
    methods that decide what is a constant are replaced on the instance.

    Example:
        >>> from torch._functorch.aot_autograd import aot_function
        >>> state = torch.zeros(5056, dtype=torch.uint8)
        >>> def f(x):
        ...     same = torch.all(state == state.clone()).item()   # known: True
        ...     return (x * 2 if same else x).sum()
        >>> from torch._guards import TracingContext, tracing
        >>> with tracing(TracingContext(constant_values_mode())):
        ...     _ = aot_function(f, fw_compiler=lambda g, _: g)(torch.ones(3, requires_grad=True))
    """
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    mode.validate_and_convert_non_fake_tensors = types.MethodType(_validate_and_convert, mode)
    mode.may_turn_const = types.MethodType(_may_turn_const, mode)
    return mode


def _reduce_op(op: Any) -> str:
    from torch.distributed._functional_collectives import REDUCE_OP_TO_STR

    return REDUCE_OP_TO_STR[op] if not isinstance(op, str) else op


class _Completed:
    """The handle an ``async_op=True`` collective returns while tracing: already done
    (its functional collective was waited where it was issued)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _remapped() -> dict[str, Any]:
    """``torch.distributed`` name -> its functional in-place replacement (same arguments)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    # async_op=True (Megatron's column-parallel backward overlaps its input-gradient
    # all-reduce with the weight gradient, ``handle.wait()`` after): traced as the same
    # functional collective, waited where it is issued, and a completed handle returned.
    # The original in-place op would be traced as an effectful ``c10d.allreduce_``
    # whose Work nothing in the graph waits for (its result read before it arrives).
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001, ANN202
        fc.all_reduce_inplace(tensor, _reduce_op(op), group)
        return _Completed() if async_op else None

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):  # noqa: ANN001, ANN202
        fc.all_gather_tensor_inplace(output_tensor, input_tensor, group)
        return _Completed() if async_op else None

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002, ANN001, ANN202
        fc.reduce_scatter_tensor_inplace(output, input, _reduce_op(op), group)
        return _Completed() if async_op else None

    return {"all_reduce": all_reduce, "all_gather_into_tensor": all_gather_into_tensor,
            "_all_gather_base": all_gather_into_tensor, "reduce_scatter_tensor": reduce_scatter_tensor,
            "_reduce_scatter_base": reduce_scatter_tensor}


@contextlib.contextmanager
def functional_collectives() -> Iterator[None]:
    """While tracing, ``torch.distributed``'s in-place collectives are the functional
    collectives Dynamo maps them to (see the module docstring); restored on exit.
    Nothing happens when ``torch.distributed`` is not initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    replacements = _remapped()
    saved = {name: getattr(dist, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(dist, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class _EagerNoOpDropout(torch.overrides.TorchFunctionMode):
    """``F.dropout`` / ``torch.dropout`` (and the feature / alpha variants) at p = 0 or
    out of training return their input, as eager ATen does; every other call runs."""

    NAMES = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.NAMES and getattr(func, "__module__", "") in (
                "torch", "torch._C._VariableFunctions", "torch.nn.functional", None) and args:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            train = kwargs.get("train", kwargs.get("training", args[2] if len(args) > 2 else True))
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if isinstance(p, (int, float)) and (p == 0 or not train) and not inplace:
                return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def eager_no_op_dropout() -> Iterator[None]:
    """While active, dropout that eager runs as a no-op (p = 0, or not training)
    returns its input instead of AOTAutograd's ``clone`` (see the module docstring)."""
    with _EagerNoOpDropout():
        yield


def _dropout_backward_as_cpu(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return grad * mask * scale


def _softplus_backward_in_grad_layout(grad: torch.Tensor, x: torch.Tensor, beta: float,
                                      threshold: float) -> torch.Tensor:
    if grad.shape != x.shape or grad.stride() == x.stride():
        return NotImplemented  # one layout: traced as the op itself
    # into the gradient's layout (dense: empty_like keeps its strides); functional, as the
    # decompositions run below functionalization
    x = torch.ops.aten.copy.default(torch.empty_like(grad), x)
    return torch.ops.aten.softplus_backward.default(grad, x, beta, threshold)


def cpu_decompositions(trace_values: Any) -> dict[Any, Any]:
    """The decompositions ``capture_joint`` gives AOTAutograd: dropout's backward as the
    CPU kernel runs it, softplus's backward on operands of one layout (module
    docstring), when no traced value is on another device than the CPU (a CUDA target's
    kernels are traced as they are)."""
    leaves = [v for v in torch.utils._pytree.tree_leaves(list(trace_values)) if isinstance(v, torch.Tensor)]
    if any(v.device.type != "cpu" for v in leaves):
        return {}
    return {torch.ops.aten.native_dropout_backward.default: _dropout_backward_as_cpu,
            torch.ops.aten.softplus_backward.default: _softplus_backward_in_grad_layout}


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


class _CpuBatchNormLayout(torch.overrides.TorchFunctionMode):
    """``batch_norm`` of an input that is not in its suggested memory format runs on a
    copy in that format, so that its output and its backward's gradient are traced in
    the layouts the CPU kernels give them."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "batch_norm" and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            fmt = _suggested_format(x)
            if not x.is_contiguous(memory_format=fmt):
                args = (x.contiguous(memory_format=fmt), *args[1:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_kernel_layouts(trace_values: Any) -> Iterator[None]:
    """While active, and when every traced value is on the CPU, batch norm is traced with
    the CPU kernel's output layout (module docstring)."""
    if cpu_decompositions(trace_values):
        with _CpuBatchNormLayout():
            yield
    else:
        yield


@contextlib.contextmanager
def eager_semantics() -> Iterator[None]:
    """What ``capture_joint`` traces under: ``functional_collectives`` and
    ``eager_no_op_dropout``."""
    with functional_collectives(), eager_no_op_dropout():
        yield

