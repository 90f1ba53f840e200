"""Records the eager ops a training step runs around its compiled graphs (an eager loss
after the compiled model, casts, Dynamo's glue between graphs, the eager backward of
those ops, the loss tangent), so that the step's composition counts what the user's own
code allocates (``liveness.step_flow.EagerOps``).

A ``TorchDispatchMode`` (``EagerStepMode``, an ``eager_trace.OpRecorder``) sees every aten
op, as PyTorch's ``torch.distributed._tools.mem_tracker`` does: each storage an op makes,
and, by weak references to storages (``StorageWeakRef``: no bytes kept alive), when it
dies. It records nothing while a compiled graph runs (the forward: a flag the step
recorder sets around the call; the backward: autograd's current node is a
``CompiledFunctionBackward``, or an ``AccumulateGrad`` whose gradients ``step_flow``
counts). Besides the ops it records *boundaries*: a graph's forward starts and ends,
``torch.autograd.backward`` begins, a graph's backward starts (with the gradients it
receives), the backward pass ends. A storage found dead at a boundary died in what ran
just before it: an eager op, or a graph (then at that graph's last read of it when it
is one of its inputs or tangents).

Where the mode is pushed. Dynamo restores the thread's dispatch keys when a compiled
frame returns (``torch/_dynamo/eval_frame.py``, ``_ForceDispatchKeyGuard``), and the
autograd engine restores the thread's state when ``backward`` returns, so a mode pushed
inside either would be lost or undone. It is pushed in the user's own code instead:
``torch.autograd.backward`` is wrapped (once per process, ``install_backward_hook``);
when a step's backward returns, a recorder that wants the next step recorded pushes its
mode, and it records from that step's first graph call to the end of its backward, then
is popped when that backward returns. The mode declares ``ignore_compile_internals``,
so Dynamo compiles and runs graphs under it as without it (no recompile). So the first
step of a signature is composed without its eager ops, and a later step records them
(``StepRecorder``). At most one such mode is pushed in a process (a backend whose next
step never comes leaves one behind, passing every op through; the next backend takes
it over; ``release_modes`` pops it). No step is recorded while a profiler runs:
recording under ``torch.profiler`` crashed kineto's trace processing
(``GenericActivityProfiler::processTraceInternal``, a segmentation fault at
``prof.stop()``) in this project's test suite.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..graph.eager_trace import WRAPPED_NUMBER_BYTES, EagerStorage, OpRecorder
from ..liveness.step_flow import EagerOps, EagerSegment, EagerTensor
from ..memory.memory_model import MemoryModel

COMPILED_NODES = ("CompiledFunctionBackward", "AccumulateGrad")  # backward nodes whose ops step_flow counts


def _in_compiled_backward() -> bool:
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ in COMPILED_NODES


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclasses.dataclass(frozen=True)
class EagerRecording:
    """The eager ops of one step as recorded (``EagerStepMode.recording``).

    Attributes:
        ops: the fx node of each op, in run order (their ``meta["val"]`` stand-ins).
        storages: every storage an eager op made; ``freed_before`` is the index of the
            event that found it dead (None: alive at the end).
        events: ``("op", j)``, ``("fw_start", c)``, ``("fw_end", c)``, ``("backward",)``,
            ``("bw_start", c)``, ``("pass_end",)`` in the order they happened.
        op_event: the event index of each op.
        input_of: storage id -> ``(call, input)`` it was passed to (the first).
        gradient_of: storage id -> ``(call, position)``: the gradient a graph's backward
            received at that position (its output's index).
        output_dead: ``((call, output), event)``: the event that found a graph output
            dead (``None``: alive at the end).
        loss_eager: the root ``backward`` ran from was made by an eager op.
        copied: ``(call, position)`` of gradients an eager op made that were not
            contiguous (an expanded ``ones``: the backward of ``sum``); AOTAutograd
            copies them before the graph's backward runs.
    """

    ops: tuple[torch.fx.Node, ...]
    storages: tuple[EagerStorage, ...]
    events: tuple[tuple, ...]
    op_event: tuple[int, ...]
    input_of: dict[int, tuple[int, int]]
    gradient_of: dict[int, tuple[int, int]]
    output_dead: tuple[tuple[tuple[int, int], int | None], ...]
    loss_eager: bool
    copied: frozenset[tuple[int, int]] = frozenset()


class EagerStepMode(OpRecorder):
    """The dispatch mode that records a step's eager ops (see the module docstring).
    It passes every op through untouched until ``start`` and after ``stop``."""

    supports_higher_order_operators = True  # a compiled graph's HOPs (run_and_save_rng_state) pass through

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles and runs graphs under this mode as without it."""
        return True

    def __init__(self) -> None:
        super().__init__(FakeTensorMode(allow_non_fake_inputs=True))
        self.armed = False
        self.masked = False
        self.events: list[tuple] = []
        self.op_event: list[int] = []
        self.watched: dict[tuple[int, int], StorageWeakRef] = {}
        self.output_dead: dict[tuple[int, int], int | None] = {}
        self.input_of: dict[int, tuple[int, int]] = {}
        self.gradient_of: dict[int, tuple[int, int]] = {}
        self.copied: set[tuple[int, int]] = set()
        self.loss_eager = False
        self.owner: Callable[[], Any] = lambda: None  # weak reference to the recorder it waits for

    def clock(self) -> int:
        """A storage found dead now died before the next event."""
        return len(self.events)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.armed or self.masked or self.busy or _in_compiled_backward() or isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        before = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.ops) > before:
            self.events.append(("op", before))
            self.op_event.append(len(self.events) - 1)
        return out

    def poll(self) -> None:
        """Storages (and watched graph outputs) found dead now."""
        super().poll()
        for key in [k for k, ref in self.watched.items() if ref.expired()]:
            del self.watched[key]
            self.output_dead[key] = self.clock()

    def boundary(self, *event: Any) -> None:
        """A point of the step that is not an eager op (see ``EagerRecording.events``)."""
        if self.armed:
            self.poll()
            self.events.append(tuple(event))

    def made(self, t: torch.Tensor) -> bool:
        """Whether a recorded eager op of this step made ``t``'s storage."""
        return self.armed and self._sid(t) is not None

    def _sid(self, t: torch.Tensor) -> int | None:
        entry = self.alive.get(_storage_key(t))
        return entry[1] if entry is not None else None

    def graph_call(self, c: int, args: Sequence[Any], call: Callable[[], Any]) -> Any:
        """Run graph call ``c`` (``call()``) unrecorded, between its two boundaries; its
        inputs made by eager ops and its outputs are noted."""
        self.boundary("fw_start", c)
        if self.armed:
            for i, a in enumerate(args):
                sid = self._sid(a) if isinstance(a, torch.Tensor) else None
                if sid is not None:
                    self.input_of.setdefault(sid, (c, i))
        self.masked = True
        try:
            out = call()
        finally:
            self.masked = False
        self.boundary("fw_end", c)
        if self.armed:
            for k, o in enumerate(out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    self.watched[(c, k)] = StorageWeakRef(o.untyped_storage())
                    self.output_dead[(c, k)] = None
        return out

    def backward_starts(self, c: int, grads: Sequence[Any]) -> None:
        """Graph call ``c``'s backward is about to run with ``grads``."""
        self.boundary("bw_start", c)
        if self.armed:
            for i, g in enumerate(grads):
                sid = self._sid(g) if isinstance(g, torch.Tensor) else None
                if sid is None:
                    continue
                if g.is_contiguous():
                    self.gradient_of.setdefault(sid, (c, i))
                else:  # AOTAutograd copies it to the layout it traced (runtime_wrappers, coerce tangents)
                    self.copied.add((c, i))

    def backward_begins(self, roots: Sequence[Any]) -> None:
        """``torch.autograd.backward`` was called on ``roots``."""
        self.boundary("backward")
        if self.armed:
            self.loss_eager = any(isinstance(r, torch.Tensor) and self._sid(r) is not None for r in roots)

    def recording(self) -> EagerRecording:
        """What was recorded so far (storages alive now: ``freed_before`` None)."""
        trace = self.trace()
        return EagerRecording(trace.op_nodes, trace.storages, tuple(self.events), tuple(self.op_event),
                              dict(self.input_of), dict(self.gradient_of), tuple(self.output_dead.items()),
                              self.loss_eager, frozenset(self.copied))


def _positions(events: Sequence[tuple]) -> dict[int, tuple[tuple, int]]:
    """Event index of each op -> (its segment's position, its slot there)."""
    out: dict[int, tuple[tuple, int]] = {}
    run: list[int] = []
    before: tuple | None = None

    def close(after: tuple | None) -> None:
        if not run:
            return
        if before is not None and before[0] == "fw_end" and (after is None or after[0] in ("fw_start", "backward")):
            pos: tuple = ("forward", before[1])
        elif after is not None and after[0] == "bw_start":
            pos = ("backward", after[1])
        elif before is not None and before[0] == "fw_end":
            pos = ("forward", before[1])
        else:
            pos = ("end",)
        for slot, e in enumerate(run):
            out[e] = (pos, slot)
        run.clear()

    for e, ev in enumerate(events):
        if ev[0] == "op":
            run.append(e)
            continue
        close(ev)
        before = ev
    close(None)
    return out


def eager_ops(rec: EagerRecording, memory: MemoryModel,
              output_tangent: Sequence[Sequence[int | None]]) -> EagerOps:
    """The recorded eager ops as ``step_flow.EagerOps``: their segments, their storages
    sized by ``memory`` (allocator bytes of the real output size; each op's scratch),
    each storage's end where it was found dead, and the tangents and inputs they made.

    Args:
        rec: the recording.
        memory: the memory model of the step's device.
        output_tangent: per graph call, the tangent index of each output it returns
            (``GraphCall.output_tangent``).
    """
    pos = _positions(rec.events)
    segments: dict[tuple, tuple[list[str], list[Any]]] = {}
    node_mem = [memory.node_memory(n) for n in rec.ops]
    for j, node in enumerate(rec.ops):
        p, _ = pos[rec.op_event[j]]
        ops, scratch = segments.setdefault(p, ([], []))
        ops.append(node.name)
        nm = node_mem[j]
        scratch.append((nm.scratch_bytes if nm is not None else 0) + node.meta.get(WRAPPED_NUMBER_BYTES, 0))

    def tangent(sid: int) -> tuple[int, int] | None:
        c, i = rec.gradient_of.get(sid, (-1, -1))
        t = output_tangent[c][i] if 0 <= c < len(output_tangent) and i < len(output_tangent[c]) else None
        return (c, t) if t is not None else None

    def end_of(d: int | None, sid: int | None) -> tuple:
        if d is None:
            return ("step_end",)
        while d > 0:
            ev = rec.events[d - 1]
            if ev[0] == "op":
                p, slot = pos[d - 1]
                return ("eager", p, slot)
            if ev[0] == "fw_end":
                return ("forward_end", ev[1])
            if ev[0] in ("fw_start", "bw_start"):
                c = ev[1]
                read = rec.input_of.get(sid) if sid is not None else None
                t = tangent(sid) if sid is not None and ev[0] == "bw_start" else None
                if t is not None and t[0] == c:
                    return ("tangent", c, t[1])
                if read is not None and read[0] == c:
                    return ("input", c, read[1])
                return ("forward_end", c) if ev[0] == "fw_start" else ("backward_end", c)
            d -= 1
        return ("step_end",)

    tensors = []
    for sid, s in enumerate(rec.storages):
        nm = node_mem[s.allocated_at]
        real = nm.output_storage_bytes if nm is not None else None
        nbytes = real[s.output] if real is not None and 0 <= s.output < len(real) and real[s.output] else s.nbytes
        p, slot = pos[rec.op_event[s.allocated_at]]
        kind = "eager forward" if p[0] == "forward" else "eager backward"
        tensors.append(EagerTensor(s.node, kind, memory.allocator_bytes(nbytes), ("eager", p, slot),
                                   end_of(s.freed_before, sid)))
    output_ends = []
    for key, d in rec.output_dead:
        last_op = None if d is not None else ("step_end",)
        e = len(rec.events) if d is None else d
        while last_op is None and e > 0:  # the last eager op it was alive at
            e -= 1
            if rec.events[e][0] == "op":
                last_op = ("eager", *pos[e])
            elif rec.events[e] == ("fw_end", key[0]):
                break
        if last_op is not None:
            output_ends.append((key, last_op))
    tangents = frozenset(t for t in (tangent(sid) for sid in rec.gradient_of) if t is not None)
    copied = frozenset((c, output_tangent[c][i]) for c, i in rec.copied
                       if c < len(output_tangent) and i < len(output_tangent[c]) and output_tangent[c][i] is not None)
    return EagerOps(tuple(EagerSegment(p, tuple(o), tuple(sc)) for p, (o, sc) in segments.items()),
                    tuple(tensors), tuple(output_ends), tangents, frozenset(rec.input_of.values()), rec.loss_eager,
                    copied)


_LISTENERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_ORIGINAL_BACKWARD: Callable[..., Any] | None = None


def install_backward_hook(listener: Any) -> None:
    """Wrap ``torch.autograd.backward`` (once per process; ``Tensor.backward`` calls it)
    so that ``listener.backward_begins(roots)`` runs before each backward and
    ``listener.backward_returned()`` after it, in the caller's own context (where a
    dispatch mode pushed stays pushed). The wrapper passes every argument on as is."""
    global _ORIGINAL_BACKWARD
    _LISTENERS.add(listener)
    if _ORIGINAL_BACKWARD is not None:
        return
    original = _ORIGINAL_BACKWARD = torch.autograd.backward

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for ear in list(_LISTENERS):
            ear.backward_begins(roots)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            for ear in list(_LISTENERS):
                ear.backward_returned()

    backward.__doc__ = original.__doc__
    backward.__wrapped__ = original  # type: ignore[attr-defined]
    torch.autograd.backward = backward  # type: ignore[assignment]


def pushed_mode() -> EagerStepMode | None:
    """The EagerStepMode on the dispatch-mode stack, if any (there is at most one)."""
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, EagerStepMode)), None)


def push(owner: Any) -> EagerStepMode | None:
    """An EagerStepMode pushed for ``owner`` (in the caller's context: see the module
    docstring). One at a time in a process: a mode already pushed and waiting (its
    owner's next step never came) is taken over; one recording now is not (None); none
    is pushed inside another dispatch mode (None)."""
    mode = pushed_mode()
    if mode is not None and mode.armed:
        return None
    if mode is None and _get_current_dispatch_mode_stack():
        # the caller is inside another dispatch mode's ``with``: its exit would pop ours
        # and leave its own pushed (the next backward outside it pushes one)
        return None
    if mode is None:
        mode = EagerStepMode()
        mode.__enter__()
    mode.owner = weakref.ref(owner)
    return mode


def release_modes() -> int:
    """Pop every EagerStepMode at the top of the dispatch-mode stack (one left pushed
    by a backend whose next step never came: it passes every op through, at the cost
    of a Python call per op); how many were popped. Call it in the user's context."""
    n = 0
    while True:
        stack = _get_current_dispatch_mode_stack()
        if not stack or not isinstance(stack[-1], EagerStepMode):
            return n
        stack[-1].armed = False
        stack[-1].__exit__(None, None, None)
        n += 1


def pop(mode: EagerStepMode) -> bool:
    """Pop ``mode`` if it is the innermost dispatch mode (else leave the stack alone:
    code above it pushed its own); whether it was popped."""
    stack = _get_current_dispatch_mode_stack()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
        return True
    return False
