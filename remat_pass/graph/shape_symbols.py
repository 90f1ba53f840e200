"""Named shape symbols of a symbolic trace: the primal dimensions each name makes
dynamic, the fake primals that carry them, and the sympy Symbols AOTAutograd used for
each name."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ..errors import UnsupportedGraph
from .flat_step import FlatStep


def named_symbols(dims_of_symbol: Mapping[str, list[tuple[int, int]]], trace_values: Sequence[Any],
                  shape_env: Any, primal_labels: Sequence[str]) -> dict[str, Any]:
    """The user's name of each symbol -> the sympy Symbols AOTAutograd used for it.

    Raises:
        UnsupportedGraph: the trace specialized a named size to one value.
    """
    named: dict[str, Any] = {}
    for name, dims in dims_of_symbol.items():
        exprs = []
        for flat_index, dim in dims:
            size = trace_values[flat_index].shape[dim]
            expr = shape_env.replace(size.node.expr) if isinstance(size, torch.SymInt) else size
            if not getattr(expr, "is_Symbol", False):
                raise UnsupportedGraph(
                    f"the traced step specializes symbol {name!r} (input dimension "
                    f"{(primal_labels[flat_index], dim)}) to {expr}: the model branches on "
                    "that size, so its graph holds only for that value; trace it with "
                    "concrete shapes"
                )
            if expr not in exprs:
                exprs.append(expr)
        named[name] = tuple(exprs)
    return named


def dynamic_dims(symbols: Mapping[str, Any], flat: FlatStep) -> tuple[dict[int, set[int]], dict[str, list[tuple[int, int]]]]:
    """The primal dimensions a symbolic trace makes dynamic.

    Returns:
        ``(flat index -> dynamic dims, name -> [(flat index, dim)])``.

    Raises:
        ValueError: an entry names no tensor input, no dimension of it, or a dimension
            whose example size is below 2.
    """
    dims_of_symbol: dict[str, list[tuple[int, int]]] = {}
    dynamic: dict[int, set[int]] = {}
    arg_spec, kwarg_spec = flat.arg_spec, flat.kwarg_spec
    for name, entries in symbols.items():
        if isinstance(entries, tuple) and len(entries) == 2 and isinstance(entries[1], int):
            entries = [entries]
        dims_of_symbol[name] = []
        for key, dim in entries:
            spec = arg_spec[key] if isinstance(key, int) and 0 <= key < len(arg_spec) else (
                kwarg_spec.get(key) if isinstance(key, str) else None
            )
            if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "__tensor__"):
                raise ValueError(
                    f"symbol {name!r}: {key!r} is not a tensor input; tensor inputs are "
                    f"positions {[i for i, a in enumerate(arg_spec) if isinstance(a, tuple)]} "
                    f"and keywords {[k for k, a in kwarg_spec.items() if isinstance(a, tuple)]}"
                )
            flat_index = flat.num_params_buffers + spec[1]
            value = flat.primal_values[flat_index]
            if not 0 <= dim < value.dim():
                raise ValueError(
                    f"symbol {name!r}: input {key!r} has {value.dim()} dimensions, no dimension {dim}"
                )
            if value.shape[dim] < 2:
                raise ValueError(
                    f"symbol {name!r}: the example size of input {key!r} dimension {dim} is "
                    f"{value.shape[dim]}; symbolic sizes need an example size >= 2"
                )
            dims_of_symbol[name].append((flat_index, dim))
            dynamic.setdefault(flat_index, set()).add(dim)
    return dynamic, dims_of_symbol


def symbolic_context(value: torch.Tensor, dims: set[int]) -> StatelessSymbolicContext:
    """The context that makes dimensions ``dims`` of ``value`` fresh symbols."""
    return StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(value.dim())]
    )


def _symbolic_fakes(mode: FakeTensorMode, primal_values: Sequence[torch.Tensor],
                    dynamic: Mapping[int, set[int]]) -> list[Any]:
    """Fake primals for a symbolic trace: parameters and buffers static, the named input
    dimensions dynamic (one fresh symbol each; AOTAutograd's guards unify the dimensions
    of one name)."""
    fakes: list[Any] = []
    memo: dict[int, Any] = {}
    for i, v in enumerate(primal_values):
        if i in dynamic:
            fake = memo[id(v)] if id(v) in memo else mode.from_tensor(
                v, symbolic_context=symbolic_context(v, dynamic[i]))
        else:
            fake = mode.from_tensor(v, static_shapes=True)
        memo.setdefault(id(v), fake)
        fakes.append(fake)
    return fakes


def symbolic_trace_values(flat: FlatStep, symbols: Mapping[str, Any] | None
                          ) -> tuple[list[Any], dict[str, list[tuple[int, int]]], Any]:
    """The values ``trace.trace_joint`` traces the primals of ``flat`` with.

    Args:
        flat: the flattened step.
        symbols: the input dimensions to name (see ``trace.trace_joint``); None or
            empty for concrete shapes.

    Returns:
        ``(trace_values, dims_of_symbol, shape_env)``: for concrete shapes the primal
        values themselves, ``{}`` and None; else fakes of a new ShapeEnv whose named
        input dimensions are dynamic (``dynamic_dims``), the named dimensions and
        that ShapeEnv.

    Raises:
        ValueError: a ``symbols`` entry names no tensor input or dimension (see
            ``dynamic_dims``).
    """
    if not symbols:
        return list(flat.primal_values), {}, None
    dynamic, dims_of_symbol = dynamic_dims(symbols, flat)
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    return _symbolic_fakes(mode, flat.primal_values, dynamic), dims_of_symbol, shape_env
