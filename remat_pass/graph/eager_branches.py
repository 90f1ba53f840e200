"""The branches the user's eager step takes, for ``eager_trace.record_eager_step``: a
step recorded on fake tensors has no values, and libraries take other paths for fake
tensors than eager code on real ones.

- **Values read, replayed** (``eager_scalar_values``). With the model's weights at hand,
  one real step collects every value its Python reads from a tensor (``.item()``, an
  ``if`` on a tensor: ``aten._local_scalar_dense``), in order; the recording returns
  them in the same order, so it follows the real step's branches.
- **Libraries' fake-tensor checks off** (``eager_library_checks``). ``transformers``'
  ``is_tracing(tensor)`` counts a FakeTensor as tracing and then keeps data-dependent
  shortcuts off (``masking_utils``: a causal mask built where SDPA's ``is_causal``
  serves on real tensors, a packed-sequence mask kept). While recording it does not.
- **Factories' values known** (``know_factory_value``). Without weights (the meta
  device) nothing can run for real, but a value computed only from ``arange`` /
  ``ones`` / ``full`` and the graph's constants (positions from ``cache_position``) is
  fixed: the small outputs of such factories keep their values as FakeTensor constants
  (``trace_context.constant_values_mode`` propagates them; an in-place write drops
  them, as FakeTensorMode does for every constant).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import RematError
from .flat_step import LossFn, extract_loss, split_inputs
from .trace_context import KNOWN_NUMEL_LIMIT

FACTORIES = frozenset({"arange", "ones", "zeros", "full", "scalar_tensor", "linspace", "eye"})
"""Deterministic factory ops (by overload packet) whose small outputs keep their values."""

FAKE_BRANCHES = ("recorded with the branches libraries take for fake tensors (transformers' is_tracing): the eager "
                 "step reads a value no constant decides (an input's), so shortcuts it may take on real tensors "
                 "(no causal mask under SDPA) are not taken")
"""The note of a recording without values that took the libraries' fake-tensor paths."""


class _ScalarReads(TorchDispatchMode):
    """Collects the value of every ``aten._local_scalar_dense`` a real step dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.values.append(out)
        return out


def eager_scalar_values(model: torch.nn.Module, inputs: Any, loss_fn: LossFn | None) -> list[Any]:
    """The values the real step ``loss_fn(model(*inputs)).backward()`` reads from its
    tensors, in order (``.item()``, ``bool(t)``: ``aten._local_scalar_dense``): what its
    data-dependent Python branches took, for ``record_eager_step`` to replay. One real
    step on the model's own weights; each parameter's ``.grad`` is left as it was.

    Raises:
        RematError: the step fails on its real tensors."""
    grads = {p: p.grad for p in model.parameters()}
    reads = _ScalarReads()
    args, kwargs = split_inputs(inputs)
    try:
        with reads:
            extract_loss(model(*args, **kwargs), loss_fn).backward()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise RematError(f"the eager step could not run: {type(e).__name__}: {e}") from e
    finally:
        for p, g in grads.items():
            p.grad = g
    return reads.values


@contextlib.contextmanager
def eager_library_checks() -> Iterator[None]:
    """While active, ``transformers``' ``is_tracing(tensor)`` does not count a FakeTensor
    as tracing (torch.compile, torch.jit and fx still count). Every module of the package
    that bound the function is patched and restored; nothing happens when transformers
    is not imported."""
    utils = sys.modules.get("transformers.utils.import_utils")
    original: Callable[..., bool] | None = getattr(utils, "is_tracing", None)
    if original is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return original(None if isinstance(tensor, FakeTensor) else tensor)

    bound = [m for name, m in list(sys.modules.items())
             if name.startswith("transformers") and getattr(m, "is_tracing", None) is original]
    for m in bound:
        m.is_tracing = is_tracing  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in bound:
            m.is_tracing = original  # type: ignore[attr-defined]


def know_factory_value(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Give ``out`` (a factory op's FakeTensor output) its value as a constant when
    ``func`` is one of ``FACTORIES``, takes no tensor, and makes at most
    ``KNOWN_NUMEL_LIMIT`` elements on the CPU; anything else is left as it is."""
    if not isinstance(out, FakeTensor) or out.constant is not None or out.device.type != "cpu" \
            or out.numel() > KNOWN_NUMEL_LIMIT or func.overloadpacket.__name__ not in FACTORIES \
            or any(isinstance(a, torch.Tensor) for a in tree_leaves((args, kwargs))):
        return
    with unset_fake_temporarily():
        out.constant = func(*args, **kwargs)


def is_data_dependent(error: BaseException) -> bool:
    """Whether ``error`` (raised while recording) is a fake tensor's unknown value."""
    return any(type(e).__name__ in ("DataDependentOutputException", "GuardOnDataDependentSymNode")
               for e in (error, error.__cause__) if e is not None)
