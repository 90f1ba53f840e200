"""Per-step storage figures of one rewritten step: its activation storages and the steps
they are live at, live bytes split by layer, what each step allocates, frees and holds
as op scratch, and what each saved value costs.

All of them are ``timeline.analyze``'s model, step for step: the intervals, sizes and
scratch come from ``intervals.memory_intervals`` and the sums from ``timeline.
live_timeline`` (``tests/report/test_inspection.py`` checks that they give
``MemoryReport.timeline`` exactly). A step is a call_function node of the forward graph,
then of the backward graph; a storage is live from the step that allocates it to the
last use of any alias, inclusive, and is freed right after its last step.
``report.inspection`` prints these figures (``remat-pass inspect``), ``report.plot``
draws the split by layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..formatting import natural_key
from ..memory.memory_model import MemoryModel
from ..recompute.rewrite import RewrittenStep
from .intervals import Intervals, Storage, memory_intervals
from .timeline import MemoryReport, live_timeline


def report_memory(report: MemoryReport) -> MemoryModel | str:
    """The memory model ``analyze`` gave ``report`` (its allocator's name when it used
    the table-only model), for ``sized_intervals``."""
    return report.memory if report.memory is not None else report.allocator


def sized_intervals(step: RewrittenStep, memory: MemoryModel | str) -> Intervals:
    """``intervals.memory_intervals``: sized and with scratch exactly as ``analyze`` does
    with the memory model ``memory`` (an allocator name: ``MemoryModel.table_only``).

    Raises:
        ValueError: unknown allocator, or a symbolic (non-integer) storage size.
    """
    if isinstance(memory, str):
        memory = MemoryModel.table_only(memory)
    return memory_intervals(step, memory)[0]


def storage_intervals(step: RewrittenStep, allocator: MemoryModel | str = "cpu") -> list[Storage]:
    """Every activation storage of ``step`` with its live steps (``liveness.analyze``'s model).

    Args:
        step: the rewritten step.
        allocator: "cpu" (exact bytes) or "cuda" (blocks rounded up to 512 bytes) with
            the formula table's scratch, or the MemoryModel ``analyze`` was given.

    Returns:
        ``intervals.Storage`` values in allocation order, then one of kind ``"scratch"``
        per step with modelled scratch memory (live during that step only); static
        storages (primals, tangents) and empty ones are left out. Summing ``nbytes``
        over those that hold step ``i`` gives ``analyze(step, allocator).timeline[i]``.

    Raises:
        ValueError: unknown allocator, or a symbolic (non-integer) storage size.
    """
    return [s for s in sized_intervals(step, allocator).storages if not s.static and s.nbytes]


def live_bytes_by_layer(
    step: RewrittenStep, allocator: MemoryModel | str = "cpu"
) -> tuple[list[str], list[list[int]]]:
    """Live activation bytes at every step, split by the layer that allocated them
    (``allocator``: as for ``storage_intervals``).

    Returns:
        ``(labels, rows)``: labels ``["outer", "layer 0", ..]`` (only those that hold
        bytes), and ``rows[j][i]`` = bytes of label j live at step i (``liveness.
        live_timeline`` of that layer's storages). The column sums equal
        ``MemoryReport.timeline[i].live_bytes``.

    Raises:
        ValueError: as ``storage_intervals``.
    """
    iv = sized_intervals(step, allocator)
    layers = sorted({s.layer for s in iv.storages if not s.static and s.nbytes},
                    key=lambda x: (x is not None, x if x is not None else -1))
    rows = [live_timeline(iv, select=lambda s, layer=layer: s.layer == layer) for layer in layers]
    labels = ["outer" if layer is None else f"layer {layer}" for layer in layers]
    return labels, rows


@dataclasses.dataclass(frozen=True)
class StepStorage:
    """What one step allocates, holds as scratch and frees (bytes).

    Attributes:
        alloc_bytes: the activation storages whose first step this is (0 for views and
            tuple elements, which allocate nothing).
        scratch_bytes: modelled op scratch, live during this step only.
        freed: the storages whose last step this is (dropped right after it), largest
            first, then by name in natural order.
    """

    alloc_bytes: int
    scratch_bytes: int
    freed: tuple[Storage, ...]

    @property
    def freed_bytes(self) -> int:
        """Bytes of ``freed``."""
        return sum(s.nbytes for s in self.freed)


def step_storages(iv: Intervals) -> list[StepStorage]:
    """The StepStorage of every step of ``iv`` (``sized_intervals``), forward then backward."""
    alloc_at: dict[int, int] = {}
    freed_at: dict[int, list[Storage]] = {}
    scratch = [0] * iv.num_steps
    for st in iv.storages:
        if st.kind == "scratch":
            scratch[st.first] += st.nbytes
        elif not st.static and st.nbytes:
            alloc_at[st.first] = alloc_at.get(st.first, 0) + st.nbytes
            freed_at.setdefault(st.last, []).append(st)
    return [StepStorage(alloc_at.get(i, 0), scratch[i],
                        tuple(sorted(freed_at.get(i, ()), key=lambda st: (-st.nbytes, natural_key(st.name)))))
            for i in range(iv.num_steps)]


@dataclasses.dataclass(frozen=True)
class SavedStorage:
    """The storage of one saved value (a forward output that backward reads).

    Attributes:
        name: the saved value.
        nbytes: its storage's bytes; 0 when static or when an earlier saved value has
            the same storage (an alias is counted once), or not a tensor.
        alias_of: that earlier saved value (None: none).
        static: the storage exists before the step (a primal).
    """

    name: str
    nbytes: Any
    alias_of: str | None
    static: bool


def saved_storages(step: RewrittenStep, iv: Intervals) -> list[SavedStorage]:
    """The SavedStorage of every saved value of ``step``, in the order forward returns
    them (``iv``: ``sized_intervals`` of the step)."""
    out = []
    seen_storage: dict[int, str] = {}
    for name, sid in zip(step.saved, iv.saved_sids):
        st = iv.storages[sid] if isinstance(sid, int) else None
        nbytes = st.nbytes if st is not None and not st.static else 0
        alias = seen_storage.get(sid) if isinstance(sid, int) else None
        if isinstance(sid, int) and alias is None:
            seen_storage[sid] = name
        out.append(SavedStorage(name, 0 if alias is not None else nbytes, alias, st is not None and st.static))
    return out
