"""Data-dependent values of a traced step: scalars (``aten._local_scalar_dense``:
``.item()``, ``int(t)``, ``float(t)``, a Python ``if`` on a one-element tensor) and the
index tensors of data-dependent shapes (``aten.nonzero``: ``torch.where(mask)``, a
mixture-of-experts loop's tokens per expert; boolean-mask indexing ``x[mask]``): traced
specialized to the example batch's values, or refused naming the op and the Python line.

FakeTensors have no values, so AOTAutograd cannot trace an op whose Python result is a
tensor's value (``DataDependentOutputException``, ``torch/_subclasses/fake_tensor.py``).
When the step has real example values, it is run eagerly once (``record_scalars``: no
grad, the RNG state and every buffer and input left as they were) and each such value
recorded with the Python line that asked for it; the trace then replays them in order
(``replaying``): each becomes a constant of the graph (a nonzero's indices a tensor
constant, copied where nonzero allocated its output; a mask index the same index with the
mask's int64 indices, so its gradient still flows), which holds for this batch (the path
a branch took, a count, the tokens routed to each expert) and for any batch that gives
the same values. Every specialization is described (``Scalar.describe``: the sizes it
gave) so that every output can say so. Other data-dependent shapes (``unique``,
``masked_select``) are refused.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import traceback
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UnsupportedGraph

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
NONZERO = torch.ops.aten.nonzero.default
INDEX = torch.ops.aten.index.Tensor
SPECIALIZED_OPS = frozenset({LOCAL_SCALAR, NONZERO, INDEX})
"""The ops a trace with real values is specialized at (``INDEX`` only with a boolean mask)."""

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_PACKAGE_DIRS = tuple(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))


def _is_library(path: str) -> bool:
    """torch, remat_pass or the standard library (not a site-packages model library)."""
    return path.startswith((_TORCH_DIR, _OWN_DIR)) or (
        path.startswith(_STDLIB_DIR) and not path.startswith(_PACKAGE_DIRS))


def user_line(frames: Sequence[traceback.FrameSummary]) -> str | None:
    """``"file:line (in function): code"`` of the innermost frame of ``frames`` outside
    torch, the standard library and remat_pass (the user's model code), or None."""
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if not _is_library(path) and not f.filename.startswith("<"):
            code = f" : {f.line.strip()}" if f.line else ""
            return f"{f.filename}:{f.lineno} (in {f.name}){code}"
    return None


def error_line(error: BaseException) -> str | None:
    """The user's Python line (``user_line``) in the traceback of ``error`` (raised while
    the model's code was being traced), or None."""
    return user_line(traceback.extract_tb(error.__traceback__))


@dataclasses.dataclass(frozen=True, eq=False)
class Scalar:
    """One data-dependent value of the example batch and where it was asked for.

    ``op`` is ``"aten._local_scalar_dense"`` (``value``: the Python number),
    ``"aten.nonzero"`` (``value``: the int64 index tensor, rows x dims) or
    ``"aten.index"`` (boolean-mask indexing; ``value``: per index, None or the int64
    index tensors that the mask stands for, one per dimension it covers).
    """

    value: Any
    where: str
    op: str = "aten._local_scalar_dense"
    internal: bool = False  # asked for inside another torch op (one_hot's check of its classes)

    def size(self) -> Any:
        """The value for a scalar; the rows it gave for a nonzero or a mask index."""
        if self.op == "aten.nonzero":
            return int(self.value.shape[0])
        if self.op == "aten.index":
            return next(len(ix[0]) for ix in self.value if ix is not None)
        return self.value


def describe(scalars: Sequence[Scalar], shown: int = 12) -> tuple[str, ...]:
    """One line per (op, Python line) of ``scalars``, in the order first asked for: the
    values (a scalar) or the rows (a data-dependent shape) the graph is specialized to,
    e.g. ``"aten.nonzero at moe.py:40 (in forward): 4 calls giving 3, 5, 2, 6 rows: ..."``;
    the first ``shown`` values of each, then a count."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for sc in scalars:
        groups.setdefault((sc.op, sc.where), []).append(sc.size())
    out = []
    for (op, where), sizes in groups.items():
        values = ", ".join(repr(v) for v in sizes[:shown]) + (f", ... ({len(sizes) - shown} more)" if len(sizes) > shown else "")
        calls = f"{len(sizes)} calls giving " if len(sizes) > 1 else ""
        if op == "aten._local_scalar_dense":
            out.append(f"aten._local_scalar_dense (.item()) at {where}: {calls or '= '}{values}")
        else:
            what = "rows" if op == "aten.nonzero" else "elements selected by a boolean mask"
            out.append(f"{op} at {where}: {calls}{values} {what}; the sizes that follow from it (e.g. the "
                       "tokens routed to each expert) hold for this batch")
    return tuple(out)


def _has_mask(indices: Sequence[Any]) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _mask_indices(indices: Sequence[Any]) -> tuple[Any, ...]:
    """Per index of ``aten.index.Tensor``: None, or the int64 tensors its boolean mask stands for."""
    return tuple(torch.nonzero(i).unbind(1) if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                 else None for i in indices)


def _recorded(func: Any, args: Sequence[Any], out: Any, where: str) -> Scalar | None:
    """The Scalar to record for the op ``func`` that returned ``out``, or None."""
    if func is LOCAL_SCALAR:
        return Scalar(out, where)
    if func is NONZERO:
        return Scalar(out.clone(), where, "aten.nonzero")
    if func is INDEX and _has_mask(args[1]):
        return Scalar(_mask_indices(args[1]), where, "aten.index")
    return None


def _op_name(func: Any) -> str | None:
    """The ``Scalar.op`` name an op is recorded under (None: not data-dependent)."""
    return {LOCAL_SCALAR: "aten._local_scalar_dense", NONZERO: "aten.nonzero", INDEX: "aten.index"}.get(func)


# the Python calls whose own job is to ask for a tensor's value
_CONVERSIONS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__"})


class _Calls(TorchFunctionMode):
    """The stack of torch functions being called (``torch.nn.functional.one_hot``, ``Tensor.item``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.stack.append(getattr(func, "__name__", ""))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.stack.pop()


class _Record(TorchDispatchMode):
    def __init__(self, calls: _Calls) -> None:
        super().__init__()
        self.scalars: list[Scalar] = []
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in SPECIALIZED_OPS:
            scalar = _recorded(func, args, out, user_line(traceback.extract_stack()) or "an unknown line")
            if scalar is not None:
                internal = func is LOCAL_SCALAR and bool(self.calls.stack) and self.calls.stack[-1] not in _CONVERSIONS
                self.scalars.append(dataclasses.replace(scalar, internal=internal))
        return out


def record_scalars(step: Callable[..., torch.Tensor], primal_values: Sequence[torch.Tensor],
                   primal_kinds: Sequence[str]) -> list[Scalar]:
    """Run ``step`` eagerly once (forward and loss, with autograd on as when traced) and
    record, in call order with its Python line, every ``aten._local_scalar_dense``
    value, every ``aten.nonzero`` output and the indices of every boolean-mask
    ``aten.index`` (replayed only at the same line: ``replaying``). Buffers and
    inputs are passed as clones (a BatchNorm in train mode leaves them as they were);
    the CPU and CUDA RNG states are restored (``torch.random.fork_rng``).

    Raises:
        UnsupportedGraph: the step fails eagerly (its error chained).
    """
    args = [v if kind == "param" or not isinstance(v, torch.Tensor) else v.clone()
            for v, kind in zip(primal_values, primal_kinds)]
    calls = _Calls()
    record = _Record(calls)
    devices = sorted({v.device.index or 0 for v in primal_values if isinstance(v, torch.Tensor) and v.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices), calls, record:
            step(*args)
    except Exception as e:  # noqa: BLE001 - the step itself fails: say so
        raise UnsupportedGraph(f"the training step fails when run eagerly ({type(e).__name__}: {e})") from e
    return record.scalars


class _Replay(TorchDispatchMode):
    def __init__(self, scalars: Sequence[Scalar], used: list[int]) -> None:
        super().__init__()
        self.scalars, self.next, self.used = scalars, 0, used

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func not in SPECIALIZED_OPS or (func is INDEX and not _has_mask(args[1])):
            return func(*args, **(kwargs or {}))
        where = user_line(traceback.extract_stack()) or "an unknown line"
        name = _op_name(func)
        while (self.next < len(self.scalars) and self.scalars[self.next].internal
               and (self.scalars[self.next].where, self.scalars[self.next].op) != (where, name)):
            self.next += 1  # asked for inside a torch op only when it runs eagerly (one_hot's class check)
        if self.next < len(self.scalars) and (self.scalars[self.next].where, self.scalars[self.next].op) != (where, name):
            raise UnsupportedGraph(
                f"{name} at {where} is asked for while tracing where the eager run "
                f"asked for {'it' if self.scalars[self.next].op == name else self.scalars[self.next].op} at "
                f"{self.scalars[self.next].where}: the step's "
                "data-dependent values cannot be replayed in order. Compute that value outside the traced "
                "model and pass it in (a Python number, an index tensor).")
        if self.next >= len(self.scalars):
            raise UnsupportedGraph(
                f"{name} at {where} is called more often while tracing than when "
                f"the step ran eagerly ({len(self.scalars)} data-dependent values): they cannot be "
                "replayed. Compute that value outside the traced model and pass it in (a Python number, "
                "an index tensor).")
        scalar = self.scalars[self.next]
        self.used.append(self.next)
        self.next += 1
        if func is LOCAL_SCALAR:
            return scalar.value
        if func is NONZERO:  # a constant of the graph, copied where nonzero allocated its output
            return scalar.value.clone()
        indices = []
        for index, recorded in zip(args[1], scalar.value):
            indices.extend([index] if recorded is None else [r.clone() for r in recorded])
        return func(args[0], indices)


def replaying(step: Callable[..., torch.Tensor], scalars: Sequence[Scalar],
              used: list[int] | None = None) -> Callable[..., torch.Tensor]:
    """``step`` with each ``aten._local_scalar_dense``, ``aten.nonzero`` and boolean-mask
    ``aten.index`` call answered, in order, by the recorded ``scalars`` (each call of the returned function starts from the first), so
    that tracing it specializes the graph to the example batch's values. A scalar that a
    torch op asked for inside itself when run eagerly only (``internal``) is skipped when
    the trace does not ask for it; ``used`` (if given) receives the position of each
    value replayed.

    Raises (when the returned function runs):
        UnsupportedGraph: a call comes from another Python line than the recorded one at
            its position, or there are more calls than recorded (the trace takes another
            path than the eager run).
    """

    def replayed(*args: Any) -> torch.Tensor:
        with _Replay(scalars, [] if used is None else used):
            return step(*args)

    return replayed


def capture_specialized(capture: Callable[[Callable[..., torch.Tensor]], Any], step: Callable[..., torch.Tensor],
                        primal_values: Sequence[torch.Tensor], primal_kinds: Sequence[str],
                        error: UnsupportedGraph) -> tuple[Any, tuple[str, ...]]:
    """``capture(step)`` failed with ``error`` (a data-dependent op): record the step's
    scalars (``record_scalars``) and capture it again replaying them.

    Returns:
        ``(what capture returned, the description of the values the graph holds``
        ``(``describe``: one line per op and Python line))``.

    Raises:
        UnsupportedGraph: ``error`` when the step asks for no such value (another
            data-dependent op: ``unique``, ``masked_select``), or the error of the
            second capture (it names the op and the Python line).
    """
    scalars = record_scalars(step, primal_values, primal_kinds)
    if not scalars:
        raise error
    used: list[int] = []
    out = capture(replaying(step, scalars, used))
    return out, describe([scalars[i] for i in sorted(set(used))])
