"""Symbolic sizes: the SymInt / sympy sizes of a symbolic trace as ``solvers.poly.Poly``
over the user's named symbols (``batch``, ``seq``), a joint graph with its size
computations inlined so that only tensor ops remain, and the concrete value of a
symbolic size: at the compile-time example (``size_hint``, ``concrete_step``) or at the
shapes of a step that ran (``symbol_sources``, ``shape_hints``, ``symbolic_size``,
``evaluate_size``; the torch.compile backend's sizes under dynamic shapes)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from solvers.poly import Poly

from ..errors import RematError
from ..graph.trace import JointGraph
from ..recompute.rewrite import RewrittenStep


class SizeConverter:
    """SymInt / int / sympy size -> ``Poly`` over the named symbols of one trace.

    Piecewise sizes: a ``Max`` / ``Min`` of sizes (T5's relative-position buckets give
    ``Max(1, seq - 1)``) is the argument that is largest (smallest) over every value the
    symbols may take, i.e. at or above each symbol's lower bound in the shape
    environment (2 for a dynamic dimension: AOTAutograd specializes 0 and 1): ``seq - 1``
    here. A ``Max`` whose arguments cross inside that range has no one polynomial and is
    refused.

    Args:
        joint: the traced step; ``joint.symbols`` names the symbols (``batch`` ->
            AOTAutograd's ``s0``...), ``joint.shape_env`` resolves their relations.

    Raises (when called):
        RematError: the size depends on a symbol that has no name, or is a Max / Min
            whose arguments are not ordered over the symbols' range.
    """

    def __init__(self, joint: JointGraph):
        self.gens = tuple(joint.symbols)
        self.named = {name: sympy.Symbol(name, positive=True, integer=True) for name in self.gens}
        self.to_name = {
            internal: self.named[name]
            for name, internals in joint.symbols.items()
            for internal in internals
        }
        self.shape_env = joint.shape_env
        self.cache: dict[Any, Poly] = {}
        ranges = getattr(self.shape_env, "var_to_range", {}) or {}
        lower = {name: max([1, *(int(ranges[s].lower) for s in internals
                                 if s in ranges and ranges[s].lower.is_finite)])
                 for name, internals in joint.symbols.items()}
        # symbol = lower bound + t, t >= 0: a polynomial in t with no negative
        # coefficient is >= 0 over the whole range
        self._shifted = {self.named[g]: lower[g] + sympy.Symbol(f"_{g}_above", nonnegative=True)
                         for g in self.gens}

    def __call__(self, value: Any) -> Poly:
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
        elif isinstance(value, (int, sympy.Integer)):
            return Poly.constant(int(value), len(self.gens))
        else:
            expr = value
        if expr in self.cache:
            return self.cache[expr]
        e = expr
        if self.shape_env is not None:
            e = self.shape_env.replace(e)
        e = e.xreplace(self.to_name)
        if any(_minmax_sign(x) for x in sympy.preorder_traversal(e)):
            e = e.replace(lambda x: _minmax_sign(x) != 0, lambda x: self._piece(x, expr))
        e = sympy.expand(e)
        extra = e.free_symbols - set(self.named.values())
        if extra:
            raise RematError(
                f"size {expr} depends on {sorted(map(str, extra))}, which are not among the "
                f"named symbols {list(self.gens)}: name every dynamic input dimension"
            )
        if self.gens:
            terms = sympy.Poly(e, *[self.named[g] for g in self.gens]).as_dict()
            out = Poly({tuple(int(x) for x in k): int(v) for k, v in terms.items()})
        else:
            out = Poly.constant(int(e), 0)
        self.cache[expr] = out
        return out

    def _piece(self, piecewise: sympy.Expr, size: Any) -> sympy.Expr:
        """The argument of a Max (Min) that is >= (<=) every other one over the range."""
        sign = _minmax_sign(piecewise)
        for a in piecewise.args:
            if all(self._nonnegative(sign * (a - b)) for b in piecewise.args if b is not a):
                return a
        raise RematError(
            f"size {size} is piecewise: {piecewise} has no argument that is the "
            f"{'largest' if sign > 0 else 'smallest'} for every value of {list(self.gens)} the trace "
            "allows, so it is no one polynomial; trace with concrete shapes (no symbols), or name "
            "only the dimensions it does not depend on"
        )

    def _nonnegative(self, diff: sympy.Expr) -> bool:
        """Whether ``diff`` (in the named symbols) is >= 0 wherever the symbols may be."""
        d = sympy.expand(diff.xreplace(self._shifted))
        if d.is_number:
            return bool(d >= 0)
        try:
            coeffs = sympy.Poly(d, *sorted(d.free_symbols, key=str)).coeffs()
        except sympy.PolynomialError:
            return False
        return all(c.is_number and c >= 0 for c in coeffs)

    def sympy(self, p: Poly) -> sympy.Expr:
        """``p`` as a sympy expression in the named symbols."""
        return sum(
            (sympy.Integer(c) * sympy.Mul(*[self.named[g] ** e for g, e in zip(self.gens, k)])
             for k, c in p.sort_key()),
            sympy.Integer(0),
        )


def _minmax_sign(e: Any) -> int:
    """1 for a Max, -1 for a Min (sympy's, or torch's own ``torch.utils._sympy``
    classes of those names, which are no sympy.Max), 0 otherwise."""
    if isinstance(e, sympy.Max) or (isinstance(e, sympy.Basic) and type(e).__name__ == "Max"):
        return 1
    if isinstance(e, sympy.Min) or (isinstance(e, sympy.Basic) and type(e).__name__ == "Min"):
        return -1
    return 0


def inline_sizes(joint: JointGraph) -> JointGraph:
    """A copy of a symbolic joint graph whose size computations are inlined.

    AOTAutograd computes sizes in the graph (``sym_size(view_50, 1)``, ``mul`` of
    sizes), also in backward, reading them off activations. For the pass they are not
    data: liveness would keep an activation alive for its shape alone, and the rewrite
    would save, recompute or move a recompute segment for a size. The concrete trace has
    none of them. Each use of such a node is replaced by its SymInt (``meta["val"]``)
    as a constant argument and the nodes are erased, so the symbolic graph holds the
    same tensor ops, in the same order, as the concrete one. The copy is for analysis
    only (it is never run); ``joint`` is not modified.

    Returns:
        ``joint`` itself when it has no size node, else a JointGraph sharing everything
        but its GraphModule.
    """
    if not any(n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)
               for n in joint.gm.graph.nodes):
        return joint
    graph = fx.Graph()
    out = graph.graph_copy(joint.gm.graph, {})
    graph.output(out)
    size_nodes = [n for n in graph.nodes
                  if n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)]
    for n in size_nodes:
        val = n.meta["val"]
        for user in list(n.users):
            user.args = _replace_arg(user.args, n, val)
            user.kwargs = _replace_arg(user.kwargs, n, val)
    for n in reversed(size_nodes):
        if not n.users:
            graph.erase_node(n)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Raw SymInt value")  # analysis only
        gm = fx.GraphModule(joint.gm, graph)
    return dataclasses.replace(joint, gm=gm)


def _replace_arg(arg: Any, node: Any, value: Any) -> Any:
    if arg is node:
        return value
    if isinstance(arg, tuple):
        return tuple(_replace_arg(a, node, value) for a in arg)
    if isinstance(arg, list):
        return [_replace_arg(a, node, value) for a in arg]
    if isinstance(arg, dict):
        return {k: _replace_arg(v, node, value) for k, v in arg.items()}
    return arg


def is_symbolic_tensor(val: Any) -> bool:
    """Whether ``val`` is a tensor with a symbolic size, stride or offset."""
    return isinstance(val, torch.Tensor) and any(
        not isinstance(d, int) for d in (*val.shape, *val.stride(), val.storage_offset())
    )


def size_hint(x: Any) -> int:
    """The example value of a (possibly symbolic) size; adds no guard."""
    return int(optimization_hint(x, fallback=1))


def concrete_step(step: RewrittenStep) -> tuple[RewrittenStep, bool]:
    """``step`` with symbolic sizes replaced by their hints (meta tensors), aliasing kept.

    Returns ``(step, False)`` unchanged when every size is an int. Adds no guard.
    """
    graphs = (step.forward.graph, step.backward.graph)
    if not any(is_symbolic_tensor(n.meta.get("val")) for g in graphs for n in g.nodes):
        return step, False
    bases: dict[int, torch.Tensor] = {}

    def concrete(val: Any) -> Any:
        if isinstance(val, (tuple, list)):
            return type(val)(concrete(v) for v in val)
        if not isinstance(val, torch.Tensor):
            return val
        storage = val.untyped_storage()
        key = storage._cdata
        if key not in bases:
            bases[key] = torch.empty(size_hint(storage.nbytes()), dtype=torch.uint8, device="meta")
        out = torch.empty((), dtype=val.dtype, device="meta")
        out.set_(
            bases[key].untyped_storage(),
            size_hint(val.storage_offset()),
            [size_hint(d) for d in val.shape],
            [size_hint(s) for s in val.stride()],
        )
        return out

    def copy(gm: fx.GraphModule) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        out = g.graph_copy(gm.graph, env)
        g.output(out)
        for old, new in env.items():
            new.meta = dict(old.meta)
            if "val" in old.meta:
                new.meta["val"] = concrete(old.meta["val"])
        return fx.GraphModule(gm, g, class_name=type(gm).__name__)

    return dataclasses.replace(step, forward=copy(step.forward), backward=copy(step.backward)), True


def symbol_sources(primal_values: Sequence[Any]) -> tuple[tuple[int, int | None, Any], ...]:
    """Where each shape symbol of a graph is read from at run time: ``(input index, dim,
    symbol)`` for a tensor input whose dimension ``dim`` is a plain symbol, ``(input
    index, None, symbol)`` for a SymInt input. Empty for a graph with static shapes."""
    out, seen = [], set()
    for i, v in enumerate(primal_values):
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            cands = [(None, v.node.expr)]
        elif isinstance(v, torch.Tensor):
            cands = [(d, s.node.expr) for d, s in enumerate(v.shape)
                     if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol)]
        else:
            cands = []
        for d, sym in cands:
            if sym not in seen:
                seen.add(sym)
                out.append((i, d, sym))
    return tuple(out)


def symbolic_size(value: Any) -> Any:
    """An int, or the sympy expression of a SymInt (its shape environment's canonical
    form), for sizes evaluated later at the shapes of a step (``evaluate_size``)."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        env = value.node.shape_env
        return env.replace(expr) if env is not None else expr
    return int(value)


def evaluate_size(size: Any, values: dict[Any, int], hints: dict[Any, int] | None = None) -> int:
    """``size`` (an int or a sympy expression of ``symbolic_size``) at the symbol values
    ``values``; symbols not among them take their ``hints`` (the compile-time example).

    Raises:
        ValueError: a symbol has neither a value nor a hint.
    """
    if isinstance(size, int):
        return size
    e = size.xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if e.free_symbols and hints:
        e = e.xreplace({s: sympy.Integer(v) for s, v in hints.items() if s in e.free_symbols})
    if e.free_symbols:
        raise ValueError(f"size {size} depends on {sorted(map(str, e.free_symbols))}, which have no value")
    return int(e)


def shape_hints(joint: JointGraph) -> dict[Any, int]:
    """The example value of every shape symbol of the graph (its compile-time hints:
    the shape environment's ``backed_var_to_val``, or ``var_to_val`` where it has none),
    by sympy Symbol; empty for a graph with static shapes."""
    for v in joint.primal_values:
        env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
        if env is None and isinstance(v, torch.SymInt):
            env = v.node.shape_env
        if env is not None:
            hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
            return {s: int(h) for s, h in hints.items()}
    return {}
