"""Megatron-LM's full-recompute peaks in closed form (sympy), from per-layer terms.

For a stack of L layers that are all alike, the chain model of ``solvers.chain`` has a
closed form in K (``--recompute-method uniform --recompute-num-layers K``) or N
(``--recompute-method block --recompute-num-layers N``). The terms are read off a graph
by the caller (``remat_pass.liveness.symbolic``) and may be sympy expressions in shape symbols:

- ``s`` (``checkpoint_bytes``): what a group saves (its output, the next checkpoint, and
  its RNG states),
- ``a`` (``stored_layer_bytes``): what a stored layer saves; also what a rebuilt layer
  keeps live under the backward of the next layer of its group,
- ``g`` (``param_grad_bytes``): a layer's parameter gradients, live from its backward to
  the end of the step,
- ``w`` / ``v``: the backward peak of the top layer rebuilt / stored, above what the
  layers below saved; ``h``: the head (final norm, logits, loss) above everything
  saved; ``o``: the rest of the outer region.

With ``G = ceil(L/K)``:

- ``peak_uniform = Max((K-1)·a + w + (L-K)·g, (G-1)·s + (K-1)·a + w, G·s + h, o)``:
  the lowest group (all gradients above it live) and the top group (every checkpoint
  below it live); exact when K divides L.
- ``peak_block = Max(w + (L-1)·g, (N-1)·s + w + (L-N)·g, N·s + v + (L-1-N)·g,
  N·s + (L-1-N)·a + v, N·s + (L-N)·a + h, o)``.
- ``K* = sqrt(L·s / a)``, where ``L·s/K + K·a`` is least over continuous K (Chen et al.
  2016, "Training deep nets with sublinear memory cost", sqrt(n) checkpointing).
"""

from __future__ import annotations

import dataclasses

import sympy

K, N, L = sympy.symbols("K N L", positive=True, integer=True)
S, A, G = sympy.symbols("s a g", positive=True)
W, V, H, O = sympy.symbols("w v h o", positive=True)


@dataclasses.dataclass(frozen=True)
class ClosedForms:
    """The closed forms and the terms they are written in (all in bytes).

    Attributes:
        checkpoint_bytes, stored_layer_bytes, param_grad_bytes: s, a, g (expressions in
            the shape symbols).
        rebuilt_backward_peak_bytes, stored_backward_peak_bytes, head_peak_bytes,
            outer_peak_bytes: w, v, h, o as expressions (each may be a Max).
        peak_uniform: in K, L and the symbols w, v, h, o (s, a, g substituted).
        peak_block: in N, L and the symbols w, v, h, o.
        k_star: ``sqrt(L·s/a)`` in L and the shape symbols.
    """

    checkpoint_bytes: sympy.Expr
    stored_layer_bytes: sympy.Expr
    param_grad_bytes: sympy.Expr
    rebuilt_backward_peak_bytes: sympy.Expr
    stored_backward_peak_bytes: sympy.Expr
    head_peak_bytes: sympy.Expr
    outer_peak_bytes: sympy.Expr
    peak_uniform: sympy.Expr
    peak_block: sympy.Expr
    k_star: sympy.Expr

    @property
    def region_peaks(self) -> dict[sympy.Symbol, sympy.Expr]:
        """``{w, v, h, o}`` (the symbols in the peak formulas) -> their expressions."""
        return {W: self.rebuilt_backward_peak_bytes, V: self.stored_backward_peak_bytes,
                H: self.head_peak_bytes, O: self.outer_peak_bytes}

    def evaluate(self, formula: sympy.Expr, at: dict[sympy.Symbol, int], **knobs: int) -> int:
        """``formula`` (``peak_uniform`` or ``peak_block``) at shape values ``at`` and
        ``K`` / ``N`` / ``L`` given as keywords, in bytes."""
        region = {sym: ex.xreplace(at) for sym, ex in self.region_peaks.items()}
        names = {"K": K, "N": N, "L": L}
        return int(formula.xreplace(at).xreplace(region).xreplace({names[k]: v for k, v in knobs.items()}))


def megatron_closed_forms(
    checkpoint_bytes: sympy.Expr,
    stored_layer_bytes: sympy.Expr,
    param_grad_bytes: sympy.Expr,
    rebuilt_backward_peak_bytes: sympy.Expr,
    stored_backward_peak_bytes: sympy.Expr,
    head_peak_bytes: sympy.Expr,
    outer_peak_bytes: sympy.Expr,
) -> ClosedForms:
    """The uniform / block peaks and K* from the terms (see the module docstring).

    Example:
        >>> cf = megatron_closed_forms(1, 37, 2, 50, 60, 80, 10)
        >>> cf.evaluate(cf.peak_uniform, {}, K=1, L=12), cf.evaluate(cf.peak_uniform, {}, K=2, L=12)
        (92, 107)
    """
    s, a, g, w, v, h, o = map(sympy.sympify, (
        checkpoint_bytes, stored_layer_bytes, param_grad_bytes, rebuilt_backward_peak_bytes,
        stored_backward_peak_bytes, head_peak_bytes, outer_peak_bytes))
    groups = sympy.ceiling(L / K)
    peak_uniform = sympy.Max((K - 1) * a + W + (L - K) * g, (groups - 1) * s + (K - 1) * a + W,
                             groups * s + H, O, evaluate=False)
    peak_block = sympy.Max(W + (L - 1) * g, (N - 1) * s + W + (L - N) * g, N * s + V + (L - 1 - N) * g,
                           N * s + (L - 1 - N) * a + V, N * s + (L - N) * a + H, O, evaluate=False)
    return ClosedForms(
        checkpoint_bytes=s, stored_layer_bytes=a, param_grad_bytes=g,
        rebuilt_backward_peak_bytes=w, stored_backward_peak_bytes=v, head_peak_bytes=h,
        outer_peak_bytes=o,
        peak_uniform=peak_uniform, peak_block=peak_block,
        k_star=sympy.sqrt(L * s / a),
    )
