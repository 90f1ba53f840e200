"""The user's eager training step as it runs, op by op, without the rewrite: which
storage each op allocates and when each storage dies.

``record_eager_step`` runs the model's forward, its loss and ``loss.backward()`` as the
user's own code runs them (their in-place ops, ``torch.utils.checkpoint``, autograd's
saved tensors and the order its engine frees them), on fake tensors: the model copied into a ``FakeTensorMode``
(``FakeCopyMode``), so nothing is computed and any size can be
recorded. A ``TorchDispatchMode`` sees every aten op the step dispatches, forward and
backward (the CPU autograd engine runs on the calling thread), as PyTorch's
``torch.distributed._tools.mem_tracker`` does:

- each output storage not seen before is allocated by that op;
- a weak reference to every storage (``StorageWeakRef``, which keeps no bytes alive) is
  checked before each op: a storage found dead died after the previous op;
- a storage an op reads that no op of the step made existed before the step
  (parameters, the batch): static, not counted;
- ``torch.get_rng_state``, which allocates its CPU state tensor (5,056 bytes) without
  a dispatched op, is wrapped while the step is recorded (``torch.utils.checkpoint``
  stashes the state per checkpointed call, ``preserve_rng_state=True``);
- ``torch.distributed``'s in-place collectives run as functional collectives on the fake
  tensors (``trace_context.functional_collectives``; a collective then allocates its
  output and copies it back): their outputs are counted as the tensor eager writes in
  place, not as allocations. Small constants keep their values
  (``trace_context.constant_values_mode``: Megatron-Core's RNG-tracker check).

Each op also becomes a node of an fx graph (``EagerTrace.graph``), its ``meta["val"]``
a stand-in of its output in a separate fake mode (the same layout and storage sharing,
so holding it keeps none of the recorded storages alive): the op signatures that
calibration and the scratch table read (``graph/op_signature``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
import weakref
from typing import Any, Callable, ContextManager

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import RematError
from .fake_trace import FakeConverter
from .eager_branches import FAKE_BRANCHES, eager_library_checks, is_data_dependent, know_factory_value
from .flat_step import LossFn, bind_tensors, extract_loss, split_inputs
from .trace_context import constant_values_mode, functional_collectives


@dataclasses.dataclass(frozen=True)
class EagerStorage:
    """One storage the step allocated.

    Attributes:
        nbytes: its size (the fake storage's ``nbytes``, as the eager op allocates it).
        allocated_at: index of the op that allocated it.
        output: which tensor output of that op it is (pytree order); -1: a wrapped
            number of the op that autograd saved.
        freed_before: index of the first op run after it died; the number of ops when it
            died after the last op; None when it is still alive after the step (a
            parameter's ``.grad``, the loss, what the caller keeps).
        node: the fx node of the op output holding it.
    """

    nbytes: int
    allocated_at: int
    output: int
    freed_before: int | None
    node: str


@dataclasses.dataclass(frozen=True)
class EagerTrace:
    """An eager step recorded op by op.

    Attributes:
        graph: one fx node per op in run order (placeholders for static tensors).
        op_nodes: the node of each op, in run order (``EagerStorage.allocated_at``
            indexes it).
        storages: every storage the step allocated.
        reads: per op (run order), the index into ``storages`` of each storage of the
            step it reads (an in-place op's too; static storages left out); empty when
            not recorded.
        notes: how the recording may differ from the real step (empty: it follows it).
    """

    graph: fx.Graph
    op_nodes: tuple[fx.Node, ...]
    storages: tuple[EagerStorage, ...]
    reads: tuple[tuple[int, ...], ...] = ()
    notes: tuple[str, ...] = ()


WRAPPED_NUMBER_BYTES = "eager_wrapped_number_bytes"
"""``node.meta`` key: bytes of the wrapped numbers eager Python makes for the op."""


def wrapped_numbers(func: Any, args: tuple, kwargs: dict) -> dict[str, int]:
    """Argument name -> bytes of each 0-dim tensor PyTorch's Python argument parser
    makes for a Python number passed where the op's schema takes a Tensor (``x * 0.5``
    calls ``aten.mul.Tensor``; a wrapped number: int64 / double, complex128,
    ``torch/csrc/utils/python_arg_parser.cpp``). It is allocated before the op is
    dispatched and freed after it returns, unless autograd saves it (``mul`` saves
    ``other``: ``grad_fn._saved_other``) until the op's backward. An fx graph run node
    by node passes the number as is, and calibration does not see them."""
    out: dict[str, int] = {}
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, (bool, int, float, complex)) and "Tensor" in str(arg.type):
            out[arg.name] = 16 if isinstance(value, complex) else 8
    return out


class OpRecorder(TorchDispatchMode):
    """The dispatch mode of ``record_eager_step`` (see the module docstring): every op
    it sees becomes a node, every storage an op makes a record ``[nbytes,
    allocated_at, output, freed_before, node]``; ``freed_before`` is the ``clock()``
    of the first poll that found it dead (the index of the op about to run; a subclass
    may count other events too).

    Args:
        shadow: the fake mode the nodes' stand-in values are made in.
    """

    def __init__(self, shadow: FakeTensorMode, scalars: list[Any] | None = None, known_factories: bool = False):
        super().__init__()
        self.shadow = shadow
        self.scalars = None if scalars is None else list(reversed(scalars))  # popped in run order
        self.known_factories = known_factories  # eager_branches.know_factory_value
        self.graph = fx.Graph()
        self.node_of: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.ops: list[fx.Node] = []
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}  # StorageImpl -> (ref, storage id)
        self.static: dict[int, StorageWeakRef] = {}
        self.records: list[list[Any]] = []  # per storage id: [nbytes, allocated_at, output, freed_before, node]
        self.ordinal = 0
        self.shadow_storages: dict[tuple[str, int], torch.UntypedStorage] = {}
        self.busy = False
        self.pending: tuple | None = None  # an op with wrapped numbers whose grad_fn is not set yet
        # autograd's engine between a node's post-hook and the next node's pre-hook: an add
        # there sums two gradients of one input (InputBuffer::accumulate); see accumulation
        self.accumulating = False
        self.accumulations: list[tuple[int, int, int]] = []  # (op index, old gradient sid, sum sid)
        self.reads: list[tuple[int, ...]] = []  # per op: the storage ids of the step it reads

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.busy or func.namespace == "prim":
            return func(*args, **kwargs)
        self.poll()
        index = len(self.ops)
        self.ordinal = 0
        fx_args, fx_kwargs = tree_map(self._arg, (args, kwargs))
        reads = self._read_sids((args, kwargs))
        self.busy = True
        try:
            if func is torch.ops.aten._local_scalar_dense.default and self.scalars:
                out = self.scalars.pop()  # the value the real step read here (eager_scalar_values)
            else:
                out = func(*args, **kwargs)
                if self.known_factories:
                    know_factory_value(func, args, kwargs, out)
            node = self.graph.call_function(func, tuple(fx_args), dict(fx_kwargs))
            wrapped = wrapped_numbers(func, args, kwargs)
            node.meta[WRAPPED_NUMBER_BYTES] = sum(wrapped.values())
            if wrapped and isinstance(out, torch.Tensor):
                self.pending = (node, weakref.ref(out), wrapped, index)
            # a functional collective stands for eager's in-place one (functional_collectives):
            # its output is the tensor written in place, no allocation
            made = None if func.namespace == "_c10d_functional" else index
            node.meta["val"] = tree_map(lambda o: self._stand_in(o, made, node.name), out)
        finally:
            self.busy = False
        self.ops.append(node)
        self.reads.append(reads)
        if self.accumulating and func is torch.ops.aten.add.Tensor:
            self._accumulation(index, args, kwargs, out)
        if isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta["val"] = node.meta["val"][i]
                    self.node_of[o] = item
        elif isinstance(out, torch.Tensor):
            self.node_of[out] = node
        return out

    def _accumulation(self, index: int, args: tuple, kwargs: dict, out: Any) -> None:
        """Note an add of two gradients by autograd's engine (``InputBuffer::accumulate``,
        ``torch/csrc/autograd/input_buffer.cpp``). On real tensors it adds in place
        (``old.add_(new)``) when the buffered gradient is a plain, non-overlapping and
        dense tensor whose last reference the buffer holds; on fake tensors (a tensor
        subclass) it never does, so the recording shows a new storage. ``trace`` models
        eager's rule: the sum lives in the old gradient's storage when the old gradient
        is the tensor its storage was made for (not a view) and that storage died right
        after the add (nothing else held it)."""
        if kwargs or len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args) \
                or not isinstance(out, torch.Tensor):
            return
        old = args[0]
        if not (old.shape == out.shape and old.dtype == out.dtype and old.stride() == out.stride()
                and old.storage_offset() == 0 and old.untyped_storage().nbytes() == old.numel() * old.element_size()):
            return
        before, after = self.alive.get(old.untyped_storage()._cdata), self.alive.get(out.untyped_storage()._cdata)
        holder = self.node_of.get(old)
        # the tensor that was made with its storage, not a view of it (a view's storage is
        # also held by its base while both live: eager then adds out of place)
        if before is not None and after is not None and self.records[after[1]][1] == index \
                and holder is not None and self.records[before[1]][4] == holder.name:
            self.accumulations.append((index, before[1], after[1]))

    def external(self, fn: Callable[..., Any], out: torch.Tensor) -> None:
        """A tensor made without a dispatched op (``torch.get_rng_state``, which
        ``torch.utils.checkpoint`` calls to stash the RNG state): one more op node."""
        self.poll()
        index = len(self.ops)
        self.ordinal = 0
        node = self.graph.call_function(fn, ())
        self.busy = True
        try:
            node.meta["val"] = self._stand_in(out, index, node.name)
        finally:
            self.busy = False
        self.ops.append(node)
        self.reads.append(())
        self.node_of[out] = node

    def _read_sids(self, tree: Any) -> tuple[int, ...]:
        """The storage ids of the step's storages the tensors of ``tree`` are on."""
        sids: list[int] = []

        def read(a: Any) -> None:
            if isinstance(a, torch.Tensor):
                entry = self.alive.get(a.untyped_storage()._cdata)
                if entry is not None and entry[1] not in sids:
                    sids.append(entry[1])

        tree_map(read, tree)
        return tuple(sids)

    def poll(self) -> None:
        """Storages found dead: freed before the op about to run."""
        if self.pending is not None:
            self._saved_wrapped_numbers(*self.pending)
            self.pending = None
        for key in [k for k, (ref, _) in self.alive.items() if ref.expired()]:
            _, sid = self.alive.pop(key)
            self.records[sid][3] = self.clock()
        for key in [k for k, ref in self.static.items() if ref.expired()]:
            del self.static[key]

    def clock(self) -> int:
        """The time stamp a storage found dead now gets: the index of the next op."""
        return len(self.ops)

    def _saved_wrapped_numbers(self, node: fx.Node, out: Any, wrapped: dict[str, int], index: int) -> None:
        """The wrapped numbers of op ``index`` that its autograd node saved: storages of
        that op, alive until autograd releases them; the others are its scratch."""
        t = out()
        grad_fn = t.grad_fn if t is not None else None
        for name in wrapped:
            saved = getattr(grad_fn, f"_saved_{name}", None)
            if not isinstance(saved, torch.Tensor) or saved.dim() != 0:
                continue
            st = saved.untyped_storage()
            if st._cdata in self.alive or st._cdata in self.static:
                continue
            self.alive[st._cdata] = (StorageWeakRef(st), len(self.records))
            self.records.append([st.nbytes(), index, -1, None, f"{node.name}.{name} (wrapped number)"])
            node.meta[WRAPPED_NUMBER_BYTES] -= wrapped[name]

    def _arg(self, a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        node = self.node_of.get(a)
        if node is not None:
            return node
        st = a.untyped_storage()
        if st._cdata not in self.alive and st._cdata not in self.static:
            self.static[st._cdata] = StorageWeakRef(st)
        self.busy = True
        try:
            node = self.graph.placeholder(f"static_{len(self.graph.nodes)}")
            node.meta["val"] = self._stand_in(a, None, node.name)
        finally:
            self.busy = False
        self.node_of[a] = node
        return node

    def _stand_in(self, t: Any, index: int | None, name: str) -> Any:
        """A tensor of the shadow mode laid out as ``t`` on a shadow of its storage; a
        storage first seen as an output of op ``index`` is recorded as allocated."""
        if not isinstance(t, torch.Tensor):
            return t
        ordinal = self.ordinal
        if index is not None:
            self.ordinal += 1
        st = t.untyped_storage()
        key = st._cdata
        if key in self.alive:
            sid = self.alive[key][1]
        elif key in self.static or index is None:
            sid = -1 - len(self.shadow_storages)
            self.static.setdefault(key, StorageWeakRef(st))
        else:
            sid = len(self.records)
            self.records.append([st.nbytes(), index, ordinal, None, name])
            self.alive[key] = (StorageWeakRef(st), sid)
        shadow_key = ("step", sid) if sid >= 0 else ("static", key)
        with self.shadow:
            if shadow_key not in self.shadow_storages:
                self.shadow_storages[shadow_key] = torch.empty(st.nbytes(), dtype=torch.uint8,
                                                               device=t.device).untyped_storage()
            return torch.empty(0, dtype=t.dtype, device=t.device).set_(
                self.shadow_storages[shadow_key], t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def trace(self) -> EagerTrace:
        """The recording so far (storages alive now have ``freed_before`` None), with
        autograd's gradient sums in place where eager adds in place (``_accumulation``)."""
        records = [list(r) for r in self.records]
        merged: set[int] = set()
        for index, old, new in self.accumulations:
            if old not in merged and records[old][3] == index + 1:  # the buffer held its last reference
                records[old][3] = records[new][3]
                merged.add(new)
        kept = [sid for sid in range(len(records)) if sid not in merged]
        index = {sid: i for i, sid in enumerate(kept)}
        for _, old, new in self.accumulations:
            if new in merged:
                index[new] = index[old]  # the sum is read where the old gradient's storage is
        reads = tuple(tuple(dict.fromkeys(index[s] for s in r)) for r in self.reads)
        storages = tuple(EagerStorage(*records[sid]) for sid in kept)
        return EagerTrace(self.graph, tuple(self.ops), storages, reads)


def without_weights(model: torch.nn.Module, inputs: Any) -> bool:
    """Whether ``model`` or ``inputs`` hold meta or fake tensors (a step built without
    weights: ``--meta``, a config file at full size): recorded, never run."""
    args, kwargs = split_inputs(inputs)
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))]
    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def _fake_model(fake: FakeTensorMode, model: torch.nn.Module,
                converter: FakeConverter) -> tuple[Callable[[tuple, dict], Any], ContextManager]:
    """``(run, binding)``: ``run(args, kwargs)`` is ``model``'s output on fake parameters
    and buffers while ``binding`` is entered (it spans forward and backward, so that a
    checkpoint's recompute in backward also sees the fakes). The fakes: a copy made in
    ``fake`` (``FakeCopyMode``; ``binding`` does nothing); for a model that cannot be
    copied (Megatron-Core's modules hold process groups) or one without weights (meta
    tensors: their fakes are CPU tensors, as ``fake_trace.FakeConverter`` makes them,
    storage sharing kept), fakes swapped in for the model's own tensors
    (``flat_step.bind_tensors``)."""
    named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    if not any(t.is_meta for _, t in named):
        try:
            with FakeCopyMode(fake):
                copied = copy.deepcopy(model)
            for p in copied.parameters():
                p.grad = None
            return (lambda args, kwargs: copied(*args, **kwargs)), contextlib.nullcontext()
        except (TypeError, RuntimeError):
            pass
    converted = converter.convert([t.detach() for _, t in named])
    replace = {id(t): f.requires_grad_(t.requires_grad) if t.is_floating_point() else f
               for (_, t), f in zip(named, converted)}
    return (lambda args, kwargs: model(*args, **kwargs)), bind_tensors(model, replace)


def _fake_closure(converter: FakeConverter, loss_fn: LossFn | None) -> LossFn | None:
    """``loss_fn`` with the meta tensors it closes over (a factory's targets built on the
    meta device) replaced by CPU fakes; any other ``loss_fn`` as it is."""
    cells = getattr(loss_fn, "__closure__", None) or ()
    metas = [c.cell_contents for c in cells
             if isinstance(getattr(c, "cell_contents", None), torch.Tensor) and c.cell_contents.is_meta]
    if not metas:
        return loss_fn
    import types

    fakes = {id(m): f for m, f in zip(metas, converter.convert(metas))}
    closure = tuple(types.CellType(fakes.get(id(c.cell_contents), c.cell_contents)) for c in cells)
    return types.FunctionType(loss_fn.__code__, loss_fn.__globals__, loss_fn.__name__,  # type: ignore[union-attr]
                              loss_fn.__defaults__, closure)  # type: ignore[union-attr]


def _mark_accumulations(loss: torch.Tensor, recorder: OpRecorder) -> list[Any]:
    """Hooks on every node of ``loss``'s autograd graph: a pre-hook clears
    ``recorder.accumulating``, a post-hook sets it, so that it is True exactly while the
    engine adds a node's gradients into the next nodes' input buffers (ops a nested
    backward runs, Megatron's reentrant checkpoint, are not marked). Returns the handles."""
    handles: list[Any] = []
    seen: set[int] = set()
    todo = [loss.grad_fn]

    def pre(*_: Any) -> None:
        recorder.accumulating = False

    def post(*_: Any) -> None:
        recorder.accumulating = True

    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        handles += [node.register_prehook(pre), node.register_hook(post)]
        todo += [n for n, _ in node.next_functions]
    return handles


def record_eager_step(model: torch.nn.Module, inputs: Any, loss_fn: LossFn | None,
                      kernels: Callable[[], ContextManager[Any]] | None = None,
                      scalars: list[Any] | None = None) -> EagerTrace:
    """Record ``loss_fn(model(*inputs)).backward()`` as eager PyTorch runs it, on a fake
    copy of the model (``_fake_model``) and fake inputs; the model's own tensors and
    ``.grad``s are untouched.

    Args:
        model: the module as the user runs it (its own checkpointing included), on CPU
            or the meta device (recorded as on the CPU; ``without_weights``).
        inputs: a tensor, the forward's positional arguments or a dict of keyword
            arguments (``flat_step.split_inputs``; tensors are faked).
        loss_fn: the model's output -> a scalar loss; None: the output is the loss or
            has ``.loss`` (``flat_step.extract_loss``); meta tensors it closes over
            (targets) are recorded as CPU tensors.
        kernels: a context entered around forward and backward that makes ops run as
            on another device (``cuda_target.eager_kernels_on_cuda``); None: the CPU's.
        scalars: the values the real step read from its tensors
            (``eager_branches.eager_scalar_values``), replayed in order. None: the
            values constants and factories decide; where the step reads one they do
            not, it is recorded again with the libraries' branches for fake tensors,
            and ``EagerTrace.notes`` says so (``FAKE_BRANCHES``). Either way the
            libraries' fake-tensor checks are off (``eager_branches``).

    Returns:
        The EagerTrace: every op (forward, loss, backward) with the storages it
        allocates and when each dies; ``.grad`` of the copies is None before the step.

    Raises:
        RematError: an op cannot run on fake tensors (a data-dependent ``.item()``,
            an op with no meta function), with the op's error.
    """
    if scalars is not None:
        return _record(model, inputs, loss_fn, kernels, scalars, True)
    try:  # without values: the branches that constants decide as eager decides them
        return _record(model, inputs, loss_fn, kernels, None, True)
    except RematError as e:
        if not is_data_dependent(e.__cause__ or e):
            raise
    trace = _record(model, inputs, loss_fn, kernels, None, False)
    return dataclasses.replace(trace, notes=(FAKE_BRANCHES,))


def _record(model: torch.nn.Module, inputs: Any, loss_fn: LossFn | None,
            kernels: Callable[[], ContextManager[Any]] | None, scalars: list[Any] | None,
            eager_branches: bool) -> EagerTrace:
    """``record_eager_step`` once: with ``eager_branches``, the libraries' fake-tensor
    checks off and the factories' values known (``eager_branches``)."""
    fake = constant_values_mode()  # real tensors allowed (a loss_fn's targets); small constants' values known
    converter = FakeConverter(fake, "cpu")  # meta tensors -> CPU fakes, storages shared as they are
    run, binding = _fake_model(fake, model, converter)
    loss_fn = _fake_closure(converter, loss_fn)
    args, kwargs = split_inputs(inputs)
    args, kwargs = tree_map(lambda x: (converter.convert([x])[0] if x.is_meta else fake.from_tensor(x))
                            if isinstance(x, torch.Tensor) else x, (args, kwargs))
    recorder = OpRecorder(FakeTensorMode(allow_non_fake_inputs=True), scalars, eager_branches and scalars is None)
    get_rng_state = torch.get_rng_state

    def stashed_rng_state() -> torch.Tensor:
        state = get_rng_state()
        recorder.external(get_rng_state, state)
        return state

    torch.get_rng_state = stashed_rng_state
    try:
        with fake, recorder, functional_collectives(), binding, (kernels or contextlib.nullcontext)(), \
                (eager_library_checks() if eager_branches else contextlib.nullcontext()):
            loss = extract_loss(run(args, kwargs), loss_fn)  # the output is not held through backward
            handles = _mark_accumulations(loss, recorder)
            loss.backward()
            del args, kwargs, loss
            for h in handles:
                h.remove()
            recorder.poll()  # what died by the end of backward; the .grads live on
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise RematError(f"the eager step could not run on fake tensors: {type(e).__name__}: {e}") from e
    finally:
        torch.get_rng_state = get_rng_state
    return recorder.trace()
