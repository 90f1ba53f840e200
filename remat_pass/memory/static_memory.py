"""Static memory of a training step, and what a device of N bytes leaves for activations.

Static memory exists before the step starts and after it ends (DESIGN.md, Memory
accounting): the parameters, buffers and batch that are the step's primals, the
optimizer's states, an fp32 master copy of the parameters in mixed-precision training,
and on CUDA the cuBLAS workspaces. The step's own peak (``liveness``) is activation
memory on top of it, and it already holds the gradients: PyTorch's
``zero_grad(set_to_none=True)`` (the default since 2.0) frees them after each step, so
backward allocates them during the step and they are live at its peak. They are listed
here (``gradient_bytes``) but not added to the static total.

Optimizer states (``torch/optim/adam.py`` ``Adam._init_group``, which ``AdamW``
inherits; ``torch/optim/sgd.py``):

- ``adamw`` / ``adam``: ``exp_avg`` and ``exp_avg_sq``, each ``zeros_like(p)``: two
  tensors per parameter in the dtype of the parameter they update, so fp32 with fp32
  parameters or with ``master_weights`` (the optimizer then updates the fp32 copy), and
  bf16 for bf16 parameters updated directly. ``step`` is a 0-dim fp32 tensor on the CPU
  unless ``capturable`` or ``fused`` (4 host bytes per parameter, no device bytes).
- ``sgd``: ``torch.optim.SGD`` with its default ``momentum=0`` keeps no state;
  ``sgd-momentum``: one ``momentum_buffer`` per parameter (a clone of its gradient).
- ``none``: no optimizer (the step alone).

``master_weights``: an fp32 copy of every parameter that is not fp32 (Megatron-LM's
``--bf16`` with fp32 main parameters; torch.amp users keep fp32 parameters instead and
need no copy).

On CUDA every tensor is its own allocator block, counted as ``cuda_target.block_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from .cuda_target import CudaAllocatorModel, block_bytes
from ..errors import RematError

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "none")
_STATES_PER_PARAMETER = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}
_HOST_STEP_BYTES = {"adamw": 4, "adam": 4}


@dataclasses.dataclass(frozen=True)
class StaticOptions:
    """What lives beside the step (frozen).

    Attributes:
        optimizer: one of ``OPTIMIZERS``.
        master_weights: keep an fp32 copy of the non-fp32 parameters; the optimizer's
            states are then fp32.
        allocator: ``"cpu"`` (exact bytes) or ``"cuda"`` (512-byte blocks, cuBLAS
            workspaces).
        cuda: the CUDA allocator model (workspace size) for ``allocator="cuda"``.
    """

    optimizer: str = "none"
    master_weights: bool = False
    allocator: str = "cpu"
    cuda: CudaAllocatorModel = CudaAllocatorModel()

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.allocator not in ("cpu", "cuda"):
            raise ValueError(f"allocator {self.allocator!r} is not one of cpu, cuda")


@dataclasses.dataclass(frozen=True)
class StaticTensor:
    """One static tensor: its kind (``"param"``, ``"buffer"``, ``"input"``), element
    count, dtype and storage bytes, and how many identical copies there are (``count``:
    e.g. one per layer)."""

    kind: str
    numel: int
    dtype: torch.dtype
    nbytes: int
    count: int = 1


@dataclasses.dataclass(frozen=True)
class StaticMemory:
    """Static bytes by part (all in bytes).

    Attributes:
        parameter_bytes, buffer_bytes, batch_bytes: the step's primals.
        other_bytes: the rest of the step's static storages (the loss's tangent, graph
            constants).
        optimizer_state_bytes: the optimizer's states on the device.
        master_weight_bytes: fp32 copies of the non-fp32 parameters.
        workspace_bytes: fixed library workspaces (cuBLAS on CUDA).
        gradient_bytes: the parameters' gradients; allocated by the step and counted in
            its activation peak, not in ``total_bytes``.
        optimizer, master_weights, allocator: the options used.
    """

    parameter_bytes: int
    buffer_bytes: int
    batch_bytes: int
    other_bytes: int
    optimizer_state_bytes: int
    master_weight_bytes: int
    workspace_bytes: int
    gradient_bytes: int
    optimizer: str
    master_weights: bool
    allocator: str

    @property
    def total_bytes(self) -> int:
        """Everything static (the gradients excluded: they are in the step's peak)."""
        return (self.parameter_bytes + self.buffer_bytes + self.batch_bytes + self.other_bytes
                + self.optimizer_state_bytes + self.master_weight_bytes + self.workspace_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every part, ``total_bytes`` and the options."""
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def static_tensors(values: Sequence[torch.Tensor], kinds: Sequence[str]) -> list[StaticTensor]:
    """StaticTensors of the primals of a step (real, meta or fake tensors; a storage
    shared by several is counted once, by the first)."""
    seen: set[int] = set()
    out = []
    for v, kind in zip(values, kinds):
        key = v.untyped_storage()._cdata
        nbytes = 0 if key in seen else int(v.untyped_storage().nbytes())
        seen.add(key)
        out.append(StaticTensor(kind, int(v.numel()), v.dtype, nbytes))
    return out


def static_memory(tensors: Sequence[StaticTensor], options: StaticOptions = StaticOptions(),
                  other_bytes: int = 0) -> StaticMemory:
    """Static memory of a step whose primals are ``tensors`` (module docstring).

    Args:
        tensors: the primals (``static_tensors``); parameters have kind ``"param"``.
        options: optimizer, master weights, allocator.
        other_bytes: other static storages of the step, as the allocator counts them.

    Returns:
        The StaticMemory.

    Example:
        A 1000-parameter bf16 layer with AdamW: 2,000 bytes of parameters, two bf16
        states (4,000 bytes) and its host step counter (4 bytes); with fp32 master weights 4,000 bytes more and fp32 states.

        >>> p = [StaticTensor("param", 1000, torch.bfloat16, 2000)]
        >>> s = static_memory(p, StaticOptions("adamw"))
        >>> s.parameter_bytes, s.optimizer_state_bytes, s.gradient_bytes, s.total_bytes
        (2000, 4004, 2000, 6004)
        >>> s = static_memory(p, StaticOptions("adamw", master_weights=True))
        >>> s.master_weight_bytes, s.optimizer_state_bytes
        (4000, 8004)
    """
    cuda = options.allocator == "cuda"

    def size(nbytes: int) -> int:
        return block_bytes(nbytes) if cuda else nbytes

    by_kind = {"param": 0, "buffer": 0, "input": 0}
    states = master = grads = host_steps = 0
    per_state = _STATES_PER_PARAMETER[options.optimizer]
    for t in tensors:
        if t.kind not in by_kind:
            raise ValueError(f"static tensor kind {t.kind!r} is not one of param, buffer, input")
        by_kind[t.kind] += size(t.nbytes) * t.count
        if t.kind != "param" or not t.nbytes:
            continue
        grads += size(t.nbytes) * t.count
        needs_copy = options.master_weights and t.dtype != torch.float32
        state_bytes = t.numel * 4 if options.master_weights else t.nbytes
        if needs_copy:
            master += size(t.numel * 4) * t.count
        states += per_state * size(state_bytes) * t.count
        host_steps += _HOST_STEP_BYTES.get(options.optimizer, 0) * t.count
    if not cuda:  # the 0-dim step tensors live in host memory, which is the device here
        states += host_steps
    return StaticMemory(
        parameter_bytes=by_kind["param"], buffer_bytes=by_kind["buffer"], batch_bytes=by_kind["input"],
        other_bytes=other_bytes, optimizer_state_bytes=states, master_weight_bytes=master,
        workspace_bytes=options.cuda.workspace_bytes() if cuda else 0, gradient_bytes=grads,
        optimizer=options.optimizer, master_weights=options.master_weights, allocator=options.allocator)


def activation_budget(device_memory_bytes: int, static: StaticMemory) -> int:
    """Bytes a device of ``device_memory_bytes`` leaves for the step's activation peak:
    ``device_memory_bytes - static.total_bytes``.

    Raises:
        RematError: the static memory alone does not fit the device.

    Example:
        >>> s = static_memory([StaticTensor("param", 10, torch.float32, 40)], StaticOptions("adamw"))
        >>> activation_budget(1000, s)
        876
    """
    left = device_memory_bytes - static.total_bytes
    if left <= 0:
        raise RematError(
            f"the device memory ({device_memory_bytes} bytes) does not hold the static memory alone "
            f"({static.total_bytes} bytes: parameters {static.parameter_bytes}, optimizer states "
            f"{static.optimizer_state_bytes}, master weights {static.master_weight_bytes}, workspaces "
            f"{static.workspace_bytes}, batch and buffers {static.batch_bytes + static.buffer_bytes}); "
            "shard the model or the optimizer, or use a smaller optimizer")
    return left
