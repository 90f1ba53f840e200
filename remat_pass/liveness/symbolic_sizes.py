"""Sizes as polynomials: the SymInt / sympy sizes of a symbolic trace as
``solvers.poly.Poly`` over the user's named symbols (``batch``, ``seq``), and a joint
graph with its size computations inlined so that only tensor ops remain."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import sympy
import torch
import torch.fx as fx

from solvers.poly import Poly

from ..errors import RematError
from ..graph.trace import JointGraph


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
