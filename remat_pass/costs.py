"""Per-node costs read off FakeTensor metadata: storage bytes, aliasing and FLOPs.

Bytes are those of the untyped storage (``val.untyped_storage().nbytes()``), so a view
costs nothing of its own. FLOPs are counted with PyTorch's flop formulas
(``torch.utils.flop_counter.flop_registry``, the formulas ``FlopCounterMode`` uses):
matmuls, convolutions and attention; elementwise ops count 0, as there. Bytes moved
(``bytes_moved``) is what a memory-bound op reads and writes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

RNG_STATE_BYTES = {"cpu": int(torch.get_rng_state().numel())}


def tensor_val(node: fx.Node) -> torch.Tensor | None:
    """``node.meta["val"]`` when it is a single tensor, else None."""
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def storage_nbytes(val: torch.Tensor) -> Any:
    """Bytes of the storage behind ``val`` (an int, or a SymInt for symbolic shapes)."""
    return val.untyped_storage().nbytes()


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (fake) tensors share one storage (one is a view of the other)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from an RNG: aten ops tagged ``nondeterministic_seeded``,
    except attention kernels called with ``dropout_p=0`` (they draw nothing)."""
    target = node.target
    if not (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
    ):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
            return value != 0
    return True


def is_mutating(node: fx.Node) -> bool:
    """Whether ``node`` is an aten op that writes one of its inputs in place."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target._schema.is_mutable
    )


def _numel_bytes(val: Any) -> Any:
    # no int(): under symbolic shapes this stays a SymInt (int() would specialise it)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _leaf(val: Any) -> Any:
    """The first tensor of a possibly nested tuple value."""
    while isinstance(val, (tuple, list)) and val:
        val = val[0]
    return val


def _inner_transient(target: Any, args: tuple, out: Any) -> int:
    """Scratch bytes of the CPU kernels of ``target`` (see transient_bytes)."""
    aten = torch.ops.aten
    if target is aten.native_dropout.default:
        # native_dropout_cpu: mask = empty_like(input).bernoulli_(1-p) in the input's
        # dtype, output = input * mask * scale, then the mask is converted to bool
        x = args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        return _numel_bytes(x)
    if target is aten.native_dropout_backward.default:
        # grad_output * mask (a temporary), then * scale (a wrapped Python scalar)
        return _numel_bytes(out) + _wrapped_scalar_bytes(out)
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if name == "mean" or (
        name in _BINARY_WITH_SCALAR
        and len(args) > 1
        and isinstance(args[1], (int, float))
        and not isinstance(args[1], bool)
    ):
        return _wrapped_scalar_bytes(out)
    return 0


# TensorIterator binary ops: a Python number as ``other`` is wrapped in a 0-dim tensor
_BINARY_WITH_SCALAR = frozenset({"mul", "div", "add", "sub", "rsub"})


def _wrapped_scalar_bytes(out: Any) -> int:
    """A Python number operand becomes a 0-dim 8-byte tensor (double / int64), cast to
    the result's dtype when that is not 8 bytes wide (ATen ``wrapped_scalar_tensor``)."""
    if not isinstance(out, torch.Tensor):
        return 0
    size = out.element_size()
    return 8 + (size if size != 8 else 0)


def transient_bytes(node: fx.Node) -> int:
    """Bytes an op allocates and frees inside itself on CPU (0 where none is known).

    Modelled from the ATen CPU kernels, as measured with the profiler's allocator
    events: dropout (``aten/src/ATen/native/Dropout.cpp``), binary ops and ``mean``
    with a Python-number operand (the number is wrapped in a 0-dim tensor, then cast),
    and ``torch._prims.rng_prims.run_with_rng_state``, which reads the current RNG state
    (a copy of ``torch.get_rng_state()``) to restore it afterwards. Other ops' scratch
    space (e.g. bfloat16 matmul buffers) is not modelled; on CUDA 0 is returned.
    """
    if node.op != "call_function":
        return 0
    name = getattr(node.target, "__name__", "")
    val = node.meta.get("val")
    if name == "run_and_save_rng_state":  # val = (rng state, the op's output)
        val = val[1] if isinstance(val, (tuple, list)) and len(val) > 1 else None
    out = _leaf(val)
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return 0
    if name == "run_with_rng_state":
        return RNG_STATE_BYTES["cpu"] + _inner_transient(node.args[1], node.args[2:], out)
    if name == "run_and_save_rng_state":
        return _inner_transient(node.args[0], node.args[1:], out)
    return _inner_transient(node.target, node.args, out)


# CPU attention kernels have no formula in torch.utils.flop_counter; their arguments
# start like the CUDA flash kernels' (query, key, value / grad_out, query, key, value)
_SAME_FLOPS_AS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
}


def node_flops(node: fx.Node) -> Any:
    """FLOPs of one call_function node by PyTorch's flop formulas (0 when none applies).

    Multiply-add counts 2 FLOPs, as in ``torch.utils.flop_counter``. The CPU flash
    attention kernels, which have no formula there, count as the CUDA flash kernels
    (``sdpa_flop_count``: the two batched matmuls, causal masking not discounted). An
    int for concrete shapes, a SymInt under symbolic shapes.
    """
    if node.op != "call_function":
        return 0
    if getattr(node.target, "__name__", "") in ("run_and_save_rng_state", "run_with_rng_state"):
        return 0
    packet = getattr(node.target, "overloadpacket", None)
    packet = _SAME_FLOPS_AS.get(packet, packet)
    if packet not in flop_registry:
        return 0
    args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: a.meta.get("val"))
    return flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val"))


_NO_DATA_MOVED = frozenset({"t", "transpose", "view", "_unsafe_view", "reshape", "permute", "expand", "detach",
                            "alias", "unsqueeze", "squeeze", "slice", "select", "as_strided", "split",
                            "split_with_sizes", "unbind", "lift_fresh_copy"})


def bytes_moved(node: fx.Node) -> int:
    """Bytes one call_function node reads and writes: its tensor inputs' and outputs'
    element bytes (``numel * element_size``; 0 for views, which move nothing, and
    for ``getitem``). The cost of a memory-bound op (pointwise, reductions, norms,
    copies) on a roofline: its time is bytes moved / memory bandwidth. An int (a
    symbolic size counts 0: op-level planning is for concrete shapes)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    target, inputs, out = node.target, list(node.all_input_nodes), node.meta.get("val")
    wrapper = getattr(target, "__name__", "")
    if wrapper == "run_with_rng_state":  # (state, op, *args): the op's traffic
        target, inputs = node.args[1], [a for a in node.all_input_nodes if a is not node.args[0]]
    elif wrapper == "run_and_save_rng_state":  # (op, *args) -> (state, output)
        target, out = node.args[0], out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else out
    packet = getattr(target, "overloadpacket", None)
    if getattr(packet, "__name__", "") in _NO_DATA_MOVED:
        return 0
    return sum(_element_bytes(a.meta.get("val")) for a in inputs) + _element_bytes(out)


def _element_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        n = val.numel()
        return n * val.element_size() if isinstance(n, int) else 0
    if isinstance(val, (tuple, list)):
        return sum(_element_bytes(v) for v in val)
    return 0
