"""Data-dependent scalars of a traced step (``aten._local_scalar_dense``: ``.item()``,
``int(t)``, ``float(t)``, a Python ``if`` on a one-element tensor): traced specialized
to the example batch's values, or refused naming the op and the Python line.

FakeTensors have no values, so AOTAutograd cannot trace an op whose Python result is a
tensor's value (``DataDependentOutputException``, ``torch/_subclasses/fake_tensor.py``).
When the step has real example values, it is run eagerly once (``record_scalars``: no
grad, the RNG state and every buffer and input left as they were) and each such value
recorded with the Python line that asked for it; the trace then replays them in order
(``replaying``): each becomes a constant of the graph, which holds for this batch (the
path a branch took, a count) and for any batch that gives the same values. Every
specialization is described (``Scalar.describe``) so that every output can say so.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import traceback
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UnsupportedGraph

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default

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


@dataclasses.dataclass(frozen=True)
class Scalar:
    """One data-dependent scalar of the example batch: its value and where it was asked for."""

    value: Any
    where: str

    def describe(self) -> str:
        """``"aten._local_scalar_dense = 3 at model.py:12 (in forward)"``."""
        return f"aten._local_scalar_dense (.item()) = {self.value!r} at {self.where}"


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.scalars: list[Scalar] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func is LOCAL_SCALAR:
            self.scalars.append(Scalar(out, user_line(traceback.extract_stack()) or "an unknown line"))
        return out


def record_scalars(step: Callable[..., torch.Tensor], primal_values: Sequence[torch.Tensor],
                   primal_kinds: Sequence[str]) -> list[Scalar]:
    """Run ``step`` eagerly once (forward and loss, with autograd on as when traced) and
    record every ``aten._local_scalar_dense`` value in call order, with its Python line
    (replayed only at the same line: ``replaying``). Buffers and
    inputs are passed as clones (a BatchNorm in train mode leaves them as they were);
    the CPU and CUDA RNG states are restored (``torch.random.fork_rng``).

    Raises:
        UnsupportedGraph: the step fails eagerly (its error chained).
    """
    args = [v if kind == "param" or not isinstance(v, torch.Tensor) else v.clone()
            for v, kind in zip(primal_values, primal_kinds)]
    record = _Record()
    devices = sorted({v.device.index or 0 for v in primal_values if isinstance(v, torch.Tensor) and v.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices), record:
            step(*args)
    except Exception as e:  # noqa: BLE001 - the step itself fails: say so
        raise UnsupportedGraph(f"the training step fails when run eagerly ({type(e).__name__}: {e})") from e
    return record.scalars


class _Replay(TorchDispatchMode):
    def __init__(self, scalars: Sequence[Scalar]) -> None:
        super().__init__()
        self.scalars, self.next = scalars, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is not LOCAL_SCALAR:
            return func(*args, **(kwargs or {}))
        where = user_line(traceback.extract_stack()) or "an unknown line"
        if self.next < len(self.scalars) and self.scalars[self.next].where != where:
            raise UnsupportedGraph(
                f"aten._local_scalar_dense (.item()) at {where} is asked for while tracing where the eager run "
                f"asked for it at {self.scalars[self.next].where}: the step's data-dependent values cannot be "
                "replayed in order. Compute that value outside the traced model and pass it in as a Python number.")
        if self.next >= len(self.scalars):
            raise UnsupportedGraph(
                f"aten._local_scalar_dense (.item()) at {where} is called more often while tracing than when "
                f"the step ran eagerly ({len(self.scalars)} times): the step's data-dependent values cannot be "
                "replayed. Compute that value outside the traced model and pass it in as a Python number.")
        self.next += 1
        return self.scalars[self.next - 1].value


def replaying(step: Callable[..., torch.Tensor], scalars: Sequence[Scalar]) -> Callable[..., torch.Tensor]:
    """``step`` with each ``aten._local_scalar_dense`` call answered, in order, by the
    recorded ``scalars`` (each call of the returned function starts from the first), so
    that tracing it specializes the graph to the example batch's values.

    Raises (when the returned function runs):
        UnsupportedGraph: a call comes from another Python line than the recorded one at
            its position, or there are more calls than recorded (the trace takes another
            path than the eager run).
    """

    def replayed(*args: Any) -> torch.Tensor:
        with _Replay(scalars):
            return step(*args)

    return replayed


def capture_specialized(capture: Callable[[Callable[..., torch.Tensor]], Any], step: Callable[..., torch.Tensor],
                        primal_values: Sequence[torch.Tensor], primal_kinds: Sequence[str],
                        error: UnsupportedGraph) -> tuple[Any, tuple[str, ...]]:
    """``capture(step)`` failed with ``error`` (a data-dependent op): record the step's
    scalars (``record_scalars``) and capture it again replaying them.

    Returns:
        ``(what capture returned, the description of every specialized scalar)``.

    Raises:
        UnsupportedGraph: ``error`` when the step asks for no scalar (another
            data-dependent op: ``nonzero``, boolean-mask indexing), or the error of the
            second capture (it names the op and the Python line).
    """
    scalars = record_scalars(step, primal_values, primal_kinds)
    if not scalars:
        raise error
    return capture(replaying(step, scalars)), tuple(s.describe() for s in scalars)
