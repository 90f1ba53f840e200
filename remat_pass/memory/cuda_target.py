"""The CUDA target, modelled on a CPU-only machine: kernel choice, allocator blocks,
fixed workspaces. Every rule names the PyTorch source it follows.

A CPU build of PyTorch cannot trace fake CUDA tensors through autograd (autograd's
``AccumulateGrad`` asks for the CUDA device guard and the process aborts with a C++
``terminate``), so a prediction for a GPU is a CPU trace in which every op whose CUDA
kernel saves different tensors is replaced, while tracing, by the aten op the GPU would
run (``CudaKernels``). The op's autograd formula (``tools/autograd/derivatives.yaml``)
and meta kernel (``torch/_meta_registrations.py``) then put the CUDA op's saved tensors
and backward op into the joint graph. The liveness analysis then counts each storage as
the CUDA caching allocator does (``block_bytes``), and the fixed workspaces are static
memory (``workspace_bytes``).

Kernel choices that change memory, and which of them are modelled:

- Scaled dot-product attention (modelled): ``sdp::select_sdp_backend``
  (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, pytorch/pytorch commit
  001f694a) tries the backends in ``priority_order`` and takes the first whose checks
  pass. The default order is ``{flash, efficient, math, cudnn}``
  (``aten/src/ATen/Context.h``, ``sdp_priority_order``); ``check_prefer_cudnn_attention``
  puts cuDNN first when the runtime cuDNN is newer than 9.15.0 on SM 9.x / 10.x (with
  CUDA < 13 builds: minor 0 or 3) unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set. What
  each backend saves for backward (its meta kernel): flash: the output and a log-sum-exp
  ``[B, H, S]`` fp32, plus philox seed ``(2,)`` and offset ``()`` uint64; efficient: the
  output, a log-sum-exp ``[B, H, ceil(S/32)*32]`` fp32, seed and offset ``()`` int64;
  cuDNN: the output, a log-sum-exp ``[B, H, S, 1]`` fp32, seed and offset; math: the
  ``S x S`` probabilities (decomposed). Nested tensors, ROCm, FlashAttention-3 and fp8
  are not modelled.
- Cross entropy (nothing to model): ``cross_entropy_loss`` is ``log_softmax`` then
  ``nll_loss`` on every device (``aten/src/ATen/native/LossNLL.cpp``); PyTorch has no
  fused CUDA cross-entropy kernel, so the CPU trace already holds the CUDA ops.
- Dropout: a traced step holds ``native_dropout`` on both devices (AOTAutograd's
  decomposition), its mask saved as bool on both. The user's eager program (modelled,
  ``eager_dropout_as_on_cuda``) takes ATen's fused ``native_dropout`` on CUDA (a bool
  mask) where the CPU saves a float noise tensor.
- ``F.rms_norm`` / ``nn.RMSNorm`` (not modelled): the CPU trace holds the composite
  (``pow``, ``mean``, ``rsqrt``); a CUDA build may call ``_fused_rms_norm``, which saves
  ``rstd`` only. Hugging Face Llama / Mistral write their RMSNorm by hand and are
  unaffected. Code that branches on ``x.device.type == "cuda"`` in Python is not seen.

Caching allocator (``c10/cuda/CUDACachingAllocator.cpp``):

- ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` = 512
  bytes (without ``roundup_power2_divisions`` in ``PYTORCH_CUDA_ALLOC_CONF``).
  ``memory_allocated`` counts the block size after the optional split
  (``alloc_found_block``). ``should_split`` splits a small-pool block (<= 1 MiB) when
  512 bytes or more remain, a large-pool block only when more than 1 MiB
  (``kSmallSize``) remains, and every block with ``expandable_segments:True``. So
  ``block_bytes`` (512 rounding) is exact with expandable segments and for requests of
  at most 1 MiB; a larger request may be charged up to 1 MiB more when it lands in a
  cached block whose remainder is not split, which depends on the allocation history
  (``large_block_bytes_bound``). A request that opens a new segment
  (``get_allocation_size``: <= 1 MiB -> 2 MiB, < 10 MiB -> 20 MiB, else rounded up to
  2 MiB) is charged ``fresh_segment_block_bytes``.
- cuBLAS workspace (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
  ``getChosenWorkspaceSize`` / ``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG``
  ``:SIZE_KiB:COUNT`` pairs summed, else 4096 KiB x 8 = 32 MiB on SM 9.x (Hopper),
  otherwise 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB. It is allocated through the caching
  allocator, one per (handle, stream), and kept until ``clearCublasWorkspaces``; the
  forward thread and the autograd engine's device thread hold one each, so a training
  step keeps 2 after its first backward. cuBLASLt shares it by default
  (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``). This is static memory, not step activation;
  it was read from the source, not measured here (no GPU was available).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "GPUS", "CudaAllocatorModel", "CudaKernels", "GpuSpec", "MIN_BLOCK_BYTES", "block_bytes",
    "cublas_workspace_bytes", "fresh_segment_block_bytes", "large_block_bytes_bound",
    "priority_order", "select_sdpa_backend",
]

aten = torch.ops.aten
MiB = 1 << 20
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 * MiB  # kSmallSize: the largest small-pool request
SMALL_BUFFER_BYTES = 2 * MiB  # kSmallBuffer: small-pool segments
LARGE_BUFFER_BYTES = 20 * MiB  # kLargeBuffer: segments for requests of 1-10 MiB
MIN_LARGE_ALLOC_BYTES = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MiB  # kRoundLarge
SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The GPU and library state that the SDPA backend checks and workspace sizes read.

    Attributes:
        name: a label (``"h100"``).
        sm: compute capability ``(major, minor)`` (H100 / H200: ``(9, 0)``).
        cudnn_version: runtime cuDNN as ``torch.backends.cudnn.version()`` reports it
            (``91002`` is 9.10.2); None: no cuDNN.
        cuda_major: CUDA major version of the PyTorch build (12 or 13).
        enabled: SDPA backends left on (``torch.backends.cuda.enable_*_sdp``).
        priority: an explicit order (``sdpa_kernel(..., set_priority=True)``); None:
            the default.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (disables cuDNN SDPA).
        cudnn_sdpa_deprioritized: the environment sets ``TORCH_CUDNN_SDPA_DEPRIORITIZED``.
    """

    name: str = "h100"
    sm: tuple[int, int] = (9, 0)
    cudnn_version: int | None = 91002
    cuda_major: int = 12
    enabled: tuple[str, ...] = SDPA_BACKENDS
    priority: tuple[str, ...] | None = None
    deterministic: bool = False
    cudnn_sdpa_deprioritized: bool = False

    @classmethod
    def detect(cls) -> "GpuSpec":
        """The spec of the current CUDA device (needs a CUDA build with a GPU).

        Raises:
            RuntimeError: no CUDA device.
        """
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device to detect: name a GPU spec instead")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        enabled = tuple(b for b, on in (
            ("flash", torch.backends.cuda.flash_sdp_enabled()),
            ("efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
            ("math", torch.backends.cuda.math_sdp_enabled()),
            ("cudnn", torch.backends.cuda.cudnn_sdp_enabled())) if on)
        cuda = torch.version.cuda or "12.0"
        return cls(name=props.name, sm=(props.major, props.minor), cudnn_version=torch.backends.cudnn.version(),
                   cuda_major=int(cuda.split(".")[0]), enabled=enabled,
                   deterministic=torch.are_deterministic_algorithms_enabled(),
                   cudnn_sdpa_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1")


# Named targets for --gpu; cuDNN 9.10.2 is what CUDA 12.x wheels of recent PyTorch ship.
GPUS: Mapping[str, GpuSpec] = {
    "h100": GpuSpec("h100", (9, 0)),
    "h200": GpuSpec("h200", (9, 0)),
    "a100": GpuSpec("a100", (8, 0)),
    "l40s": GpuSpec("l40s", (8, 9)),
}


# --------------------------------------------------------------------------- SDPA


def priority_order(gpu: GpuSpec) -> tuple[str, ...]:
    """The order in which ``select_sdp_backend`` tries the backends
    (``priority_order`` / ``check_prefer_cudnn_attention`` in sdp_utils.cpp)."""
    if gpu.priority is not None:
        return gpu.priority
    major, minor = gpu.sm
    prefer_cudnn = (not gpu.cudnn_sdpa_deprioritized and gpu.cudnn_version is not None
                    and gpu.cudnn_version > 91500 and major in (9, 10)
                    and (gpu.cuda_major >= 13 or minor in (0, 3)))
    return ("cudnn", "flash", "efficient", "math") if prefer_cudnn else SDPA_BACKENDS


def _sm_between(sm: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= sm <= hi


def _dense_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, supports_gqa: bool = True) -> bool:
    """check_tensor_shapes, check_nonzero_sequence_lengths_dense,
    check_last_dim_stride_equals_1_dense, check_batch_size_and_num_heads_dense<supports_gqa>:
    with fewer key/value heads than query heads only a backend that supports grouped-query
    attention passes, and only under ``enable_gqa`` (flash and cuDNN do; memory-efficient
    attention is instantiated with ``supports_grouped_query_attention=false``)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if min(q.shape[-2], k.shape[-2], v.shape[-2]) == 0:
        return False
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (q, k, v)):
        return False
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if hk != hv or hq % hk:
        return False
    return hq == hk or (enable_gqa and supports_gqa)


def _can_use_flash(q, k, v, mask, dropout_p, is_causal, gpu, enable_gqa) -> bool:  # noqa: ANN001
    """use_flash_attention's checks (sm80-sm121, fp16/bf16, no mask, head dim <= 256)."""
    d = q.shape[-1]
    if mask is not None or not (d == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    if not _sm_between(gpu.sm, (8, 0), (12, 1)) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    small_smem = _sm_between(gpu.sm, (8, 6), (8, 9)) or _sm_between(gpu.sm, (12, 0), (12, 1))
    if needs_grad and small_smem and not (d <= 192 or (dropout_p == 0 and d > 224)):
        return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    return _dense_4d(q, k, v, enable_gqa)


def _can_use_efficient(q, k, v, mask, dropout_p, is_causal, gpu, enable_gqa) -> bool:  # noqa: ANN001
    """use_mem_efficient_attention's checks (sm50-sm121, gemm alignment of head dims and
    storage offsets, fp32 also on sm80+; masks allowed; no grouped-query attention, so
    fp32 GQA falls through to math)."""
    if not _sm_between(gpu.sm, (5, 0), (12, 1)):
        return False
    half = q.dtype in (torch.float16, torch.bfloat16)
    align = 4 if gpu.sm[0] >= 8 else 1
    if gpu.sm[0] >= 8 or (gpu.sm[0] >= 7 and half):  # use_tensor_cores
        align = max(align, 128 // (16 if half else 32))
    dq, dv = q.shape[-1], v.shape[-1]
    if not (dq == k.shape[-1] and dq > 0 and dv > 0 and dq % align == 0 and dv % align == 0):
        return False
    if gpu.sm[0] >= 8:
        align_bytes = align * q.element_size()
        if any(t.numel() and (t.storage_offset() * t.element_size()) % align_bytes for t in (q, k, v)):
            return False
    ok = (torch.float16, torch.float32, torch.bfloat16) if gpu.sm[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype in ok and _dense_4d(q, k, v, enable_gqa, supports_gqa=False)


def _can_use_cudnn(q, k, v, mask, dropout_p, is_causal, gpu, enable_gqa) -> bool:  # noqa: ANN001
    """use_cudnn_attention's checks (cuDNN >= 9, fp16/bf16, sm80-sm121, head dims)."""
    cv = gpu.cudnn_version
    if cv is None or cv < 90000 or gpu.deterministic or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if (dropout_p > 0 and 91100 < cv < 91400) or not _sm_between(gpu.sm, (8, 0), (12, 1)):
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0) or not _dense_4d(q, k, v, enable_gqa):
        return False
    b, h, sq, dqk = q.shape
    sk, dv = k.shape[2], v.shape[3]
    hopper_or_blackwell = gpu.sm == (9, 0) or gpu.sm[0] == 10
    limit = 256 if hopper_or_blackwell and cv > 92200 else 128
    if hopper_or_blackwell and cv >= 91100 and dqk == 192 and dv == 128:
        limit = max(limit, 192)
    return (b <= 65535 and h <= 65535 and dqk <= limit and dv <= limit and dqk % 8 == 0 and dv % 8 == 0
            and sk != 1 and not (dropout_p and sq == 1))


_CHECKS: Mapping[str, Callable[..., bool]] = {
    "flash": _can_use_flash, "efficient": _can_use_efficient, "cudnn": _can_use_cudnn,
    "math": lambda *a: True,
}


def select_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                        dropout_p: float = 0.0, is_causal: bool = False, gpu: GpuSpec = GpuSpec(),
                        enable_gqa: bool = False) -> str:
    """The backend ``select_sdp_backend`` picks on ``gpu``: the first of
    ``priority_order(gpu)`` that is enabled and whose checks pass.

    Args:
        q, k, v: ``[B, H, S, D]`` tensors (real, meta or fake); attn_mask, dropout_p,
            is_causal, enable_gqa: as ``F.scaled_dot_product_attention``.
        gpu: the target.

    Returns:
        ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``.

    Raises:
        RuntimeError: every backend is disabled or fails its checks (as on the GPU).

    Example:
        >>> q = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16, device="meta")
        >>> select_sdpa_backend(q, q, q, is_causal=True), select_sdpa_backend(q.float(), q.float(), q.float())
        ('flash', 'efficient')
    """
    for name in priority_order(gpu):
        if name in gpu.enabled and _CHECKS[name](q, k, v, attn_mask, dropout_p, is_causal, gpu, enable_gqa):
            return name
    raise RuntimeError(f"no SDPA backend is available on {gpu.name} for q {tuple(q.shape)} {q.dtype}")


def _float_mask(mask: Any, dtype: torch.dtype, fill: float) -> Any:
    """attention.cpp convert_boolean_attn_mask(_cudnn): a bool mask becomes 0 / ``fill``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _padded_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """attention.cpp preprocess_mask: pad the last dim to a multiple of 8 unless
    aligned, then expand to ``[B, H, Sq, Sk]``."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        s = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - s % 8))[..., :s]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    d = t.shape[-1]
    return t if d % 8 == 0 else F.pad(t, (0, 8 - d % 8))


def sdpa_as_on_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, gpu: GpuSpec = GpuSpec()) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as ``at::native::scaled_dot_product_attention``
    runs it on ``gpu`` (``aten/src/ATen/native/transformers/attention.cpp``): the aten op
    of the chosen backend, with that function's mask and head-dim preprocessing.

    Returns:
        The attention output ``[B, H, Sq, Dv]``.
    """
    backend = select_sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, gpu, enable_gqa)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if backend == "flash":
        d = q.shape[-1]
        sc = scale if scale is not None else 1.0 / math.sqrt(d)
        out = aten._scaled_dot_product_flash_attention(
            _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), dropout_p, is_causal, False, scale=sc)[0]
        return out if out.shape[-1] == d else out[..., :d]
    if backend == "efficient":
        mask = _float_mask(attn_mask, q.dtype, -math.inf)
        mask = None if mask is None else _padded_mask(mask, q, k)
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, needs_grad, dropout_p, is_causal,
                                                           scale=scale)[0]
    if backend == "cudnn":
        mask = _float_mask(attn_mask, q.dtype, -65504.0)
        return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, needs_grad, dropout_p, is_causal, False,
                                                       scale=scale)[0]
    mask = _float_mask(attn_mask, q.dtype, -math.inf)
    return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal, None, scale=scale,
                                                   enable_gqa=enable_gqa)[0]


def eager_dropout_as_on_cuda(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` (``F.dropout``'s arguments: input, p, training, inplace)
    as eager ATen runs it on a CUDA tensor, or ``NotImplemented`` where it runs as on the
    CPU. ``at::dropout`` (``aten/src/ATen/native/
    Dropout.cpp``) takes the fused kernel, ``std::get<0>(at::native_dropout(input, p,
    train))``, when training with ``0 < p < 1`` on a non-empty CUDA tensor
    (``is_fused_kernel_acceptable``): autograd then saves a bool mask, where the CPU's
    ``_dropout_impl`` saves a float noise tensor. In-place ``dropout_`` and the feature /
    alpha variants take the unfused path on both devices."""
    x = args[0] if args else kwargs.get("input")
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    train = kwargs.get("train", kwargs.get("training", args[2] if len(args) > 2 else True))
    inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
    if not isinstance(x, torch.Tensor) or inplace or not train or not 0 < p < 1 or x.numel() == 0:
        return NotImplemented
    return torch.ops.aten.native_dropout.default(x, float(p), True)[0]


@contextlib.contextmanager
def eager_kernels_on_cuda(gpu: GpuSpec = GpuSpec()) -> Iterator[None]:
    """While active, the user's eager code runs attention and dropout as on ``gpu``:
    ``torch.nn.functional.scaled_dot_product_attention`` as ``sdpa_as_on_cuda`` and
    ``torch.nn.functional.dropout`` as ``eager_dropout_as_on_cuda``. The module's
    attributes are replaced (and restored), not a ``TorchFunctionMode`` pushed: a mode
    is popped while its handler runs, so ``loss.backward()`` under it would run a
    checkpoint's recompute as on the CPU (``torch.utils.checkpoint`` then refuses the
    recomputed mask's dtype). Code that bound these functions under another name before
    (``from torch.nn.functional import dropout``) or calls ``torch.dropout`` directly
    is not seen."""
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def attention(*args: Any, **kwargs: Any) -> Any:
        return sdpa_as_on_cuda(*args, **kwargs, gpu=gpu)

    def eager_dropout(*args: Any, **kwargs: Any) -> Any:
        out = eager_dropout_as_on_cuda(dropout, args, kwargs)
        return dropout(*args, **kwargs) if out is NotImplemented else out

    F.scaled_dot_product_attention, F.dropout = attention, eager_dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout  # type: ignore[assignment]


class CudaKernels(TorchFunctionMode):
    """While active, ops whose CUDA kernel saves other tensors than the CPU one trace as
    on ``gpu``: ``F.scaled_dot_product_attention`` becomes the aten op of the backend
    ``select_sdpa_backend`` picks (``sdpa_as_on_cuda``). A traced step already holds
    ``native_dropout`` (AOTAutograd's decomposition); the user's eager program is
    recorded under ``eager_kernels_on_cuda`` instead.

    Attributes:
        gpu: the target.
        chosen: ``(backend, q shape, dtype)`` of every attention call, in call order.
    """

    def __init__(self, gpu: GpuSpec = GpuSpec()):
        super().__init__()
        self.gpu = gpu
        self.chosen: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            gqa = kwargs.get("enable_gqa", False)
            self.chosen.append((select_sdpa_backend(q, k, v, mask, p, causal, self.gpu, gqa), tuple(q.shape), q.dtype))
            return sdpa_as_on_cuda(*args, **kwargs, gpu=self.gpu)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- allocator


def block_bytes(nbytes: int) -> int:
    """``round_size``: the request rounded up to a multiple of 512 bytes (0 stays 0).
    The one CUDA rounding: ``MemoryModel.allocator_bytes`` (every storage and held
    scratch liveness counts) and ``static_memory`` call it.

    Example:
        >>> block_bytes(1), block_bytes(512), block_bytes(513)
        (512, 512, 1024)
    """
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES if nbytes > 0 else 0


def large_block_bytes_bound(nbytes: int) -> int:
    """The most ``memory_allocated`` can be charged for one request without expandable
    segments: a large-pool block (> 1 MiB) is split only when more than 1 MiB remains,
    so up to 1 MiB more than ``block_bytes`` (``should_split``)."""
    rounded = block_bytes(nbytes)
    return rounded + SMALL_SIZE_BYTES if rounded > SMALL_SIZE_BYTES else rounded


def fresh_segment_block_bytes(nbytes: int) -> int:
    """What a request that opens a new segment is charged (``get_allocation_size`` then
    ``should_split``): the rounded size, or the whole segment when a request of 10 MiB or
    more leaves at most 1 MiB of its 2 MiB-rounded segment.

    Example:
        >>> fresh_segment_block_bytes(23 * 2**19) // 2**19, fresh_segment_block_bytes(21 * 2**20) // 2**20
        (24, 22)
    """
    rounded = block_bytes(nbytes)
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return rounded
    segment = -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
    return rounded if segment - rounded > SMALL_SIZE_BYTES else segment


def cublas_workspace_bytes(gpu: GpuSpec = GpuSpec(), env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS workspace (``getChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs, summed) when set, else 32 MiB on SM 9.x, 8.125 MiB
    otherwise.

    Raises:
        ValueError: ``CUBLAS_WORKSPACE_CONFIG`` is not ``:SIZE:COUNT[:SIZE:COUNT...]``.

    Example:
        >>> cublas_workspace_bytes() // 2**20, cublas_workspace_bytes(GPUS["a100"])
        (32, 8519680)
        >>> cublas_workspace_bytes(env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) // 2**20
        32
    """
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        parts = config.split(":")[1:]
        if len(parts) % 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG={config!r} is not :SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]")
        return sum(int(size) * 1024 * int(count) for size, count in zip(parts[::2], parts[1::2]))
    if gpu.sm[0] == 9:
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclasses.dataclass(frozen=True)
class CudaAllocatorModel:
    """The fixed per-process workspaces of the CUDA target, for the static-memory
    accounting (``static_memory.StaticOptions.cuda``). Storages are counted by
    ``block_bytes`` (through ``memory_model.MemoryModel.allocator_bytes`` and
    ``static_memory``); op scratch on CUDA is not modelled (the memory model's table has
    CPU entries only).

    Attributes:
        gpu: the target.
        workspace_handles: cuBLAS workspaces held during training (the forward thread's
            and the autograd engine's device thread's).
    """

    gpu: GpuSpec = GpuSpec()
    workspace_handles: int = 2

    def workspace_bytes(self, env: Mapping[str, str] | None = None) -> int:
        """Static workspace bytes: ``workspace_handles`` cuBLAS workspaces
        (``cublas_workspace_bytes``).

        Raises:
            ValueError: a malformed ``CUBLAS_WORKSPACE_CONFIG``.
        """
        return self.workspace_handles * cublas_workspace_bytes(self.gpu, env)
