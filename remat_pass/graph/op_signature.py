"""Op signatures: what the memory an aten op allocates may depend on, read off an fx node.

An op's allocator behaviour (the scratch it allocates and frees inside itself, the real
size of the storages it returns) depends on more than shapes and dtypes. The signature
keys on everything found to change it on CPU (probed op by op with torch 2.13):

- the op (an ``OpOverload``, e.g. ``aten.native_layer_norm_backward.default``);
- every tensor argument's shape, **strides**, **storage offset**, dtype, device,
  storage bytes, and which arguments **share a storage** (``gelu_backward`` copies a
  stride-0 gradient; SDPA backward copies ``grad_out`` in one layout and not another);
- the non-tensor arguments (``output_mask``, ``reduction``, ``approximate``, dims);
- the intra-op **thread count** (``torch.get_num_threads()`` when the op runs: LayerNorm
  backward allocates ``2 x threads x N`` elements, flash attention buffers per thread);
- and, outside the signature, the host: torch version and CPU (model, ATen CPU
  capability, AVX-512 / AMX flags: bf16 / fp16 matmuls allocate oneDNN scratch only on
  CPUs with them). ``host_identity`` names it; a calibration cache is kept per host.

The RNG wrappers of the rewrite (``run_and_save_rng_state(op, ...)``,
``run_with_rng_state(state, op, ...)``) are keyed on the op they wrap (``op_call``).

Strides are the **real** ones: some ops' meta functions (used for tracing) and CPU
kernels disagree on an output's strides (``native_dropout_backward`` returns its
input's layout, its meta function a contiguous one), and the kernels that read such a
value copy it or not depending on the real layout. The un-rewritten step's reference
run records every value whose real layout differs from the traced one
(``measure.run.reference_run``: ``trace.RealLayouts``); the rewrite puts it on the nodes
of the rewritten graphs (``node.meta[REAL_LAYOUT]``), and the signature, and the
calibration run that rebuilds the arguments, use it.

Values, for the few ops whose allocations depend on an integer tensor's values
(``VALUE_ARGUMENTS``): ``aten._grouped_mm``'s CPU kernel (``_grouped_mm_fallback``,
``aten/src/ATen/native/GroupedMMUtils.h``) runs one ``mm`` per group over the rows its
``offs`` delimit, so its scratch depends on how many rows each group gets (a
mixture-of-experts router's choice). The reference run records those values too
(``RealLayout.values``), as it does a boolean mask indexing ``index`` / ``index_put``
(``MASK_INDEX_OPS``: the backward of ``x[mask]``, whose sizes follow from how many
elements the mask selects); the signature keys on them and calibration fills them in. A
step without weights has no values: calibration does not run such an op; it is listed
as not calibrated, with the reason, and the formula table's figure (none) is used.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

RNG_WRAPPERS = ("run_and_save_rng_state", "run_with_rng_state")
VALUE_ARGUMENTS: dict[str, tuple[int, str]] = {"aten._grouped_mm": (2, "offs")}
"""op overload packet -> (position, name) of the integer tensor argument whose values
decide the op's allocations."""
MASK_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
"""Indexing ops whose boolean-mask indices' values decide their allocations (the backward
of ``x[mask]`` is ``index_put`` with the mask)."""
REAL_LAYOUT = "remat_real_layout"
"""``node.meta`` key of the node's RealLayout, where the real run's differs from the
traced FakeTensor's or where its values were recorded (absent: the traced layout is the
real one, no values)."""


@dataclasses.dataclass(frozen=True)
class RealLayout:
    """The memory layout a tensor value really has when the step runs on CPU.

    Attributes:
        stride: strides in elements, one per dimension (the shape is the traced one).
        storage_offset: offset into the storage, in elements.
        storage_nbytes: bytes of the whole storage behind the tensor.
        values: the tensor's values, flattened, for an argument of ``VALUE_ARGUMENTS``
            (None: not recorded).
    """

    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int
    values: tuple[int, ...] | None = None

    @classmethod
    def of(cls, t: torch.Tensor) -> "RealLayout":
        """The layout of a real (or fake, with concrete sizes) tensor ``t``."""
        return cls(tuple(int(s) for s in t.stride()), int(t.storage_offset()),
                   int(t.untyped_storage().nbytes()))


def layout_of(node: fx.Node) -> tuple[tuple[int, ...], int, int] | None:
    """``(strides, storage offset, storage bytes)`` of the tensor ``node`` holds when the
    step runs: its RealLayout where one was recorded, else its traced FakeTensor's;
    None when it holds no tensor.

    Raises:
        TypeError: a traced size is symbolic.
    """
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    real = node.meta.get(REAL_LAYOUT)
    if isinstance(real, RealLayout):
        return real.stride, real.storage_offset, real.storage_nbytes
    return (tuple(_concrete_int(s) for s in val.stride()), _concrete_int(val.storage_offset()),
            _concrete_int(val.untyped_storage().nbytes()))


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor argument as an op sees it (and as calibration rebuilds it).

    Attributes:
        shape, stride: sizes and strides in elements.
        storage_offset: offset into the storage, in elements.
        dtype: the element type.
        device: ``"cpu"`` or ``"cuda"``.
        storage_nbytes: bytes of the whole storage behind the tensor.
        storage_group: arguments with the same group share one storage (numbered in
            argument order from 0).
        values: the recorded values of a ``VALUE_ARGUMENTS`` tensor (None: unknown).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: str
    storage_nbytes: int
    storage_group: int
    values: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class OpCall:
    """The aten op a node runs, with its fx arguments, unwrapped from an RNG wrapper.

    Attributes:
        op: the OpOverload.
        args, kwargs: its fx arguments (Nodes and constants).
        wrapper: ``""``, ``"run_and_save_rng_state"`` or ``"run_with_rng_state"``.
    """

    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    wrapper: str


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """What one op call's memory may depend on (see the module docstring).

    Attributes:
        op: the op's name, e.g. ``"aten.mm.default"``.
        args: the positional arguments, nested tuples with a TensorSpec per tensor.
        kwargs: ``(name, value)`` pairs, sorted by name, tensors as TensorSpec.
        threads: the intra-op thread count the op runs with.
    """

    op: str
    args: tuple
    kwargs: tuple
    threads: int

    @functools.cached_property
    def key(self) -> str:
        """Canonical text of the signature: the key of a calibration cache entry, e.g.
        ``aten.mm.default(T[4,16][16,1]+0:float32:cpu:256#0,...)|threads=1``."""
        return f"{self.op}({_text(self.args)};{_text(self.kwargs)})|threads={self.threads}"

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """The argument at position ``index`` or passed as ``name``, else ``default``."""
        if index < len(self.args):
            return self.args[index]
        return dict(self.kwargs).get(name, default)

    @property
    def tensors(self) -> list[TensorSpec]:
        """Every TensorSpec among the arguments, in argument order."""
        return [x for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, TensorSpec)]


def _text(x: Any) -> str:
    """Deterministic text of signature arguments (tensors as shape, strides, offset,
    dtype, device, storage bytes and storage group)."""
    if isinstance(x, TensorSpec):
        values = "" if x.values is None else "=" + ",".join(map(str, x.values))
        return (f"T[{','.join(map(str, x.shape))}][{','.join(map(str, x.stride))}]+{x.storage_offset}:"
                f"{str(x.dtype).removeprefix('torch.')}:{x.device}:{x.storage_nbytes}#{x.storage_group}{values}")
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(_text(e) for e in x) + ")"
    return repr(x)  # numbers, strings, None, dtypes, devices, layouts, memory formats


def op_call(node: fx.Node) -> OpCall | None:
    """The aten op ``node`` runs (unwrapped from the rewrite's RNG wrappers), or None
    when it runs no ``OpOverload`` (``getitem``, a get_attr, a placeholder)."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    if name == "run_with_rng_state" and len(node.args) > 1:
        op, args, wrapper = node.args[1], tuple(node.args[2:]), name
    elif name == "run_and_save_rng_state" and node.args:
        op, args, wrapper = node.args[0], tuple(node.args[1:]), name
    else:
        op, args, wrapper = node.target, tuple(node.args), ""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    return OpCall(op, args, dict(node.kwargs), wrapper)


def output_values(node: fx.Node) -> list[Any]:
    """The op's output values (FakeTensors, None for non-tensors), flattened in order;
    for ``run_and_save_rng_state`` those of the wrapped op (not the RNG state)."""
    val = node.meta.get("val")
    if getattr(node.target, "__name__", "") == "run_and_save_rng_state":
        val = val[1] if isinstance(val, (tuple, list)) and len(val) > 1 else None
    return [v if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(val)]


def _concrete_int(x: Any) -> int:
    """``int(x)`` for an int or a SymInt with a concrete value; TypeError otherwise."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt) and x.node.is_constant():
        return int(x)
    raise TypeError(f"symbolic size {x}")


def _spec(node: fx.Node, groups: dict[int, int]) -> TensorSpec:
    """The TensorSpec of the tensor ``node`` holds, in its real layout (``layout_of``)."""
    val = node.meta["val"]
    group = groups.setdefault(val.untyped_storage()._cdata, len(groups))
    layout = layout_of(node)
    assert layout is not None
    stride, offset, nbytes = layout
    return TensorSpec(tuple(_concrete_int(s) for s in val.shape), stride, offset, val.dtype,
                      val.device.type, nbytes, group, recorded_values(node))


def recorded_values(node: fx.Node) -> tuple[int, ...] | None:
    """The values the reference run recorded for ``node``'s tensor (``RealLayout.values``),
    or None."""
    real = node.meta.get(REAL_LAYOUT)
    return real.values if isinstance(real, RealLayout) else None


def value_arguments(call: OpCall) -> list[fx.Node]:
    """The fx arguments of ``call`` whose values decide its allocations: the
    ``VALUE_ARGUMENTS`` tensor, or the boolean masks among the indices of an indexing op
    (``MASK_INDEX_OPS``: how many elements a mask selects sets the sizes the kernel
    allocates). Empty when there is none."""
    packet = str(call.op.overloadpacket)
    where = VALUE_ARGUMENTS.get(packet)
    if where is not None:
        index, name = where
        arg = call.args[index] if index < len(call.args) else call.kwargs.get(name)
        return [arg] if isinstance(arg, fx.Node) else []
    if packet in MASK_INDEX_OPS:
        indices = call.args[1] if len(call.args) > 1 else call.kwargs.get("indices", ())
        return [i for i in indices or () if isinstance(i, fx.Node)
                and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)]
    return []


def _spec_tree(x: Any, groups: dict[int, int]) -> Any:
    """fx arguments -> the same structure, a TensorSpec for every tensor value."""
    if isinstance(x, fx.Node):
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _spec(x, groups)
        if val is None or isinstance(val, (bool, int, float)):
            return val
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise TypeError(f"argument {x.name} is symbolic")
        raise TypeError(f"argument {x.name} holds a {type(val).__name__}")
    if isinstance(x, (list, tuple)):
        return tuple(_spec_tree(e, groups) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _spec_tree(v, groups)) for k, v in x.items()))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("a symbolic constant")
    return x


def signature_of(node: fx.Node, threads: int) -> OpSignature | None:
    """The OpSignature of ``node`` run with ``threads`` intra-op threads, or None when
    it runs no aten op or an argument is symbolic or not a tensor / constant.

    Memoized: a signature is a function of the op, the non-tensor arguments and, per
    tensor argument, its traced value and real layout alone (``_spec``), and every
    rewrite of a step copies its nodes with the same ``meta["val"]`` and
    ``REAL_LAYOUT`` objects; so the memo keys on those objects' identities, and holds
    them so that no identity is reused while its entry lives."""
    call = op_call(node)
    if call is None:
        return None
    held: list[Any] = []
    try:
        memo_key = (call.op, _identity_tree(call.args, held), _identity_tree(call.kwargs, held), threads)
        hash(memo_key)
    except TypeError:  # an unhashable constant (a slice): not memoized
        memo_key = None
    if memo_key is not None and memo_key in _SIGNATURE_MEMO:
        return _SIGNATURE_MEMO[memo_key][0]
    groups: dict[int, int] = {}
    try:
        args = _spec_tree(call.args, groups)
        kwargs = _spec_tree(call.kwargs, groups)
        sig: OpSignature | None = OpSignature(str(call.op), args, kwargs, threads)
    except TypeError:
        sig = None
    if memo_key is not None:
        if len(_SIGNATURE_MEMO) >= _SIGNATURE_MEMO_SIZE:
            _SIGNATURE_MEMO.clear()
        _SIGNATURE_MEMO[memo_key] = (sig, held)
    return sig


# signature_of's memo: key -> (signature, the objects whose identities the key holds)
_SIGNATURE_MEMO: dict[tuple, tuple[OpSignature | None, list[Any]]] = {}
_SIGNATURE_MEMO_SIZE = 100_000


def _identity_tree(x: Any, held: list[Any]) -> Any:
    """fx arguments -> a hashable key: a node as the identities of its value and real
    layout (appended to ``held``), containers as tuples, constants as themselves."""
    if isinstance(x, fx.Node):
        val, real = x.meta.get("val"), x.meta.get(REAL_LAYOUT)
        held += (val, real)
        return ("node", id(val), id(real))
    if isinstance(x, (list, tuple)):
        return tuple(_identity_tree(e, held) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _identity_tree(v, held)) for k, v in x.items()))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("a symbolic constant")
    return (type(x), x)


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags that change which kernels ATen and oneDNN pick (AVX-512
    subsets, AMX, AVX2, FMA, F16C), read from ``/proc/cpuinfo`` (empty where absent)."""
    return _cpu_info()[1]


@functools.lru_cache(maxsize=None)
def _cpu_info() -> tuple[str, frozenset[str]]:
    name, flags = "unknown CPU", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(
                        f for f in value.split()
                        if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "f16c", "avx_vnni"))
    except OSError:
        pass
    return name, flags


def host_identity(device: str = "cpu") -> str:
    """What a calibration on this machine is valid for: torch version, and the CPU
    (model name, ATen CPU capability, ISA flags) or the CUDA device (name, compute
    capability, CUDA version)."""
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        what = f"{torch.cuda.get_device_name()}|sm_{major}{minor}|cuda {torch.version.cuda}"
    else:
        name, flags = _cpu_info()
        what = f"{name}|{torch.backends.cpu.get_cpu_capability()}|{','.join(sorted(flags))}"
    return f"torch {torch.__version__}|{device}|{what}"
