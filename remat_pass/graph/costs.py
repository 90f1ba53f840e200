"""Per-node costs read off FakeTensor metadata: storage bytes, aliasing and FLOPs.

Bytes are those of the untyped storage (``val.untyped_storage().nbytes()``), so a view
costs nothing of its own. FLOPs are counted with PyTorch's flop formulas
(``torch.utils.flop_counter.flop_registry``, the formulas ``FlopCounterMode`` uses):
matmuls, convolutions and attention; elementwise ops count 0, as there. Bytes moved
(``bytes_moved``) is what a memory-bound op reads and writes.

Functional collectives (``torch.ops._c10d_functional``, what a tensor-parallel rank's
graph holds) follow the run-time rules of ``COLLECTIVE_RULES``, which liveness applies
through ``run_alias_of``, ``collective_rule`` and ``wait_of``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .op_scratch import dropout_backward_bytes, dropout_bytes, wrapped_scalar_bytes

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


def _leaf(val: Any) -> Any:
    """The first tensor of a possibly nested tuple value."""
    while isinstance(val, (tuple, list)) and val:
        val = val[0]
    return val


def replay_state_bytes(wrapper: str | None, device: str) -> int:
    """Scratch of an RNG-replay wrapper on ``device``: ``run_with_rng_state`` reads the
    current generator state (a copy of ``torch.get_rng_state()``, ``RNG_STATE_BYTES``)
    to restore it after the op (``torch/_prims/rng_prims.py``); on CPU only (0 for any
    other wrapper or device: the CUDA philox state is not modelled)."""
    return RNG_STATE_BYTES["cpu"] if wrapper == "run_with_rng_state" and device == "cpu" else 0


def _inner_transient(target: Any, args: tuple, out: Any) -> Any:
    """Scratch bytes of the CPU kernel of ``target`` (see transient_bytes), by the
    formulas of ``op_scratch`` on FakeTensor sizes (no int(): under symbolic shapes a
    size stays a SymInt, which int() would specialise)."""
    aten = torch.ops.aten
    if target is aten.native_dropout.default:
        x = args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        if not isinstance(x, torch.Tensor):
            return 0
        return dropout_bytes(x.numel(), x.element_size(), args[2] if len(args) > 2 else True)
    if target is aten.native_dropout_backward.default:
        return dropout_backward_bytes(out.numel(), out.element_size())
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if name == "mean" or (
        name in _BINARY_WITH_SCALAR
        and len(args) > 1
        and isinstance(args[1], (int, float))
        and not isinstance(args[1], bool)
    ):
        return wrapped_scalar_bytes(out.element_size())
    return 0


# TensorIterator binary ops: a Python number as ``other`` is wrapped in a 0-dim tensor
_BINARY_WITH_SCALAR = frozenset({"mul", "div", "add", "sub", "rsub"})


@dataclasses.dataclass(frozen=True)
class CollectiveRule:
    """What a functional collective keeps alive at run time beyond its graph edges.

    Attributes:
        input_held_until_wait: the c10d Work holds the collective's input until its
            ``wait_tensor`` (``all_gather_into_tensor`` / ``reduce_scatter_tensor``
            call ``_allgather_base(out, in)`` / ``_reduce_scatter_base(out, in)``);
            ``all_reduce`` clones its input into its output and reduces in place, so
            its input dies at its last graph use.
        call_scratch: backend scratch live during the collective's own step:
            ``"input"`` or ``"output"`` (that many bytes), or None.
        held_scratch: backend scratch live from the call to the wait, or None.
    """

    input_held_until_wait: bool
    call_scratch: str | None = None
    held_scratch: str | None = None


# (backend, op) -> rule. gloo on CPU, torch 2.13, measured with the profiler's allocator
# events per node (ProcessGroupGloo: the all-gather copies its input into a flat buffer
# in the call and a worker thread (``pt_gloo_runloop``) allocates an output-sized buffer
# until the collective completes, charged here until the wait, an upper bound; the
# reduce-scatter keeps a copy of its input with the Work). nccl writes into the output
# and keeps input and output by record_stream until the collective ends on its stream:
# no scratch (not calibrated on a device).
COLLECTIVE_RULES = {
    ("gloo", "all_gather_into_tensor"): CollectiveRule(True, call_scratch="input", held_scratch="output"),
    ("gloo", "reduce_scatter_tensor"): CollectiveRule(True, held_scratch="input"),
    ("gloo", "all_reduce"): CollectiveRule(False),
    ("nccl", "all_gather_into_tensor"): CollectiveRule(True),
    ("nccl", "reduce_scatter_tensor"): CollectiveRule(True),
    ("nccl", "all_reduce"): CollectiveRule(False),
}
BACKEND_OF_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


def _functional_op(node: fx.Node) -> str | None:
    """The ``_c10d_functional`` op name of ``node`` (``"all_reduce"``), or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace != "_c10d_functional":
        return None
    return node.target._schema.name.split("::")[-1]


def run_alias_of(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output is at run time while its FakeTensor
    has a storage of its own: ``wait_tensor(x)`` returns ``x`` itself (the collective's
    output); an in-place aten op (``mul_(x, y)``, whose schema writes and returns its
    first argument: ``recompute.reinplace``) returns ``x``."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if _functional_op(node) == "wait_tensor":
        return node.args[0]
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        args, returns = target._schema.arguments, target._schema.returns
        first = args[0].alias_info if args else None
        out = returns[0].alias_info if len(returns) == 1 else None
        if first is not None and first.is_write and out is not None and out.before_set == first.before_set:
            return node.args[0]
    return None


def wait_of(node: fx.Node) -> fx.Node | None:
    """The ``wait_tensor`` that completes the collective ``node`` (None if none)."""
    for user in node.users:
        if _functional_op(user) == "wait_tensor":
            return user
    return None


def collective_rule(node: fx.Node, device: str = "cpu") -> CollectiveRule | None:
    """The run-time rule of a functional collective on ``device``'s backend (gloo on
    CPU, nccl on CUDA), None for any other node or an unlisted collective."""
    op = _functional_op(node)
    if op is None or op == "wait_tensor":
        return None
    return COLLECTIVE_RULES.get((BACKEND_OF_DEVICE.get(device, ""), op))


def _rule_bytes(node: fx.Node, which: str | None) -> Any:
    if which is None:
        return 0
    val = node.args[0].meta.get("val") if which == "input" and isinstance(node.args[0], fx.Node) else node.meta.get("val")
    return storage_nbytes(val) if isinstance(val, torch.Tensor) else 0


def held_scratch_bytes(node: fx.Node, device: str = "cpu") -> Any:
    """Bytes a collective's backend holds from its call to its ``wait_tensor``
    (``CollectiveRule.held_scratch``; 0 for other nodes)."""
    rule = collective_rule(node, device)
    return _rule_bytes(node, rule.held_scratch) if rule is not None else 0


def transient_bytes(node: fx.Node) -> Any:
    """Bytes an op allocates and frees inside itself on CPU, read off the node's
    FakeTensors (0 where none is known): the op scratch of the symbolic model and of a
    node whose signature cannot be read (``memory_model.MemoryModel.node_memory``).

    The formulas whose sizes are polynomial, from ``op_scratch`` (the ones the table
    ``memory.scratch_table`` uses too): dropout and its backward
    (``aten/src/ATen/native/Dropout.cpp``), binary ops and ``mean`` with a Python-number
    operand (the number is wrapped in a 0-dim tensor, then cast); the RNG-replay
    wrapper's state copy (``replay_state_bytes``); a gloo collective's in-call scratch
    (``COLLECTIVE_RULES``). Not modelled here (the table has them, for concrete
    signatures): what depends on comparisons of sizes or on the thread count
    (flash-attention blocks, two-pass reductions, per-thread buffers) and reduced-float
    upcasts; on CUDA 0 is returned.

    Returns:
        Bytes: an int, or a SymInt under symbolic shapes.
    """
    if node.op != "call_function":
        return 0
    rule = collective_rule(node, "cpu")
    if rule is not None:
        return _rule_bytes(node, rule.call_scratch)
    name = getattr(node.target, "__name__", "")
    val = node.meta.get("val")
    if name == "run_and_save_rng_state":  # val = (rng state, the op's output)
        val = val[1] if isinstance(val, (tuple, list)) and len(val) > 1 else None
    out = _leaf(val)
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return 0
    if name == "run_with_rng_state":
        return replay_state_bytes(name, "cpu") + _inner_transient(node.args[1], node.args[2:], out)
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
