"""Per-node costs read off FakeTensor metadata: storage bytes, aliasing and FLOPs.

Bytes are those of the untyped storage (``val.untyped_storage().nbytes()``), so a view
costs nothing of its own. FLOPs are counted with PyTorch's flop formulas
(``torch.utils.flop_counter.flop_registry``, the formulas ``FlopCounterMode`` uses):
matmuls, convolutions and attention; elementwise ops count 0, as there.
"""

from __future__ import annotations

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
    """Whether ``node`` draws from an RNG (aten ops tagged ``nondeterministic_seeded``)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def is_mutating(node: fx.Node) -> bool:
    """Whether ``node`` is an aten op that writes one of its inputs in place."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target._schema.is_mutable
    )


def node_flops(node: fx.Node) -> int:
    """FLOPs of one call_function node by PyTorch's flop formulas (0 when none applies).

    Multiply-add counts 2 FLOPs, as in ``torch.utils.flop_counter``.
    """
    target = node.target
    if node.op != "call_function":
        return 0
    inner = target
    if getattr(target, "__name__", "") in ("run_and_save_rng_state", "run_with_rng_state"):
        return 0
    packet = getattr(inner, "overloadpacket", None)
    if packet not in flop_registry:
        return 0
    args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: a.meta.get("val"))
    return int(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
