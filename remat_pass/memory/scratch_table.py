"""The op-scratch table: bytes an aten op allocates and frees inside itself, by formula.

The fallback of the memory model (``memory_model.MemoryModel``) where an op signature
has no calibrated figure. Each formula is read from the ATen CPU source of torch 2.13
(the file and function are named in its docstring) and was checked byte for byte
against calibration (the op run alone under the allocator profiler) on the signatures
of the prototype's probe matrix and models, at 1 and 2 threads, on an AVX2 CPU.
The formulas that other paths read too (wrapped scalars, dropout, flash attention:
the symbolic model's ``costs.transient_bytes``, Inductor's ``compile.inductor_memory``)
are written once, on sizes, in ``graph.op_scratch``; this table maps a signature to them.

Two quantities per op call (``TableEntry``):

- ``transient_bytes``: (peak of the allocator's running sum while the op runs) minus
  (what it leaves allocated at its end). Live during that step only. Phases that run
  one after another take ``max``, not ``+`` (a buffer freed before the next is
  allocated does not add up).
- ``output_storage_bytes``: the real storage size of each output where it differs
  from the FakeTensor's (``mse_loss(mean)`` keeps an N-element storage behind its 0-dim
  result, ``Loss.cpp``), live as long as the output; None when FakeTensor sizes are right.

``T`` below is the intra-op thread count, ``es`` the element size, ``acc`` the
accumulation type's size (``at::opmath_type``: float for half / bfloat16). Ops whose
scratch depends on the ISA in ways not modelled here (convolution through oneDNN,
bf16 / fp16 matmul on CPUs with AVX-512 BF16 / FP16 or AMX) have no entry: calibrate.
CUDA ops have no entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..graph.op_scratch import (
    dropout_backward_bytes,
    dropout_bytes,
    flash_attention_bytes,
    wrapped_scalar_bytes,
)
from ..graph.op_signature import OpSignature, TensorSpec

GRAIN_SIZE = 32768
"""``at::internal::GRAIN_SIZE`` (``aten/src/ATen/Parallel.h``)."""


@dataclasses.dataclass(frozen=True)
class TableEntry:
    """The table's figures for one op call (bytes).

    Attributes:
        transient_bytes: scratch live during the op only (see the module docstring).
        output_storage_bytes: real storage bytes of each tensor output (in output
            order) where they differ from the FakeTensor sizes; None: they do not.
        source: the ATen file and function the formula is read from.
    """

    transient_bytes: int
    output_storage_bytes: tuple[int, ...] | None = None
    source: str = ""


Formula = Callable[[OpSignature, frozenset], "TableEntry | None"]
_FORMULAS: dict[str, Formula] = {}


def _formula(*ops: str) -> Callable[[Formula], Formula]:
    def register(fn: Formula) -> Formula:
        for op in ops:
            _FORMULAS["aten." + op] = fn
        return fn
    return register


def _acc(dtype: torch.dtype) -> int:
    """``at::opmath_type``: float for half / bfloat16 / float, else the dtype's size."""
    return 4 if dtype in (torch.float16, torch.bfloat16, torch.float32) else dtype.itemsize


def _reduced_float(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """c10's ``is_contiguous`` (the strides of size-1 dimensions are ignored)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def two_pass_bytes(numel_in: int, numel_out: int, threads: int, out_element_size: int) -> int:
    """``TensorIteratorBase::parallel_reduce`` (``TensorIteratorReduce.cpp``): a full
    reduction (one output element) of >= GRAIN_SIZE elements on more than one thread
    allocates ``buffer = empty({max_threads, *out})`` in the output dtype."""
    if numel_out == 1 and numel_in >= GRAIN_SIZE and threads > 1:
        return threads * out_element_size
    return 0


def _reduced_numel(x: TensorSpec, dims: Any) -> int:
    if dims is None or (isinstance(dims, tuple) and not dims):
        return 1
    rank = max(len(x.shape), 1)
    dims = {d % rank for d in (dims if isinstance(dims, tuple) else (dims,))}
    n = 1
    for i, s in enumerate(x.shape):
        if i not in dims:
            n *= s
    return n


@_formula("_scaled_dot_product_flash_attention_for_cpu.default")
def _sdpa_forward(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/cpu/FlashAttentionKernel.cpp`` ``cpu_flash_attention``: ``buf`` and, for
    bf16 / fp16, ``buf_reduced`` (``op_scratch.flash_attention_bytes``)."""
    q, k = sig.args[0], sig.args[1]
    t = flash_attention_bytes(q.shape[2], k.shape[2], q.shape[3], q.element_size, sig.threads, backward=False)
    return TableEntry(t, None, "cpu/FlashAttentionKernel.cpp cpu_flash_attention: buf, buf_reduced")


@_formula("_scaled_dot_product_flash_attention_for_cpu_backward.default")
def _sdpa_backward(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``FlashAttentionKernel.cpp`` ``flash_attention_backward_kernel_impl``:
    ``grad_out.contiguous()`` of the (B, T, H, D) view ``attention.cpp`` passes (a copy
    unless that view is contiguous); ``cpu_flash_attention_backward``: ``buf``, bf16 /
    fp16 ``buf_reduced`` and ``dsum`` (``op_scratch.flash_attention_bytes``)."""
    g, q, k = sig.args[0], sig.args[1], sig.args[2]
    shape = (g.shape[0], g.shape[2], g.shape[1], g.shape[3])
    stride = (g.stride[0], g.stride[2], g.stride[1], g.stride[3])
    copy = 0 if _contiguous(shape, stride) else g.numel * g.element_size
    buffers = flash_attention_bytes(q.shape[2], k.shape[2], q.shape[3], q.element_size, sig.threads, backward=True)
    return TableEntry(copy + buffers, None,
                      "cpu/FlashAttentionKernel.cpp flash_attention_backward_kernel_impl: "
                      "grad_out.contiguous(), buf, buf_reduced, dsum")


@_formula("native_layer_norm_backward.default")
def _layer_norm_backward(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/cpu/layer_norm_kernel.cpp`` ``LayerNormBackwardKernelImplInternal``:
    ``buffer.resize_({2, num_threads, N})`` in X's dtype for dgamma / dbeta, when
    either is asked for (``output_mask[1]`` or ``[2]``); N = normalized numel."""
    x, normalized, mask = sig.args[1], sig.args[2], sig.args[7]
    n = 1
    for s in normalized:
        n *= s
    t = 2 * sig.threads * n * x.element_size if (mask[1] or mask[2]) else 0
    return TableEntry(t, None, "cpu/layer_norm_kernel.cpp: buffer {2, num_threads, N}")


@_formula("mse_loss.default")
def _mse_loss(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/Loss.cpp``: ``TORCH_META_FUNC(mse_loss)`` builds the output as a
    broadcast binary op then ``out.resize_({})`` for mean / sum, which never shrinks the
    storage: the 0-dim result keeps N elements. The impl computes ``loss`` (N elements)
    then ``mean_out`` / ``sum_out`` (two-pass buffer; mean divides by a wrapped scalar;
    bf16 / fp16 mean: a float result and a float copy of the input)."""
    x, y = sig.args[0], sig.args[1]
    reduction = sig.arg(2, "reduction", 1)
    if reduction == 0:
        return TableEntry(0, None, "Loss.cpp mse_loss, reduction none: the output only")
    n = x.numel if x.shape == y.shape else _broadcast_numel(x, y)
    es = x.element_size
    if reduction == 2:
        t = n * es + two_pass_bytes(n, 1, sig.threads, es)
    elif _reduced_float(x.dtype):
        t = n * es + 4 + max(4 * n + two_pass_bytes(n, 1, sig.threads, 4), wrapped_scalar_bytes(4))
    else:
        t = n * es + max(two_pass_bytes(n, 1, sig.threads, es), wrapped_scalar_bytes(x.element_size))
    return TableEntry(t, (n * es,), "Loss.cpp mse_loss: resize_({}) keeps N elements; loss temporary, "
                                    "mean_out / sum_out")


def _broadcast_numel(*specs: TensorSpec) -> int:
    n = 1
    for s in torch.broadcast_shapes(*(x.shape for x in specs)):
        n *= s
    return n


@_formula("mean.default", "mean.dim")
def _mean(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/ReduceOps.cpp`` ``mean_out`` (CPU): ``sum_out(...).div_(dim_prod)``: the
    two-pass buffer, then a wrapped integer scalar; bf16 / fp16: ``cast_fp32 -> sum ->
    div -> cast``, a float result and a float copy of the input."""
    x = sig.args[0]
    dims = sig.arg(1, "dim", None) if sig.op == "aten.mean.dim" else None
    n_in, n_out = x.numel, _reduced_numel(x, dims)
    if _reduced_float(x.dtype):
        t = 4 * n_out + max(4 * n_in + two_pass_bytes(n_in, n_out, sig.threads, 4),
                            wrapped_scalar_bytes(4))
    else:
        t = max(two_pass_bytes(n_in, n_out, sig.threads, x.element_size), wrapped_scalar_bytes(x.element_size))
    return TableEntry(t, None, "ReduceOps.cpp mean_out: sum_out(...).div_(n)")


@_formula("sum.default", "sum.dim_IntList", "amax.default", "amin.default")
def _reduction(sig: OpSignature, flags: frozenset) -> TableEntry | None:
    """``TensorIteratorReduce.cpp`` ``two_pass_reduction`` (see ``two_pass_bytes``); a
    bool / int sum accumulates in int64: ``ReduceOps.cpp``
    ``make_reduction_from_out_ty`` copies the input (``self.to(int64)``)."""
    x = sig.args[0]
    if sig.op == "aten.sum.dim_IntList":
        if sig.arg(3, "dtype", None) not in (None, x.dtype):
            return None
        dims = sig.arg(1, "dim", None)
    elif sig.op.startswith("aten.am"):
        dims = sig.arg(1, "dim", ())
    else:
        dims = None
    n_in, n_out = x.numel, _reduced_numel(x, dims)
    if sig.op.startswith("aten.sum") and not x.dtype.is_floating_point and x.dtype != torch.int64:
        return TableEntry(n_in * 8 + two_pass_bytes(n_in, n_out, sig.threads, 8), None,
                          "ReduceOps.cpp make_reduction_from_out_ty: self.to(int64)")
    return TableEntry(two_pass_bytes(n_in, n_out, sig.threads, x.element_size), None,
                      "TensorIteratorReduce.cpp two_pass_reduction")


@_formula("gelu_backward.default")
def _gelu_backward(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/Activation.cpp`` ``gelu_backward_out_cpu``: through oneDNN's
    ``eltwise_backward`` (``use_mkldnn``: float, or bf16 on AVX-512 BF16 CPUs; self
    contiguous, more than one element; approximate none), which reorders a gradient in
    another layout (stride 0 after ``sum``) to a dense copy."""
    g, x = sig.args[0], sig.args[1]
    approximate = sig.arg(2, "approximate", "none")
    avx512_bf16 = {"avx512bw", "avx512vl", "avx512dq"} <= flags
    onednn = (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and avx512_bf16)) \
        and _contiguous(x.shape, x.stride) and x.numel > 1
    same_layout = g.stride == x.stride or _contiguous(g.shape, g.stride)
    t = x.numel * x.element_size if approximate == "none" and onednn and not same_layout else 0
    return TableEntry(t, None, "Activation.cpp gelu_backward_out_cpu: oneDNN eltwise_backward reorder")


@_formula("native_dropout.default")
def _dropout(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/Dropout.cpp`` ``native_dropout_cpu``: the float mask
    (``op_scratch.dropout_bytes``)."""
    x = sig.args[0]
    return TableEntry(dropout_bytes(x.numel, x.element_size, sig.arg(2, "train", True)), None,
                      "Dropout.cpp native_dropout_cpu: float mask")


@_formula("native_dropout_backward.default")
def _dropout_backward(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/Dropout.cpp`` ``native_dropout_backward``: ``grad * mask``, then
    ``* scale`` (``op_scratch.dropout_backward_bytes``)."""
    g = sig.args[0]
    return TableEntry(dropout_backward_bytes(g.numel, g.element_size), None,
                      "Dropout.cpp native_dropout_backward: grad * mask, * scale")


@_formula("native_group_norm_backward.default")
def _group_norm_backward(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/cpu/group_norm_kernel.cpp``: ``ds``, ``db = empty({N, C})`` in acc type."""
    x, n, c = sig.args[1], sig.args[5], sig.args[6]
    return TableEntry(2 * n * c * _acc(x.dtype), None, "cpu/group_norm_kernel.cpp: ds, db {N, C}")


@_formula("_native_batch_norm_legit_no_training.default")
def _batch_norm_eval(sig: OpSignature, flags: frozenset) -> TableEntry:
    """``native/cpu/batch_norm_kernel.cpp``
    ``batch_norm_cpu_collect_linear_and_constant_terms``: ``alpha``, ``beta`` of C acc."""
    x = sig.args[0]
    return TableEntry(2 * x.shape[1] * _acc(x.dtype), None, "cpu/batch_norm_kernel.cpp: alpha, beta {C}")


@_formula("native_batch_norm_backward.default")
def _batch_norm_backward(sig: OpSignature, flags: frozenset) -> TableEntry | None:
    """Eval mode (``train=False``): one input-sized temporary, as calibrated (the line in
    ``native/Normalization.cpp`` that allocates it was not pinned); train mode: no entry."""
    x = sig.args[1]
    if sig.arg(7, "train", True):
        return None
    return TableEntry(x.numel * x.element_size, None, "Normalization.cpp batch_norm_backward (eval): "
                                                      "an input-sized temporary (calibrated)")


@_formula("addmm.default", "mm.default", "bmm.default")
def _matmul(sig: OpSignature, flags: frozenset) -> TableEntry | None:
    """``native/CPUBlas.cpp`` ``gemm``: float / double go to MKL, whose buffers are not
    c10 allocations (0 seen); bf16 / fp16 go through ``mkldnn_bf16_gemm`` /
    ``mkldnn_fp16_gemm`` only on CPUs with AVX-512 BF16 (avx512bw/vl/dq) / AVX512-FP16
    or AMX, whose oneDNN scratchpad depends on the implementation (no entry: calibrate);
    elsewhere the cpublas fallback allocates nothing."""
    a = sig.args[1] if sig.op == "aten.addmm.default" else sig.args[0]
    if a.dtype == torch.bfloat16 and ({"avx512bw", "avx512vl", "avx512dq"} <= flags
                                      or any(f.startswith("amx") for f in flags)):
        return None
    if a.dtype == torch.float16 and ("avx512_fp16" in flags or any(f.startswith("amx") for f in flags)):
        return None
    return TableEntry(0, None, "CPUBlas.cpp gemm: MKL or the cpublas fallback, no c10 allocation")


# TensorIterator binary and comparison ops (``TensorIterator.cpp`` ``compute_types``
# with ``promote_inputs_to_common_dtype``: an operand of another dtype is copied to the
# common dtype; a Python number first becomes a 0-dim double / int64 tensor).
_PROMOTING = frozenset({"add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum",
                        "where", "rsub"})
_SCALAR_OVERLOADS = frozenset({"mul.Scalar", "div.Scalar", "add.Scalar", "sub.Scalar", "rsub.Scalar"})

# Calibrated at 0 bytes on the prototype's probe matrix (torch 2.13, AVX2; f32 and bf16;
# last and non-last softmax dims).
_NO_SCRATCH = frozenset("aten." + n for n in (
    "_softmax.default", "_softmax_backward_data.default", "_log_softmax.default",
    "_log_softmax_backward_data.default", "nll_loss_forward.default", "nll_loss_backward.default",
    "embedding.default", "embedding_dense_backward.default", "gelu.default", "tanh.default",
    "tanh_backward.default", "cat.default", "clone.default", "_to_copy.default", "native_group_norm.default",
    "native_layer_norm.default", "pow.Tensor_Scalar", "exp.default", "relu.default", "threshold_backward.default",
    "sigmoid.default", "mse_loss_backward.default",
))


def _promotion_bytes(sig: OpSignature) -> int | None:
    """Bytes of the dtype-promotion copies and wrapped scalars of a TensorIterator
    binary op (None when its operands cannot be read)."""
    operands = list(sig.args[1:3]) if sig.op == "aten.where.self" else [
        a for a in sig.args[:2] if isinstance(a, (TensorSpec, int, float)) and not isinstance(a, bool)]
    if len(operands) < 2:
        return None
    metas = [torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, TensorSpec) else a
             for a in operands]
    if not any(isinstance(m, torch.Tensor) for m in metas):
        return None
    common = torch.result_type(metas[0], metas[1])
    if sig.op.startswith("aten.div.") and not (common.is_floating_point or common.is_complex):
        common = torch.get_default_dtype()  # true division
    total = 0
    for a in operands:
        if isinstance(a, TensorSpec):
            total += a.numel * common.itemsize if a.dtype != common else 0
        else:
            total += wrapped_scalar_bytes(common.itemsize)
    return total


def table_entry(sig: OpSignature, op: torch._ops.OpOverload, flags: frozenset[str], device: str = "cpu") -> TableEntry | None:
    """The table's figures for one op call, or None when the table has no entry.

    Args:
        sig: the call's signature (``op_signature.signature_of``).
        op: the OpOverload it names.
        flags: the CPU's ISA flags (``op_signature.cpu_flags``).
        device: the device the op runs on; only ``"cpu"`` has entries.

    Returns:
        A TableEntry (bytes), or None: calibrate the op.
    """
    if device != "cpu":
        return None
    if op.is_view:
        return TableEntry(0, None, "a view: aliases its input, allocates nothing")
    if sig.op in _FORMULAS:
        return _FORMULAS[sig.op](sig, flags)
    if sig.op in _NO_SCRATCH:
        return TableEntry(0, None, "no scratch (calibrated at 0 on torch 2.13 CPU)")
    name = sig.op.removeprefix("aten.")
    if name in _SCALAR_OVERLOADS:
        x = sig.args[0]
        result = torch.result_type(torch.empty((), dtype=x.dtype), sig.args[1]) if len(sig.args) > 1 else x.dtype
        return TableEntry(wrapped_scalar_bytes(result.itemsize), None, "wrapped_scalar_tensor: the Python number operand")
    if name.split(".")[0] in _PROMOTING:
        t = _promotion_bytes(sig)
        if t is not None:
            return TableEntry(t, None, "TensorIterator compute_types: promotion copies, wrapped scalars")
    if torch.Tag.pointwise in op.tags and all(isinstance(a, TensorSpec) for a in sig.args) and len(
            {a.dtype for a in sig.tensors}) == 1:
        return TableEntry(0, None, "TensorIterator pointwise op on same-dtype tensors: no temporaries")
    return None
