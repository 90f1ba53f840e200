"""Why a step that runs eagerly cannot be traced: the first op whose meta function (what
AOTAutograd runs on fake tensors) fails, with the fix when one is known."""

from __future__ import annotations

import contextlib
import logging
import traceback
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from ..errors import UnsupportedGraph
from .data_scalars import user_line


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Keep FakeTensorMode's own log of a failing meta function (a 20-line traceback on
    stderr) out of the output while tracing: the error is raised to the caller, with
    its cause, as an UnsupportedGraph."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


TRACE_FIXES = {
    "aten._grouped_mm": (
        "transformers' mixture-of-experts layers call it by default "
        "(config._experts_implementation = 'grouped_mm'), and its meta function accepts only "
        "bfloat16 here; build the model with config._experts_implementation = 'batched_mm' "
        "(or 'eager'), or trace it in bfloat16"
    ),
    **dict.fromkeys(("aten.nonzero", "aten.index", "aten.masked_select", "aten.unique_dim", "aten._unique2"), (
        "its output's shape depends on the data (nonzero, boolean-mask indexing, torch.where with one "
        "argument, unique), so no static graph holds for every batch; use a shape-static form "
        "(torch.where(mask, x, 0), a multiplication by the mask); transformers' mixture-of-experts "
        "layers: config._experts_implementation = 'batched_mm' instead of the eager experts loop"
    )),
}
"""Ops that run eagerly but whose meta (shape) function refuses the inputs, with the
fix to name (op overload packet -> what to do)."""


FLEX_ATTENTION_FIX = (
    "torch.nn.attention.flex_attention (called at {line}) cannot be traced into the training step: it "
    "has no backward on CPU in this PyTorch, and outside torch.compile AOTAutograd's fake tensors cannot "
    "run its eager implementation (it reads data pointers). Use "
    "torch.nn.functional.scaled_dot_product_attention instead (the mask as attn_mask, or is_causal=True; "
    "torchtitan: the sdpa attention variant, use_flex_attn=False)"
)
"""The refusal of a step that calls flex attention, with the supported alternative."""


def known_trace_error(error: BaseException) -> str | None:
    """The message for a tracing error whose cause and fix are known (a step that
    calls ``flex_attention``: its traceback passes through
    ``torch/nn/attention/flex_attention.py``), naming the user's Python line; else None."""
    frames = traceback.extract_tb(error.__traceback__)
    if any(f.filename.replace("\\", "/").endswith("nn/attention/flex_attention.py") for f in frames):
        return FLEX_ATTENTION_FIX.format(line=user_line(frames) or "an unknown line") + f" ({type(error).__name__}: {error})"
    return None


class _FakeCheck(TorchDispatchMode):
    """Runs every op eagerly and again on fake copies of its inputs; keeps the first op
    whose fake run (its meta function, which tracing uses) fails: ``(op, error, the
    user's Python line that called it or None)``."""

    def __init__(self, skip: frozenset = frozenset()) -> None:
        super().__init__()
        self.skip = skip
        self.failed: tuple[Any, BaseException, str | None] | None = None
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failed is None and func not in self.skip:
            try:
                fake_args, fake_kwargs = tree_map_only(torch.Tensor, self.fake.from_tensor, (args, kwargs))
                with self.fake:
                    func(*fake_args, **fake_kwargs)
            except Exception as e:  # noqa: BLE001 - any failure of the meta function is the finding
                self.failed = (func, e, user_line(traceback.extract_stack()))
        return out


def explain_untraceable(step: Callable[..., torch.Tensor], primal_values: Sequence[torch.Tensor],
                         error: UnsupportedGraph, skip: frozenset = frozenset()) -> None:
    """Find the op that made tracing fail and raise an UnsupportedGraph naming it.

    The step is run eagerly once (forward and backward, parameter ``.grad`` restored)
    with every op also run on fake tensors; the first op that runs eagerly but not on
    fake tensors is the one tracing cannot pass. Returns without raising when every op
    passes (the error is elsewhere) or the eager step fails too. Ops in ``skip`` are
    not findings (``aten._local_scalar_dense`` once the trace replays its values).

    Raises:
        UnsupportedGraph: naming the op, the Python line that called it (the innermost
            frame outside torch: ``data_scalars.user_line``), its error, and the fix when ``TRACE_FIXES``
            knows one; chained to the original error.
    """
    grads = [p.grad for p in primal_values]
    check = _FakeCheck(skip)
    try:
        with check, quiet_fake_tensor_log():
            step(*primal_values).backward()
    except Exception:  # noqa: BLE001 - the step fails eagerly too: the original error stands
        return
    finally:
        for p, g in zip(primal_values, grads):
            p.grad = g
    if check.failed is None:
        return
    op, cause, line = check.failed
    packet = str(op.overloadpacket) if hasattr(op, "overloadpacket") else str(op)
    fix = TRACE_FIXES.get(packet, "")
    raise UnsupportedGraph(
        f"{op} runs eagerly on these inputs{f' (called at {line})' if line else ''} but cannot be traced: its "
        "meta function, which "
        f"AOTAutograd runs on fake tensors, fails ({type(cause).__name__}: {cause}). "
        + (f"Fix: {fix}." if fix else
           "Keep that op outside the traced model, or use inputs (dtype, device) its meta function accepts.")
    ) from error.__cause__
