"""The memory model: what a value's storage and an op's scratch cost on the target device.

One frozen value, ``MemoryModel``, answers the two questions liveness asks of a step:

- the bytes the allocator gives a storage (``allocator_bytes``): exact on the CPU,
  rounded up to 512-byte blocks by the CUDA caching allocator (``kMinBlockSize``), and
  the **real** size of an op's outputs where it differs from the FakeTensor's
  (``NodeMemory.output_storage_bytes``: ``mse_loss(mean)`` keeps an N-element storage
  behind its 0-dim result);
- the **scratch** of an op: the bytes it allocates and frees inside itself (workspaces,
  per-thread buffers, upcast copies), live during that op only.

Both come, per op signature (``op_signature``: op, shapes, strides, dtypes, aliasing,
thread count), from **calibration** (the op run alone under the allocator profiler on
this machine, ``calibration.Calibrator``) when the model holds a figure for it, else
from the **table** of formulas read from the ATen source (``scratch_table``), else
nothing is known (``"none"``: 0 bytes assumed). ``NodeMemory.source`` says which, so a
report can name the ops whose figure was not calibrated.

The device and allocator part is deliberately small: ``device`` picks the kernels whose
scratch is modelled (only CPU has table entries), ``allocator`` the rounding
(``allocator_bytes``, which rounds by ``cuda_target.block_bytes``, the one CUDA
rounding); new allocator rules belong in ``allocator_bytes``. The RNG-replay wrapper
``run_with_rng_state`` adds its copy of the CPU generator state
(``costs.replay_state_bytes``) to the scratch of the op it wraps.
"""

from __future__ import annotations

import dataclasses
import operator
import types
from typing import Any, Mapping

import torch
import torch.fx as fx

from ..graph.costs import replay_state_bytes, storage_nbytes, transient_bytes
from ..graph.op_signature import cpu_flags, host_identity, op_call, output_values, signature_of
from .cuda_target import block_bytes
from .scratch_table import table_entry

ALLOCATORS = ("cpu", "cuda")
SOURCES = ("calibrated", "table", "none")
"""Where a node's scratch figure came from: calibration on this machine, the formula
table, or nowhere (0 bytes assumed)."""


@dataclasses.dataclass(frozen=True)
class OpMemory:
    """One op signature's allocator behaviour, as calibration measured it (bytes).

    Attributes:
        transient_bytes: peak of the running sum while the op ran minus what it left
            allocated at its end.
        output_storage_bytes: real storage bytes of each tensor output, in output
            order; 0 for one that aliases an input or an earlier output.
        retained_bytes: what the op left allocated beyond its outputs (a cache); 0 for
            every op seen so far.
        stable: every measured repetition gave the same allocator events (when not,
            the largest figures are kept).
    """

    transient_bytes: int
    output_storage_bytes: tuple[int, ...]
    retained_bytes: int = 0
    stable: bool = True

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (a calibration cache entry)."""
        return {"transient_bytes": self.transient_bytes, "output_storage_bytes": list(self.output_storage_bytes),
                "retained_bytes": self.retained_bytes, "stable": self.stable}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "OpMemory":
        """The OpMemory of a ``to_json`` dict.

        Raises:
            ValueError: a field is missing or not an integer / list of integers.
        """
        try:
            out = tuple(int(b) for b in d["output_storage_bytes"])
            return cls(int(d["transient_bytes"]), out, int(d.get("retained_bytes", 0)), bool(d.get("stable", True)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an op-memory entry: {d!r} ({e})") from e


@dataclasses.dataclass(frozen=True)
class NodeMemory:
    """What the memory model says about the op one step runs.

    Attributes:
        node: the node's name.
        op: the aten op (``"aten.mm.default"``); for an RNG wrapper, the op it wraps.
        scratch_bytes: bytes the op allocates and frees inside itself.
        source: ``"calibrated"``, ``"table"`` or ``"none"`` (see ``SOURCES``).
        detail: the ATen source of a table formula, or why there is no figure.
        output_storage_bytes: real storage bytes of each tensor output (in output
            order, as ``op_signature.output_values`` without the Nones), or None when
            the FakeTensor sizes are right.
    """

    node: str
    op: str
    scratch_bytes: int
    source: str
    detail: str = ""
    output_storage_bytes: tuple[int, ...] | None = None

    @property
    def calibrated(self) -> bool:
        """Whether the scratch figure was measured on this machine."""
        return self.source == "calibrated"


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(mapping or {}))


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryModel:
    """Storage and op-scratch bytes on one target device (see the module docstring).

    Attributes:
        device: the device the ops run on: ``"cpu"`` or ``"cuda"``.
        allocator: ``"cpu"`` (exact bytes) or ``"cuda"`` (512-byte blocks).
        threads: the intra-op thread count the step runs with (a CPU op's scratch
            depends on it).
        flags: the CPU's ISA flags the table reads (``op_signature.cpu_flags``).
        host: what the calibrated figures are valid for (``op_signature.host_identity``).
        calibrated: OpSignature key -> OpMemory, the figures measured on ``host``.
        not_calibrated: OpSignature key -> why calibration gave no figure (the op
            raised on synthetic inputs, ...).

    Example:
        >>> MemoryModel.table_only("cuda", threads=1).allocator_bytes(1000)
        1024
    """

    device: str = "cpu"
    allocator: str = "cpu"
    threads: int = 1
    flags: frozenset = frozenset()
    host: str = ""
    calibrated: Mapping[str, OpMemory] = dataclasses.field(default_factory=lambda: _frozen(None))
    not_calibrated: Mapping[str, str] = dataclasses.field(default_factory=lambda: _frozen(None))

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator {self.allocator!r} is not one of {ALLOCATORS}")
        if self.device not in ALLOCATORS:
            raise ValueError(f"device {self.device!r} is not one of {ALLOCATORS}")
        object.__setattr__(self, "calibrated", _frozen(self.calibrated))
        object.__setattr__(self, "not_calibrated", _frozen(self.not_calibrated))

    @classmethod
    def table_only(cls, allocator: str = "cpu", threads: int | None = None) -> "MemoryModel":
        """The model without calibrated figures: the formula table for the device the
        allocator belongs to, at ``threads`` (default: ``torch.get_num_threads()``).

        Raises:
            ValueError: unknown allocator.
        """
        if allocator not in ALLOCATORS:
            raise ValueError(f"allocator {allocator!r} is not one of {ALLOCATORS}")
        return cls(device=allocator, allocator=allocator, threads=threads or torch.get_num_threads(),
                   flags=cpu_flags() if allocator == "cpu" else frozenset(), host=host_identity(allocator))

    def with_calibration(self, calibrated: Mapping[str, OpMemory], not_calibrated: Mapping[str, str]) -> "MemoryModel":
        """This model with more calibrated figures (and calibration failures)."""
        return dataclasses.replace(self, calibrated={**self.calibrated, **calibrated},
                                   not_calibrated={**self.not_calibrated, **not_calibrated})

    def allocator_bytes(self, nbytes: Any) -> int:
        """Bytes the allocator gives a request of ``nbytes``: exact on CPU, rounded up
        to a multiple of 512 on CUDA (``cuda_target.block_bytes``: the caching
        allocator's ``round_size``, ``kMinBlockSize``).

        Raises:
            ValueError: a symbolic (non-integer) size; use the symbolic model.
        """
        if not isinstance(nbytes, int):
            try:
                nbytes = int(nbytes)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"storage size {nbytes} is symbolic; concrete liveness needs concrete "
                    "shapes (use the symbolic model)"
                ) from e
        return block_bytes(nbytes) if self.allocator == "cuda" else nbytes

    def storage_bytes(self, val: torch.Tensor) -> int:
        """Allocator bytes of the FakeTensor storage of ``val`` (no output correction:
        see ``node_memory``)."""
        return self.allocator_bytes(storage_nbytes(val))

    def node_memory(self, node: fx.Node) -> NodeMemory | None:
        """The scratch and real output sizes of the op ``node`` runs; None when it runs
        nothing (``getitem``, ``get_attr``, placeholders). A call of something other than
        an aten op (a higher-order op) has source ``"none"``."""
        call = op_call(node)
        if call is None:
            if node.op != "call_function" or node.target is operator.getitem:
                return None
            name = getattr(node.target, "__name__", str(node.target))
            return NodeMemory(node.name, name, transient_bytes(node), "none", "not an aten op: not calibrated")
        op = str(call.op)
        wrapper = replay_state_bytes(call.wrapper, self.device)
        sig = signature_of(node, self.threads)
        if sig is None:
            return NodeMemory(node.name, op, transient_bytes(node), "none", "symbolic or unreadable arguments")
        measured = self.calibrated.get(sig.key)
        if measured is not None:
            return NodeMemory(node.name, op, measured.transient_bytes + wrapper, "calibrated", "",
                              measured.output_storage_bytes)
        entry = table_entry(sig, call.op, self.flags, self.device)
        if entry is not None:
            return NodeMemory(node.name, op, entry.transient_bytes + wrapper, "table", entry.source,
                              entry.output_storage_bytes)
        why = self.not_calibrated.get(sig.key, "not calibrated and not in the table")
        return NodeMemory(node.name, op, wrapper, "none", why)

    def could_move_bytes(self, node: fx.Node, memory: NodeMemory | None) -> int:
        """How far the figure of ``node``'s step could be off when its scratch is not
        calibrated: the larger of the figure used and the op's operand bytes (the
        storages of its tensor inputs and outputs: a kernel that copies each operand
        once, as contiguous copies, upcasts and reorders do). An estimate, not a bound:
        calibrate on the target machine to know. 0 when calibrated or no op runs."""
        if memory is None or memory.calibrated:
            return 0
        seen: dict[int, int] = {}
        vals = [a.meta.get("val") for a in node.all_input_nodes] + output_values(node)
        for v in vals:
            for t in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(t, torch.Tensor):
                    seen[t.untyped_storage()._cdata] = self.allocator_bytes(storage_nbytes(t))
        return max(memory.scratch_bytes, sum(seen.values()))
