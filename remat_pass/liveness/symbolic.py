"""Symbolic memory model (sympy): peaks and per-layer aggregates in the shape symbols.

How it works (DESIGN.md, Memory accounting / Symbolic shapes):

- ``trace_symbolic`` traces the step with named symbols (``batch``, ``seq``) in place of
  the chosen input dimensions (``trace_joint(..., symbols=...)``); every storage size is
  then a polynomial in the symbols.
- The order of the steps of a rewritten graph and the live intervals
  (``intervals.live_intervals``) do not depend on shapes, only the sizes do. So the live
  bytes at each step are a polynomial, and the peak of a schedule is the ``Max`` over
  the steps of those polynomials. A step whose polynomial is dominated coefficient by
  coefficient by another step's (every symbol is positive) is never the peak and is
  dropped; what remains is a short ``Max``. Substituting values gives exactly the
  concrete liveness peak (``liveness.analyze``, CPU allocator) at those shapes.
- Per-layer aggregates (saved bytes, FLOPs) are read off the same step polynomials
  (``SymbolicStep``, ``aggregates``).

Polynomials are ``solvers.poly.Poly`` over the symbol names (``symbolic_sizes``
converts the sizes), so a concrete trace (no symbols) uses the same code with constant
polynomials. The planner's chain model is calibrated from these profiles, and put in
closed form in K / N, by ``plan.chain_calibration``; the planner that solves for
schedules is ``plan.planner``.

Ignored: the CUDA allocator's rounding (sizes are exact bytes, as the ``cpu``
allocator of ``liveness``), and everything ``liveness`` ignores.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.fx as fx

from solvers.poly import Poly, max_value, pareto_max

from ..recompute import schedule as schedules
from ..graph.costs import node_flops, storage_nbytes, transient_bytes
from ..graph.fake_trace import has_no_data, trace_joint_fake
from .intervals import live_intervals
from .timeline import live_timeline
from ..graph.regions import LayerStack, assign_layers
from ..recompute.rewrite import RewrittenStep, rewrite
from ..recompute.schedule import Schedule
from .symbolic_sizes import SizeConverter, inline_sizes
from ..graph.trace import JointGraph, trace_joint


# --------------------------------------------------------------------------- step profiles


@dataclasses.dataclass
class SymbolicStep:
    """Live bytes of a rewritten step at every step, as polynomials.

    Attributes:
        gens: the symbol names, in the order of the exponent tuples.
        phases, nodes, layers, kinds: per step (forward then backward).
        live: live activation bytes per step (``liveness.live_timeline``).
        saved_by_layer: bytes forward saves for backward, per layer (None: outer).
        recompute_flops_by_layer: FLOPs of the recompute nodes, per layer.
        forward_flops_by_layer: FLOPs of the forward nodes, per layer.
    """

    gens: tuple[str, ...]
    phases: list[str]
    nodes: list[str]
    layers: list[int | None]
    kinds: list[str]
    live: list[Poly]
    saved_by_layer: dict[int | None, Poly]
    recompute_flops_by_layer: dict[int | None, Poly]
    forward_flops_by_layer: dict[int | None, Poly]

    def peak(self) -> list[Poly]:
        """The peak as the non-dominated step polynomials (their Max)."""
        return pareto_max(self.live)


def _flops_by_layer(step: RewrittenStep, nodes: Sequence[fx.Node], conv: SizeConverter,
                    keep: Callable[[fx.Node], bool]) -> dict[int | None, Poly]:
    out: dict[int | None, Poly] = {}
    for node in nodes:
        if keep(node):
            f = conv(node_flops(node))
            if f:
                layer = step.layer_of.get(node.name)
                out[layer] = out.get(layer, Poly()) + f
    return out


def profile_step(step: RewrittenStep, conv: SizeConverter) -> SymbolicStep:
    """Live bytes at every step of ``step`` as polynomials: ``intervals.live_intervals``
    and ``live_timeline`` with sizes and scratch converted by ``conv`` (the CPU
    allocator's exact bytes, as ``liveness.analyze(step, "cpu")``)."""
    iv = live_intervals(step, lambda v: conv(storage_nbytes(v)), lambda n: conv(transient_bytes(n)))
    live = live_timeline(iv, zero=Poly())
    saved_by_layer: dict[int | None, Poly] = {}
    for sid in sorted({s for s in iv.saved_sids if isinstance(s, int) and not iv.storages[s].static}):
        st = iv.storages[sid]
        saved_by_layer[st.layer] = saved_by_layer.get(st.layer, Poly()) + st.nbytes
    steps = iv.steps
    nf = len(iv.fw_steps)
    return SymbolicStep(
        gens=conv.gens,
        phases=["forward" if i < nf else "backward" for i in range(len(steps))],
        nodes=[x.name for x in steps],
        layers=[step.layer_of.get(x.name) for x in steps],
        kinds=[step.kind_of.get(x.name, "forward") for x in steps],
        live=live,
        saved_by_layer=saved_by_layer,
        recompute_flops_by_layer=_flops_by_layer(
            step, iv.bw_steps, conv, lambda n: step.kind_of.get(n.name) == "recompute"),
        forward_flops_by_layer=_flops_by_layer(step, iv.fw_steps, conv, lambda n: True),
    )


# --------------------------------------------------------------------------- the model


@dataclasses.dataclass
class SymbolicModel:
    """A traced step whose sizes are polynomials in named symbols.

    Build with ``trace_symbolic`` (symbolic shapes) or ``from_joint`` (any JointGraph; a
    concrete one gives constant polynomials). Profiles of schedules are cached.

    Attributes:
        joint, stack: the traced step (size computations inlined) and its layer stack.
        hints: the example value of each symbol (the shapes traced with).
    """

    joint: JointGraph
    stack: LayerStack
    hints: dict[str, int]
    _conv: SizeConverter = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]
    _profiles: dict[Schedule, SymbolicStep] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_joint(cls, joint: JointGraph, stack: LayerStack | None = None,
                   layers: str | Sequence[str] | None = None) -> "SymbolicModel":
        """Wrap a traced step (``stack`` found with ``assign_layers`` when None)."""
        joint = inline_sizes(joint)
        stack = stack or assign_layers(joint, layers)
        hints = {}
        if joint.shape_env is not None:
            env = joint.shape_env
            values = getattr(env, "backed_var_to_val", None) or env.var_to_val
            for name, syms in joint.symbols.items():
                hints[name] = int(values[syms[0]])
        return cls(joint, stack, hints, SizeConverter(joint))

    @property
    def gens(self) -> tuple[str, ...]:
        """The symbol names (``("batch", "seq")``)."""
        return self._conv.gens

    @property
    def num_layers(self) -> int:
        """L."""
        return self.stack.num_layers

    @property
    def layers_per_stack(self) -> tuple[int, ...]:
        """L of each layer stack in chain order (``LayerStack.layers_per_stack``)."""
        return self.stack.layers_per_stack

    def symbol(self, name: str) -> sympy.Symbol:
        """The sympy Symbol (positive integer) called ``name``."""
        return self._conv.named[name]

    def to_sympy(self, p: Poly) -> sympy.Expr:
        """A Poly as a sympy expression in the named symbols."""
        return self._conv.sympy(p)

    def max_sympy(self, polys: Sequence[Poly]) -> sympy.Expr:
        """The Max of polynomials as a sympy expression (0 for none)."""
        exprs = [self.to_sympy(p) for p in polys]
        return sympy.Max(*exprs, evaluate=False) if len(exprs) > 1 else (exprs[0] if exprs else sympy.Integer(0))

    def profile(self, schedule: Schedule) -> SymbolicStep:
        """Rewrite under ``schedule`` and profile it (cached)."""
        if schedule not in self._profiles:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Raw SymInt value")  # inlined sizes
                step = rewrite(self.joint, self.stack, schedule)
            self._profiles[schedule] = profile_step(step, self._conv)
        return self._profiles[schedule]

    def peak(self, schedule: Schedule) -> sympy.Expr:
        """Peak activation bytes of ``schedule`` as a sympy expression (a Max of
        polynomials in the symbols). ``.subs`` of concrete values gives exactly
        ``analyze(rewrite(concrete trace, ...)).peak_bytes`` at those shapes."""
        return self.max_sympy(self.profile(schedule).peak())

    def peak_at(self, schedule: Schedule, **values: int) -> int:
        """The peak in bytes at concrete symbol values (every symbol must be given).

        Raises:
            ValueError: a symbol has no value.
        """
        return max_value(self.profile(schedule).peak(), self.symbol_values(values))

    def symbol_values(self, values: Mapping[str, int]) -> list[int]:
        """The values of ``gens`` in order, from a mapping of symbol names (ints).

        Raises:
            ValueError: a symbol has no value.
        """
        missing = [g for g in self.gens if g not in values]
        if missing:
            raise ValueError(f"give a value for every symbol; missing {missing} (symbols: {list(self.gens)})")
        return [int(values[g]) for g in self.gens]

    # ---------------------------------------------------------------- aggregates

    def aggregates(self) -> dict[str, Any]:
        """Per-layer aggregates read off the graph, each a sympy polynomial (bytes or
        FLOPs):

        - ``checkpoint_bytes``: bytes a layer saves as a group of one (uniform(1)),
        - ``stored_layer_bytes``: bytes a layer saves when stored (``none``),
        - ``forward_flops``: forward FLOPs of each layer,
        - ``recompute_flops``: FLOPs recomputing a layer alone costs (uniform(1)),

        each a list over the layers, and ``outer_saved_bytes``: bytes the outer region
        saves (embedding, head, loss), one expression.
        """
        L, per_stack = self.num_layers, self.layers_per_stack
        none = self.profile(schedules.none(per_stack))
        u1 = self.profile(schedules.uniform(1, per_stack))
        return {
            "checkpoint_bytes": [self.to_sympy(u1.saved_by_layer.get(i, Poly())) for i in range(L)],
            "stored_layer_bytes": [self.to_sympy(none.saved_by_layer.get(i, Poly())) for i in range(L)],
            "outer_saved_bytes": self.to_sympy(none.saved_by_layer.get(None, Poly())),
            "forward_flops": [self.to_sympy(none.forward_flops_by_layer.get(i, Poly())) for i in range(L)],
            "recompute_flops": [self.to_sympy(u1.recompute_flops_by_layer.get(i, Poly())) for i in range(L)],
        }

    # ---------------------------------------------------------------- budgets

    def largest_fitting(self, schedule: Schedule, budget_bytes: int, symbol: str,
                        limit: int = 1 << 20, **fixed: int) -> int:
        """The largest value of ``symbol`` (e.g. batch) whose exact peak under
        ``schedule`` is <= ``budget_bytes``, the other symbols held at ``fixed``.

        The peak is a Max of polynomials; it is found by doubling and bisection on exact
        integer evaluation (the live bytes never fall when a shape grows).

        Returns:
            That value, 0 when even 1 does not fit, ``limit`` when ``limit`` fits.
        """
        terms = self.profile(schedule).peak()

        def fits(x: int) -> bool:
            return max_value(terms, self.symbol_values({**fixed, symbol: x})) <= budget_bytes

        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        if hi > limit:
            return limit if fits(limit) else _bisect(fits, lo, limit)
        return _bisect(fits, lo, hi)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest x in [lo, hi) with fits(x), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def trace_symbolic(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Any = None,
    symbols: Mapping[str, Any] | None = None,
    layers: str | Sequence[str] | None = None,
) -> SymbolicModel:
    """Trace with named shape symbols and wrap the result (see ``trace_joint``).

    Args:
        model, example_inputs, loss_fn: as ``trace_joint``.
        symbols: input dimensions to name, e.g. ``{"batch": [("input_ids", 0),
            ("labels", 0)], "seq": [("input_ids", 1), ("labels", 1)]}``.
        layers: module path of the layer stack, or paths of several (found
            automatically when None).

    A model without weights (meta or fake tensors) is traced with
    ``fake_trace.trace_joint_fake``.

    Raises:
        UnsupportedGraph: the model specializes a named size (see ``trace_joint``).
    """
    if has_no_data(model, example_inputs):
        joint = trace_joint_fake(model, example_inputs, loss_fn, symbols=symbols)
    else:
        joint = trace_joint(model, example_inputs, loss_fn, symbols=symbols)
    return SymbolicModel.from_joint(joint, layers=layers)


def default_symbols(example_inputs: Any) -> dict[str, list[tuple[Any, int]]]:
    """``batch`` = dimension 0 and ``seq`` = dimension 1 of every tensor input with two or
    more dimensions (``batch`` only for 1-D inputs)."""
    if isinstance(example_inputs, torch.Tensor):
        items: list[tuple[Any, Any]] = [(0, example_inputs)]
    elif isinstance(example_inputs, dict):
        items = list(example_inputs.items())
    else:
        items = list(enumerate(example_inputs))
    out: dict[str, list[tuple[Any, int]]] = {"batch": [], "seq": []}
    for key, v in items:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            out["batch"].append((key, 0))
            if v.dim() >= 2:
                out["seq"].append((key, 1))
    return {k: v for k, v in out.items() if v}
