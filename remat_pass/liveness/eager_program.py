"""The peak of the user's eager step (``graph/eager_trace``): every storage from the op
that allocates it to the op before which it was found dead, sized by the memory model
(allocator bytes, the real size of an op's outputs, the op's scratch), one sweep.

An op's step holds what is live before it, its new outputs and its scratch (the
calibration's rule: ``memory/calibration``), as the liveness of a rewritten step does
(``liveness/timeline``), plus the wrapped numbers eager Python makes for it
(``eager_trace.wrapped_numbers``). What this leaves out is said in ``EagerPeak.notes``.

For a CUDA memory model (``MemoryModel.allocator == "cuda"``) only the GPU's memory is
counted, each storage in the caching allocator's blocks: the wrapped numbers (0-dim CPU
tensors: ``scalar_to_tensor`` makes them on the CPU) and the RNG states
``torch.utils.checkpoint`` stashes (``torch.get_rng_state`` and
``torch.cuda.get_rng_state`` return CPU tensors) live in the host's memory.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch._ops import OpOverload

from ..graph.eager_trace import WRAPPED_NUMBER_BYTES, EagerTrace
from ..memory.memory_model import MemoryModel


@dataclasses.dataclass(frozen=True)
class EagerPeak:
    """The predicted peak of one eager step, above what existed before it.

    Attributes:
        peak_bytes: the peak (bytes): storages live at the peak op plus its scratch.
        peak_op: the op at the peak (``"aten.mm.default"``) and its node name.
        peak_index: its index in run order.
        scratch_bytes: the scratch counted at the peak op.
        live_at_peak: ``(node, bytes)`` of the storages live there, largest first.
        held_after_bytes: what is still alive after backward (the ``.grad`` of each
            parameter; activations the step keeps).
        ops: how many ops ran.
        notes: what the figure leaves out (empty: nothing).
        live_at_peak_ops: the bytes live at the peak by the op that allocated them
            (``op_name``: ``"mm"``, ``"native_dropout"``), the peak op's scratch as
            ``"(scratch)"``; they sum to ``peak_bytes``.
        live_at_peak_causes: the bytes live at the peak by ``peak_cause`` (each of
            ``PEAK_CAUSES``); they sum to ``peak_bytes``. Empty when the trace has no
            reads.
    """

    peak_bytes: int
    peak_op: str
    peak_index: int
    scratch_bytes: int
    live_at_peak: tuple[tuple[str, int], ...]
    held_after_bytes: int
    ops: int
    notes: tuple[str, ...]
    live_at_peak_ops: tuple[tuple[str, int], ...] = ()
    live_at_peak_causes: tuple[tuple[str, int], ...] = ()


PEAK_CAUSES = ("in-place reuse", "copies", "held outputs", "dropout masks", "the rest")
"""What a storage live at a program's peak is there for, as ``peak_cause`` tells them
apart: the causes by which an eager program's peak and the rewrite's differ (issue 19)."""

COPY_OPS = frozenset({"clone", "copy", "_to_copy", "lift_fresh_copy"})
"""Ops whose output repeats their input's values (``op_name``); a ``_to_copy`` that
changes the dtype is a cast, not a copy (``is_copy``)."""


def is_copy(node: fx.Node) -> bool:
    """Whether ``node`` (an op of a traced or recorded graph) makes a second copy of its
    first input: an op of ``COPY_OPS`` whose output has the input's dtype and shape."""
    if op_name(node.target) not in COPY_OPS or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.dtype == out.dtype and src.shape == out.shape)


def is_dropout_mask(node: fx.Node, output: int) -> bool:
    """Whether output ``output`` of ``node`` is dropout's saved mask as a traced step
    holds it: ``native_dropout``'s second output (bool), also replayed under
    ``run_with_rng_state``; ``node`` may be the ``getitem`` that takes it."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node, output = node.args[0], node.args[1]
    op = node.args[1] if node.target is torch.ops.higher_order.run_with_rng_state and len(node.args) > 1 \
        else node.target
    return op_name(op) == "native_dropout" and output == 1


def peak_cause(made_at_peak: bool, last_read_at_peak: bool, read_later: bool, dies_in_step: bool,
               a_peak_output_fits: bool, copy: bool, mask: bool = False) -> str:
    """Why a storage is live at a program's peak op, the first that holds of:

    - ``"held outputs"``: made before the peak op, read neither by it nor after it, and
      freed later in the step: a reference keeps it past its last read (eager Python's
      variables, ``CheckpointFunction``'s output while the group's backward runs; a
      rewritten step frees every storage after its last read);
    - ``"dropout masks"`` (``mask``): what dropout keeps to scale the gradient: the bool
      mask of ``native_dropout`` (a traced step; eager on CUDA, ATen's fused kernel), or
      the noise tensor ``bernoulli_`` fills (eager on the CPU, ATen's ``_dropout_impl``:
      the input's dtype), the one cause whose bytes differ by device;
    - ``"in-place reuse"``: made before the peak op, read by it for the last time, and an
      output the peak op allocates has its size: an in-place op would write into it
      (``torch.fx.passes.reinplace``'s rule, aliasing aside);
    - ``"copies"``: made by a copy of a value (``is_copy``);
    - ``"the rest"``: saved activations, recomputed values, gradients, the peak op's
      outputs and what it reads later again.

    ``read_later``: some op after the peak op reads it; ``dies_in_step``: it is freed
    before the step ends (not a ``.grad``, the loss)."""
    if not made_at_peak and not last_read_at_peak and not read_later and dies_in_step:
        return "held outputs"
    if mask:
        return "dropout masks"
    if not made_at_peak and last_read_at_peak and a_peak_output_fits:
        return "in-place reuse"
    return "copies" if copy else "the rest"


def op_name(target: object) -> str:
    """An op's name without its overload, as fx names the nodes of a traced graph:
    ``aten.mm.default`` -> ``"mm"``; a Python function by its ``__name__``."""
    if isinstance(target, OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def eager_peak(trace: EagerTrace, memory: MemoryModel) -> EagerPeak:
    """The EagerPeak of ``trace`` on ``memory``'s device.

    Raises:
        ValueError: an empty trace (no op ran).
    """
    n = len(trace.op_nodes)
    if not n:
        raise ValueError("the eager step ran no op")
    node_mem = [memory.node_memory(node) for node in trace.op_nodes]
    host = memory.allocator == "cuda"  # the GPU's memory: what lives in the host's is not counted
    sizes = []
    for s in trace.storages:
        nm = node_mem[s.allocated_at]
        real = nm.output_storage_bytes if nm is not None else None
        nbytes = real[s.output] if real is not None and 0 <= s.output < len(real) and real[s.output] else s.nbytes
        in_host = s.output < 0 or not isinstance(trace.op_nodes[s.allocated_at].target, OpOverload)
        sizes.append(0 if host and in_host else memory.allocator_bytes(nbytes))
    allocated: list[list[int]] = [[] for _ in range(n)]
    freed: list[list[int]] = [[] for _ in range(n + 1)]
    for sid, s in enumerate(trace.storages):
        allocated[s.allocated_at].append(sid)
        if s.freed_before is not None:
            freed[s.freed_before].append(sid)
    live, best, at, scratch_at = 0, -1, 0, 0
    alive: set[int] = set()
    uncounted = 0
    for i in range(n):
        for sid in freed[i]:
            live -= sizes[sid]
            alive.discard(sid)
        for sid in allocated[i]:
            live += sizes[sid]
            alive.add(sid)
        nm = node_mem[i]
        scratch = (nm.scratch_bytes if nm is not None else 0) + \
            (0 if host else trace.op_nodes[i].meta.get(WRAPPED_NUMBER_BYTES, 0))
        uncounted += nm is not None and nm.source == "none" and isinstance(trace.op_nodes[i].target, OpOverload)
        if live + scratch > best:
            best, at, scratch_at = live + scratch, i, scratch
            at_peak = set(alive)
    held = sum(sizes[sid] for sid, s in enumerate(trace.storages) if s.freed_before is None)
    node = trace.op_nodes[at]
    top = sorted(((trace.storages[sid].node, sizes[sid]) for sid in at_peak), key=lambda x: -x[1])
    notes = trace.notes
    if uncounted:
        notes += (f"{uncounted} ops have no scratch figure (not calibrated, not in the table): 0 bytes assumed",)
    by_op: dict[str, int] = {}
    for sid in at_peak:
        name = op_name(trace.op_nodes[trace.storages[sid].allocated_at].target)
        by_op[name] = by_op.get(name, 0) + sizes[sid]
    if scratch_at:
        by_op["(scratch)"] = scratch_at
    return EagerPeak(best, f"{node.target} ({node.name})", at, scratch_at, tuple(top), held, n, notes,
                     tuple(sorted(by_op.items(), key=lambda x: -x[1])),
                     _causes_at(trace, sizes, at_peak, at, scratch_at))


def _causes_at(trace: EagerTrace, sizes: list[int], at_peak: set[int], at: int,
               scratch: int) -> tuple[tuple[str, int], ...]:
    """The bytes live at op ``at`` by ``peak_cause``, its scratch under the rest."""
    if not trace.reads:
        return ()
    last_read = [-1] * len(trace.storages)
    for i, read in enumerate(trace.reads):
        for sid in read:
            last_read[sid] = i
    made = [sid for sid in at_peak if trace.storages[sid].allocated_at == at]
    noise = {sid for i, read in enumerate(trace.reads) if op_name(trace.op_nodes[i].target) in ("bernoulli_", "bernoulli")
             for sid in read[:1]}  # the tensor bernoulli_ fills in place
    out = dict.fromkeys(PEAK_CAUSES, 0)
    out["the rest"] += scratch
    for sid in at_peak:
        s = trace.storages[sid]
        fits = any(sizes[m] == sizes[sid] for m in made)
        maker = trace.op_nodes[s.allocated_at]
        # a storage made without a dispatched op (torch.get_rng_state's state, which
        # checkpoint stashes) is read by torch.set_rng_state, which dispatches none either
        read_later = last_read[sid] > at or not isinstance(maker.target, OpOverload)
        cause = peak_cause(s.allocated_at == at, last_read[sid] == at, read_later, s.freed_before is not None,
                           fits, is_copy(maker), sid in noise or is_dropout_mask(maker, s.output))
        out[cause] += sizes[sid]
    return tuple(out.items())
