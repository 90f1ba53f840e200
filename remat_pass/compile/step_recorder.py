"""Records, while a model trains, which compiled graphs run in a step, in which order,
and which graph's output each graph's input is: what ``step_flow`` needs to compose the
graphs' timelines into the step's.

``StepRecorder.wrap`` wraps the callable a backend hands back to Dynamo for one graph.
Each call records, without holding any tensor:

- the storages ``(data_ptr, nbytes)`` of its non-parameter tensor inputs and of its
  outputs, so that an input of a later graph is matched to the output of an earlier
  graph with the same storage (the latest one made before the call, in the step);
- whether each leaf input's ``.grad`` is None (its gradient will be stolen into
  ``.grad`` and kept) or not (added in place);
- the shapes of its non-parameter inputs (the sizes of a graph compiled with dynamic
  shapes);
- an input made by an eager autograd op (its ``grad_fn`` is not a compiled graph's):
  eager code runs between graphs, which the composition does not see;
- a weak reference to each output's storage (``StorageWeakRef``, as PyTorch's
  ``torch.distributed._tools.mem_tracker`` tracks storages: it keeps no bytes alive).
  When the backward pass ends, every saved tensor has been released, so an output whose
  storage is still alive is held by the caller (``out = model(...);
  out.loss.backward()`` keeps ``out.logits``): ``RecordedStep.held``.

The backward order is observed with a pre-hook on the ``CompiledFunctionBackward`` node
of each call's outputs (``Node.register_prehook``), found behind the views AOTAutograd
regenerates for outputs that alias an intermediate (``_compiled_node``). No post-hook: with one, autograd's
engine keeps a node's incoming gradients alive until the hooks run after it
(``torch/csrc/autograd/engine.cpp``, ``call_function``), which would change the very
memory being predicted. The end of a backward pass is observed with
``Variable._execution_engine.queue_callback`` (run when the pass's graph task ends, as
DistributedDataParallel does). A step starts with the first call after a backward has
run, and ends with the backward pass in which every call's backward has run (or when
the next step starts): then ``on_step_end(RecordedStep)`` is called. Raising from it
raises out of ``loss.backward()`` (or out of the next step's first call).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .eager_recorder import EagerRecording, EagerStepMode, install_backward_hook, pop, push

COMPILED_BACKWARD = "CompiledFunctionBackward"  # AOTAutograd's autograd.Function node
EAGER_TRIES = 4  # steps recorded for other signatures before one that waits is given up


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """One graph call of a step.

    Attributes:
        graph_id: the compiled graph.
        inputs_from: per input, ``(call, output)`` of the earlier call whose output it
            is (matched by storage), or None.
        grad_kept: per input, True: a leaf whose ``.grad`` was None (its gradient is
            kept); False: a leaf with a ``.grad`` (its gradient is added); None:
            not a leaf that requires grad.
        param_keys: per input, the parameter's ``data_ptr`` (None: not a parameter).
        shapes: per input, its shape (tensors that are not parameters), its value
            (ints) or None.
        has_backward: an output has a compiled backward node.
        first_output_shape: the shape of its output 0 (None: not a tensor); a last call
            whose output 0 is not a one-element loss leaves the loss to eager code.
    """

    graph_id: str
    inputs_from: tuple[tuple[int, int] | None, ...]
    grad_kept: tuple[bool | None, ...]
    param_keys: tuple[int | None, ...]
    shapes: tuple[Any, ...]
    has_backward: bool
    first_output_shape: tuple[int, ...] | None = ()


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """One training step as it ran.

    Attributes:
        index: the step's number (0: the first recorded step).
        calls: the graph calls in forward order.
        backward_order: indices of the calls whose backward ran, in the order they ran.
        problems: why the step cannot be composed (a backward out of autograd's order,
            a backward run twice, a forward after backward started); empty if none.
        eager_inputs: inputs made by eager autograd ops (``"graph 1/0 input 3 from
            EmbeddingBackward0"``): eager code runs between the graphs.
        held: ``(call, output)`` of every output whose storage was still alive when
            the step's backward pass ended (the caller holds it); empty when no
            backward ended the step.
        eager: the eager ops the step ran around its graphs (``eager_recorder``), when
            they were recorded (not part of the signature).
    """

    index: int
    calls: tuple[RecordedCall, ...]
    backward_order: tuple[int, ...]
    problems: tuple[str, ...]
    eager_inputs: tuple[str, ...]
    held: tuple[tuple[int, int], ...] = ()
    eager: EagerRecording | None = None

    def signature(self) -> tuple:
        """What decides the composed step (calls, flow, shapes, backward order); equal
        signatures compose to the same step."""
        kept = self.grad_kept_in_order()
        return (tuple((c.graph_id, c.inputs_from, k, c.shapes) for c, k in zip(self.calls, kept)),
                self.backward_order, self.held)

    def grad_kept_in_order(self) -> list[tuple[bool | None, ...]]:
        """``grad_kept`` of every call, with a parameter read by several graphs kept
        only by the first backward that runs (the later ones add into its ``.grad``)."""
        kept = [list(c.grad_kept) for c in self.calls]
        seen: set[int] = set()
        for c in self.backward_order:
            for i, key in enumerate(self.calls[c].param_keys):
                if key is None or kept[c][i] is None:
                    continue
                if key in seen:
                    kept[c][i] = False
                seen.add(key)
        return [tuple(k) for k in kept]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


VIEW_CHAIN_DEPTH = 8


def _compiled_node(node: Any) -> Any:
    """The ``CompiledFunctionBackward`` node behind an output's ``grad_fn``: the node
    itself, or the one reached through a chain of single-input nodes (at most
    ``VIEW_CHAIN_DEPTH``): AOTAutograd hands back an output that is a view of a graph
    intermediate as a view regenerated from its base output (``AliasBackward0`` after
    ``ViewBackward0`` when a graph break follows ``hidden.view(...)``). None: none."""
    for _ in range(VIEW_CHAIN_DEPTH + 1):
        if node is None or type(node).__name__ == COMPILED_BACKWARD:
            return node
        following = [n for n, _ in node.next_functions if n is not None]
        if len(following) != 1:
            return None
        node = following[0]
    return None


def _flat_outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


class _OpenStep:
    def __init__(self, index: int):
        self.index = index
        self.calls: list[RecordedCall] = []
        self.producers: dict[tuple[int, int], tuple[int, int]] = {}
        self.pending: set[int] = set()
        self.backward: list[int] = []
        self.problems: list[str] = []
        self.eager: list[str] = []
        self.outputs: dict[tuple[int, int], StorageWeakRef] = {}
        self.held: tuple[tuple[int, int], ...] = ()
        self.eager_mode: EagerStepMode | None = None  # the mode recording this step's eager ops
        self.callback_queued = False
        # autograd's sequence number of the newest compiled backward node of the calls
        # so far: a node found behind a view that is not newer is an earlier call's
        self.last_sequence_nr = -1
        self.next_sequence_nr = -1

    def note_held(self) -> None:
        """Record which outputs are still alive (called when a backward pass ends)."""
        self.held = tuple(key for key, ref in self.outputs.items() if not ref.expired())

    def close(self) -> RecordedStep:
        recording = None
        if self.eager_mode is not None:
            self.eager_mode.boundary("pass_end")
            recording = self.eager_mode.recording()
            self.eager_mode.armed = False
        return RecordedStep(self.index, tuple(self.calls), tuple(self.backward),
                            tuple(self.problems), tuple(self.eager), self.held, recording)


class StepRecorder:
    """Records the steps of the graphs it wraps (see the module docstring).

    Args:
        on_step_end: called with each finished RecordedStep.
        on_problem: called with a message when a step that already ended turns out not
            to be composable (a backward through its graphs runs again); may raise.
        record_eager: also record the eager ops around the graphs
            (``eager_recorder``) once per signature: the mode is pushed when a step's
            backward returns while a signature seen has not been recorded, and records
            the next step (a step of another signature, e.g. the other microbatch of
            gradient accumulation, is recorded too; a signature still unrecorded after
            ``EAGER_TRIES`` such steps is given up).
    """

    def __init__(self, on_step_end: Callable[[RecordedStep], None],
                 on_problem: Callable[[str], None] | None = None, record_eager: bool = False):
        self.on_step_end = on_step_end
        self.on_problem = on_problem
        self._open: _OpenStep | None = None
        self._count = 0
        self._mode: EagerStepMode | None = None  # pushed, recording (armed) or waiting for a step
        self._mode_done = False
        self._eager_signatures: set[tuple] = set()
        self._unrecorded: dict[tuple, int] = {}  # signatures seen, not recorded: steps recorded since
        self._want_eager = False
        if record_eager:
            install_backward_hook(self)

    # -- torch.autograd.backward, in the caller's context (eager_recorder.install_backward_hook)
    def backward_begins(self, roots: Sequence[Any]) -> None:
        """``torch.autograd.backward`` is called on ``roots``."""
        if self._mode is not None and self._mode.armed:
            self._mode.backward_begins(roots)

    def backward_returned(self) -> None:
        """A backward returned: a mode whose step ended is popped; one is pushed when
        the step that just ended had a signature not recorded with its eager ops."""
        if torch._C._current_autograd_node() is not None:
            return  # a backward inside a backward (a reentrant checkpoint): its engine restores the state
        if self._mode is not None and self._mode.owner() is not self:
            self._mode, self._mode_done = None, False  # another backend took it over
        if self._mode is not None and not self._mode.armed:
            # its step ended, or it recorded none (a profiler was on; a backward of other graphs)
            recorded = self._mode_done
            pop(self._mode)
            self._mode, self._mode_done = None, False
            self._want_eager = self._want_eager or not recorded
        if self._mode is None and self._want_eager:
            self._mode = push(self)
            self._want_eager = self._mode is None

    def wrap(self, graph_id: str, compiled: Callable[..., Any], param_indices: Sequence[int]) -> "RecordedGraph":
        """The callable to hand to Dynamo instead of ``compiled``."""
        return RecordedGraph(self, graph_id, compiled, frozenset(param_indices))

    def finish(self) -> None:
        """End the open step now (e.g. before reading the log)."""
        if self._open is not None and self._open.calls:
            step, self._open = self._open.close(), None
            sig = step.signature()
            if step.eager is not None:
                self._mode_done = True
                if sig in self._eager_signatures:  # recorded again: the signatures waiting missed a step
                    self._unrecorded = {k: n + 1 for k, n in self._unrecorded.items()}
                self._eager_signatures.add(sig)
                self._unrecorded.pop(sig, None)
            elif sig not in self._eager_signatures:
                self._unrecorded.setdefault(sig, 0)
            # record the next step while a signature seen waits (each for EAGER_TRIES recorded steps)
            self._want_eager = any(n < EAGER_TRIES for n in self._unrecorded.values())
            self.on_step_end(step)

    def _call(self, graph: "RecordedGraph", args: tuple) -> Any:
        if self._open is not None and self._open.backward:
            self.finish()
        if self._open is None:
            self._open = _OpenStep(self._count)
            self._count += 1
            mode = self._mode
            if (mode is not None and mode.owner() is self and not self._mode_done and not mode.armed
                    and mode in _get_current_dispatch_mode_stack() and not torch._C._autograd._profiler_enabled()):
                mode.armed = True
                self._open.eager_mode = mode
        step = self._open
        index = len(step.calls)
        inputs_from, kept, params, shapes = [], [], [], []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                inputs_from.append(None)
                kept.append(None)
                params.append(None)
                shapes.append(a if isinstance(a, int) else None)
                continue
            leaf = a.requires_grad and a.grad_fn is None
            kept.append((a.grad is None) if leaf else None)
            if i in graph.param_indices:
                inputs_from.append(None)
                params.append(a.data_ptr())
                shapes.append(None)
                continue
            src = step.producers.get(_storage_key(a))
            inputs_from.append(src)
            params.append(a.data_ptr() if leaf else None)
            shapes.append(tuple(a.shape))
            recorded = step.eager_mode is not None and step.eager_mode.made(a)
            if src is None and a.grad_fn is not None and type(a.grad_fn).__name__ != COMPILED_BACKWARD and not recorded:
                step.eager.append(f"graph {graph.graph_id} input {i} from {type(a.grad_fn).__name__}")
        if step.eager_mode is not None:
            out = step.eager_mode.graph_call(index, args, lambda: graph.compiled(*args))
        else:
            out = graph.compiled(*args)
        has_backward = False
        for k, o in enumerate(_flat_outputs(out)):
            if isinstance(o, torch.Tensor):
                step.producers[_storage_key(o)] = (index, k)
                step.outputs[(index, k)] = StorageWeakRef(o.untyped_storage())
                node = None if has_backward else _compiled_node(o.grad_fn)
                if node is not None and node._sequence_nr() > step.last_sequence_nr:
                    has_backward = True
                    step.next_sequence_nr = max(step.next_sequence_nr, node._sequence_nr())
                    node.register_prehook(lambda grads, c=index, s=step: self._backward_starts(s, c, grads))
        step.last_sequence_nr = step.next_sequence_nr
        if has_backward:
            step.pending.add(index)
        first = _flat_outputs(out)[0] if _flat_outputs(out) else None
        step.calls.append(RecordedCall(graph.graph_id, tuple(inputs_from), tuple(kept), tuple(params),
                                       tuple(shapes), has_backward,
                                       tuple(first.shape) if isinstance(first, torch.Tensor) else None))
        return out

    def _backward_starts(self, step: _OpenStep, c: int, grads: Sequence[Any] = ()) -> None:
        if step is not self._open:
            # a step already ended (composed, reported): its graph runs backward again
            # (retain_graph and a second backward): the step was not what was composed
            if c in step.backward and self.on_problem is not None:
                self.on_problem(f"the backward of {step.calls[c].graph_id} (call {c}) ran twice in one step "
                                "(a second backward through a retained graph)")
            return
        if c in step.backward:
            step.problems.append(f"the backward of {step.calls[c].graph_id} (call {c}) ran twice in one step")
        elif step.backward and c > step.backward[-1]:
            step.problems.append(
                f"the backward of {step.calls[c].graph_id} (call {c}) ran after that of call "
                f"{step.backward[-1]}, an earlier graph: not autograd's order for one loss.backward()")
        step.backward.append(c)
        step.pending.discard(c)
        if step.eager_mode is not None:
            step.eager_mode.backward_starts(c, grads)
        if not step.callback_queued:
            step.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda s=step: self._pass_ends(s))

    def _pass_ends(self, step: _OpenStep) -> None:
        """A backward pass ended: the step ends with it when no call's backward is pending."""
        step.callback_queued = False
        if step is self._open and not step.pending:
            step.note_held()
            self.finish()


class RecordedGraph:
    """A compiled graph's callable that records its calls into a StepRecorder.

    Attributes:
        graph_id: the graph.
        compiled: the callable run (replaceable: ``replace`` swaps in a recompiled graph).
        param_indices: inputs that are parameters or buffers.
    """

    def __init__(self, recorder: StepRecorder, graph_id: str, compiled: Callable[..., Any],
                 param_indices: frozenset[int]):
        self.recorder, self.graph_id, self.compiled, self.param_indices = recorder, graph_id, compiled, param_indices

    def replace(self, compiled: Callable[..., Any]) -> None:
        """Run ``compiled`` from the next call on (a re-planned or un-rewritten graph)."""
        self.compiled = compiled

    def __call__(self, *args: Any) -> Any:
        return self.recorder._call(self, args)
