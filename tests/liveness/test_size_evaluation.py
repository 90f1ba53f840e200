"""Sizes of symbolic shapes evaluated (``liveness.symbolic_sizes``): at the compile-time
example (``size_hint``, ``concrete_step``) and at the shapes of a step that ran
(``symbol_sources``, ``symbolic_size``, ``evaluate_size``), as the torch.compile backend
evaluates them under dynamic shapes."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from remat_pass.liveness.symbolic_sizes import (
    concrete_step,
    evaluate_size,
    is_symbolic_tensor,
    shape_hints,
    size_hint,
    symbol_sources,
    symbolic_size,
)
from remat_pass.recompute import schedule as schedules
from remat_pass.recompute.rewrite import rewrite


def _dynamic_rows(rows: int, cols: int) -> torch.Tensor:
    """A fake ``rows x cols`` float32 tensor whose first dimension is a shape symbol."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    return mode.from_tensor(torch.empty(rows, cols), symbolic_context=ctx)


def test_a_symbolic_size_is_evaluated_at_a_step_and_at_the_example():
    t = _dynamic_rows(3, 4)
    assert is_symbolic_tensor(t) and not is_symbolic_tensor(torch.empty(3, 4))
    ((index, dim, sym),) = symbol_sources([t])
    assert (index, dim) == (0, 0)
    nbytes = symbolic_size(t.untyped_storage().nbytes())
    assert nbytes == 16 * sym
    assert size_hint(t.untyped_storage().nbytes()) == 48  # the example: 3 rows
    assert evaluate_size(nbytes, {sym: 5}) == 80
    assert evaluate_size(nbytes, {}, {sym: 3}) == 48  # a symbol with no value takes its hint
    assert evaluate_size(7, {}) == 7 and symbolic_size(7) == 7


def test_a_size_with_an_unknown_symbol_is_refused():
    s, other = sympy.symbols("s0 s1", positive=True, integer=True)
    assert evaluate_size(s * other, {s: 2}, {other: 5}) == 10
    with pytest.raises(ValueError, match="s1"):
        evaluate_size(s * other, {s: 2})


def test_a_concrete_step_is_returned_as_it_is(tiny_gpt_session):
    session = tiny_gpt_session
    step = rewrite(session.joint, session.stack, schedules.uniform(1, session.stack.num_layers))
    assert concrete_step(step) == (step, False)
    assert shape_hints(session.joint) == {}
