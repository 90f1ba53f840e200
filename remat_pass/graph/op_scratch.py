"""Op scratch by formula: the bytes an ATen CPU kernel allocates and frees inside itself,
as functions of sizes, each formula written once.

Every function takes plain sizes (element counts, element sizes in bytes, the thread
count) and returns bytes, so one formula serves each place that reads sizes its own way:

- ``memory.scratch_table`` (the op-scratch table of the memory model) on a concrete
  ``OpSignature``;
- ``costs.transient_bytes`` on an fx node's FakeTensors, whose sizes may be SymInts
  (the symbolic model and the fake traces count op scratch through it): the functions
  it uses (``wrapped_scalar_bytes``, ``dropout_bytes``, ``dropout_backward_bytes``)
  only add and multiply their sizes, so they stay polynomial;
- ``compile.inductor_memory`` on the sizes of Inductor's generated code (the
  flash-attention fallback kernels, ``flash_attention_bytes``).

The ATen file and function of each formula are named in its docstring (torch 2.13, CPU
kernels; each checked byte for byte against calibration, ``memory.calibration``).
"""

from __future__ import annotations

from typing import Any


def wrapped_scalar_bytes(element_size: int) -> int:
    """Bytes of a Python-number operand: ATen ``wrapped_scalar_tensor`` makes it a 0-dim
    double / int64 tensor (8 B), and TensorIterator's ``compute_types`` casts it to the
    result dtype when that is not 8 bytes wide (``element_size`` more).

    Args:
        element_size: bytes per element of the op's result dtype.

    Example:
        >>> wrapped_scalar_bytes(4), wrapped_scalar_bytes(8), wrapped_scalar_bytes(2)
        (12, 8, 10)
    """
    return 8 + (element_size if element_size != 8 else 0)


def dropout_bytes(numel: Any, element_size: int, train: Any = True) -> Any:
    """``native/Dropout.cpp`` ``native_dropout_cpu``: in training, ``mask =
    empty_like(input).bernoulli_(1 - p)`` in the input's dtype (converted to the bool
    output mask at the end); with ``train=False`` the op clones its input and allocates
    no scratch.

    Args:
        numel, element_size: the input's elements (an int or a SymInt) and bytes per
            element.
        train: the op's ``train`` argument (None counts as True, as in ATen).

    Returns:
        Bytes (``numel * element_size``, or 0).
    """
    return numel * element_size if train is not False else 0


def dropout_backward_bytes(numel: Any, element_size: int) -> Any:
    """``native/Dropout.cpp`` ``native_dropout_backward``: ``grad * mask`` (a temporary
    of the gradient's size), then ``* scale`` (a wrapped Python scalar,
    ``wrapped_scalar_bytes``).

    Args:
        numel, element_size: the gradient's elements (an int or a SymInt) and bytes per
            element.
    """
    return numel * element_size + wrapped_scalar_bytes(element_size)


def flash_attention_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
    """``(qSplitSize, kvSplitSize)`` of ``native/cpu/FlashAttentionKernel.cpp``
    (``flash_attention_kernel_impl`` / ``flash_attention_backward_kernel_impl``): query
    blocks of 256 / 64 / 32 rows for a query length of >= 768 / >= 192 / less, key
    blocks of 512, each at most the length. Lengths that are sympy expressions (the
    symbolic sizes of Inductor's code) give a ``Piecewise`` and a ``Min``.

    Example:
        >>> flash_attention_blocks(1024, 1024), flash_attention_blocks(200, 100), flash_attention_blocks(20, 20)
        ((256, 512), (64, 100), (20, 20))
    """
    if _symbolic(q_len) or _symbolic(kv_len):  # sizes of Inductor's code under dynamic shapes
        import sympy

        q, kv = sympy.sympify(q_len), sympy.sympify(kv_len)
        split = sympy.Piecewise((sympy.Min(256, q), q >= 768), (sympy.Min(64, q), q >= 192), (sympy.Min(32, q), True))
        return split, sympy.Min(512, kv)
    split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(split, q_len), min(512, kv_len)


def _symbolic(value: Any) -> bool:
    """Whether ``value`` is a sympy expression with free symbols (not an int)."""
    return bool(getattr(value, "free_symbols", None))


def flash_attention_bytes(q_len: int, kv_len: int, head_dim: int, element_size: int, threads: int,
                          backward: bool) -> int:
    """Buffers of the CPU flash-attention kernels (``native/cpu/FlashAttentionKernel.cpp``),
    with ``qS, kvS = flash_attention_blocks(q_len, kv_len)``, ``T`` threads, ``acc`` the
    accumulation type's size (``at::opmath_type``: float for half / bfloat16 / float,
    double for double) and ``es`` the input's element size:

    - forward (``cpu_flash_attention``): ``buf`` of ``T x (qS*kvS + 2*qS + qS*head_dim)``
      acc (scores, max, sum, an output block), and for half / bfloat16 ``buf_reduced``
      of ``T x qS x kvS`` es;
    - backward (``cpu_flash_attention_backward``): ``buf`` of ``T x 2 x qS x kvS`` acc,
      for half / bfloat16 ``buf_reduced`` of the same count in es, and one ``dsum`` of
      ``qS`` acc (allocated per thread inside the parallel region: the allocator
      profiler sees the calling thread's only).

    The backward's ``grad_out.contiguous()`` copy depends on the gradient's strides and
    is not included (``memory.scratch_table`` adds it).

    Args:
        q_len, kv_len, head_dim: query and key lengths, the query's head dimension.
        element_size: bytes per element of the inputs (2, 4 or 8).
        threads: the intra-op thread count.
        backward: the backward kernel (else the forward).

    Returns:
        Bytes.

    Example:
        >>> flash_attention_bytes(128, 128, 32, 4, 1, False) == (32 * 128 + 2 * 32 + 32 * 32) * 4
        True
    """
    qs, kvs = flash_attention_blocks(q_len, kv_len)
    acc = max(4, element_size)
    reduced = element_size < 4
    if backward:
        return threads * 2 * qs * kvs * (acc + (element_size if reduced else 0)) + qs * acc
    return threads * ((qs * kvs + 2 * qs + qs * head_dim) * acc + (qs * kvs * element_size if reduced else 0))
