"""Symbolic memory model (sympy): peaks, per-layer aggregates and closed forms in the
shape symbols, plus the optimized schedule under a peak budget.

How it works (DESIGN.md, Memory accounting / Symbolic shapes):

- ``trace_symbolic`` traces the step with named symbols (``batch``, ``seq``) in place of
  the chosen input dimensions (``trace_joint(..., symbols=...)``); every storage size is
  then a polynomial in the symbols.
- The order of the steps of a rewritten graph and the live intervals
  (``liveness.live_intervals``) do not depend on shapes, only the sizes do. So the live
  bytes at each step are a polynomial, and the peak of a schedule is the ``Max`` over
  the steps of those polynomials. A step whose polynomial is dominated coefficient by
  coefficient by another step's (every symbol is positive) is never the peak and is
  dropped; what remains is a short ``Max``. Substituting values gives exactly the
  concrete liveness peak (``liveness.analyze``, CPU allocator) at those shapes.
- Per-layer aggregates (saved bytes, forward FLOPs, region peaks) are read off the same
  step polynomials; ``chain_costs`` turns them into the chain model of
  ``solvers.chain`` (evaluated at concrete shapes for the solver), and ``closed_forms``
  into formulas in K / N and the shape symbols.

Polynomials are kept as ``{exponent tuple: int coefficient}`` over the symbol names, so
a concrete trace (no symbols) uses the same code with constant polynomials.

Ignored: the CUDA allocator's rounding (sizes are exact bytes, as the ``cpu``
allocator of ``liveness``), and everything ``liveness`` ignores.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

import sympy
import torch

from . import schedule as schedules
from .costs import node_flops, storage_nbytes, transient_bytes
from .errors import InfeasibleBudget, RematError
from .gate import parse_bytes  # noqa: F401  (one budget grammar for every command)
from .liveness import live_intervals
from .regions import LayerStack, assign_layers
from .rewrite import RewrittenStep, rewrite
from .schedule import Schedule
from .trace import JointGraph, trace_joint

Poly = dict  # {exponents tuple: int coefficient}

# --------------------------------------------------------------------------- polynomials


def _padd(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
        if out[k] == 0:
            del out[k]
    return out


def _dominates(a: Poly, b: Poly) -> bool:
    """a >= b for every positive value of the symbols (coefficient by coefficient)."""
    return all(a.get(k, 0) >= v for k, v in b.items()) and all(
        v >= 0 for k, v in a.items() if k not in b
    )


def pareto_max(polys: Iterable[Poly]) -> list[Poly]:
    """The polynomials not dominated by another: their Max equals the Max of all of them
    for every positive value of the symbols. Sorted deterministically."""
    uniq = {tuple(sorted(p.items())): p for p in polys}
    cands = sorted(uniq.values(), key=lambda p: (-sum(p.values()), sorted(p.items())))
    kept: list[Poly] = []
    for p in cands:
        if not any(_dominates(k, p) for k in kept):
            kept = [k for k in kept if not _dominates(p, k)] + [p]
    return sorted(kept, key=lambda p: sorted(p.items()))


def _peval(p: Poly, values: Sequence[int]) -> int:
    return sum(c * math.prod(v**e for v, e in zip(values, k)) for k, c in p.items())


# --------------------------------------------------------------------------- tracing


@dataclasses.dataclass
class SymbolicStep:
    """Live bytes of a rewritten step at every step, as polynomials.

    Attributes:
        gens: the symbol names, in the order of the exponent tuples.
        phases, nodes, layers, kinds: per step (forward then backward).
        live: live activation bytes per step (a Poly).
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


class _Converter:
    """SymInt / int / sympy -> Poly over the named symbols of one trace."""

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

    def __call__(self, value: Any) -> Poly:
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
        elif isinstance(value, (int, sympy.Integer)):
            v = int(value)
            return {(0,) * len(self.gens): v} if v else {}
        else:
            expr = value
        if expr in self.cache:
            return self.cache[expr]
        e = expr
        if self.shape_env is not None:
            e = self.shape_env.replace(e)
        e = sympy.expand(e.xreplace(self.to_name))
        extra = e.free_symbols - set(self.named.values())
        if extra:
            raise RematError(
                f"size {expr} depends on {sorted(map(str, extra))}, which are not among the "
                f"named symbols {list(self.gens)}: name every dynamic input dimension"
            )
        if self.gens:
            poly = sympy.Poly(e, *[self.named[g] for g in self.gens]).as_dict()
            out = {tuple(int(x) for x in k): int(v) for k, v in poly.items() if v}
        else:
            out = {(): int(e)} if int(e) else {}
        self.cache[expr] = out
        return out

    def sympy(self, p: Poly) -> sympy.Expr:
        return sum(
            (sympy.Integer(c) * sympy.Mul(*[self.named[g] ** e for g, e in zip(self.gens, k)])
             for k, c in sorted(p.items())),
            sympy.Integer(0),
        )


def profile_step(step: RewrittenStep, conv: _Converter) -> SymbolicStep:
    """Live bytes at every step of ``step`` as polynomials (``liveness.live_intervals``
    with sizes converted by ``conv``)."""
    iv = live_intervals(step, lambda v: conv(storage_nbytes(v)))
    all_steps = iv.fw_steps + iv.bw_steps
    n = len(all_steps)
    delta: list[Poly] = [dict() for _ in range(n + 1)]
    for s in iv.storages:
        if s.static or not s.nbytes:
            continue
        delta[s.first] = _padd(delta[s.first], s.nbytes)
        delta[s.last + 1] = _padd(delta[s.last + 1], s.nbytes, -1)
    for i, node in enumerate(all_steps):
        scratch = conv(transient_bytes(node))
        if scratch:  # live during this op only (liveness.analyze, cpu allocator)
            delta[i] = _padd(delta[i], scratch)
            delta[i + 1] = _padd(delta[i + 1], scratch, -1)
    live: list[Poly] = []
    cur: Poly = {}
    for i in range(n):
        cur = _padd(cur, delta[i])
        live.append(cur)
    saved_by_layer: dict[int | None, Poly] = {}
    seen: set[int] = set()
    for sid in iv.saved_sids:
        if isinstance(sid, int) and sid not in seen and not iv.storages[sid].static:
            seen.add(sid)
            st = iv.storages[sid]
            saved_by_layer[st.layer] = _padd(saved_by_layer.get(st.layer, {}), st.nbytes)
    rec: dict[int | None, Poly] = {}
    fwd: dict[int | None, Poly] = {}
    for node in iv.fw_steps:
        f = conv(node_flops(node))
        if f:
            lay = step.layer_of.get(node.name)
            fwd[lay] = _padd(fwd.get(lay, {}), f)
    for node in iv.bw_steps:
        if step.kind_of.get(node.name) == "recompute":
            f = conv(node_flops(node))
            if f:
                lay = step.layer_of.get(node.name)
                rec[lay] = _padd(rec.get(lay, {}), f)
    nf = len(iv.fw_steps)
    return SymbolicStep(
        gens=conv.gens,
        phases=["forward" if i < nf else "backward" for i in range(n)],
        nodes=[x.name for x in all_steps],
        layers=[step.layer_of.get(x.name) for x in all_steps],
        kinds=[step.kind_of.get(x.name, "forward") for x in all_steps],
        live=live,
        saved_by_layer=saved_by_layer,
        recompute_flops_by_layer=rec,
        forward_flops_by_layer=fwd,
    )


@dataclasses.dataclass
class SymbolicModel:
    """A traced step whose sizes are polynomials in named symbols.

    Build with ``trace_symbolic`` (symbolic shapes) or ``from_joint`` (any JointGraph; a
    concrete one gives constant polynomials). Profiles of schedules are cached.

    Attributes:
        joint, stack: the traced step and its layer stack.
        hints: the example value of each symbol (the shapes traced with).
    """

    joint: JointGraph
    stack: LayerStack
    hints: dict[str, int]
    _conv: _Converter = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]
    _profiles: dict[Schedule, SymbolicStep] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_joint(cls, joint: JointGraph, stack: LayerStack | None = None,
                   layers: str | None = None) -> "SymbolicModel":
        """Wrap a traced step (``stack`` found with ``assign_layers`` when None)."""
        if joint.shape_env is not None:
            _inline_sizes(joint)
        stack = stack or assign_layers(joint, layers)
        hints = {}
        if joint.shape_env is not None:
            env = joint.shape_env
            values = getattr(env, "backed_var_to_val", None) or env.var_to_val
            for name, syms in joint.symbols.items():
                hints[name] = int(values[syms[0]])
        return cls(joint, stack, hints, _Converter(joint))

    @property
    def gens(self) -> tuple[str, ...]:
        """The symbol names (``("batch", "seq")``)."""
        return self._conv.gens

    @property
    def num_layers(self) -> int:
        """L."""
        return self.stack.num_layers

    def symbol(self, name: str) -> sympy.Symbol:
        """The sympy Symbol (positive integer) called ``name``."""
        return self._conv.named[name]

    def to_sympy(self, p: Poly) -> sympy.Expr:
        """A Poly as a sympy expression in the named symbols."""
        return self._conv.sympy(p)

    def profile(self, schedule: Schedule) -> SymbolicStep:
        """Rewrite under ``schedule`` and profile it (cached)."""
        if schedule not in self._profiles:
            with warnings.catch_warnings():
                # sizes inlined as SymInt constants (_inline_sizes): analysis only
                warnings.filterwarnings("ignore", message="Raw SymInt value")
                step = rewrite(self.joint, self.stack, schedule)
            self._profiles[schedule] = profile_step(step, self._conv)
        return self._profiles[schedule]

    def peak(self, schedule: Schedule) -> sympy.Expr:
        """Peak activation bytes of ``schedule`` as a sympy expression (a Max of
        polynomials in the symbols). ``.subs`` of concrete values gives exactly
        ``analyze(rewrite(concrete trace, ...)).peak_bytes`` at those shapes."""
        terms = self.profile(schedule).peak()
        exprs = [self.to_sympy(p) for p in terms]
        return sympy.Max(*exprs, evaluate=False) if len(exprs) > 1 else (exprs[0] if exprs else sympy.Integer(0))

    def peak_at(self, schedule: Schedule, **values: int) -> int:
        """The peak in bytes at concrete symbol values (every symbol must be given)."""
        vals = self._values(values)
        return max((_peval(p, vals) for p in self.profile(schedule).peak()), default=0)

    def _values(self, values: Mapping[str, int]) -> list[int]:
        missing = [g for g in self.gens if g not in values]
        if missing:
            raise ValueError(f"give a value for every symbol; missing {missing} (symbols: {list(self.gens)})")
        return [int(values[g]) for g in self.gens]

    # ---------------------------------------------------------------- aggregates

    def aggregates(self) -> dict[str, Any]:
        """Per-layer aggregates read off the graph, each a sympy polynomial:

        - ``s``: bytes a layer saves as a group of one (uniform(1): its checkpoint),
        - ``a``: bytes a layer saves when stored (``none``),
        - ``outer``: bytes the outer region saves (embedding, head, loss),
        - ``forward_flops``: forward FLOPs of each layer,
        - ``recompute_flops``: FLOPs recomputing a layer alone costs (uniform(1)),
        each a list over the layers (``outer`` a single expression).
        """
        L = self.num_layers
        none = self.profile(schedules.none(L))
        u1 = self.profile(schedules.uniform(1, L))
        return {
            "s": [self.to_sympy(u1.saved_by_layer.get(i, {})) for i in range(L)],
            "a": [self.to_sympy(none.saved_by_layer.get(i, {})) for i in range(L)],
            "outer": self.to_sympy(none.saved_by_layer.get(None, {})),
            "forward_flops": [self.to_sympy(none.forward_flops_by_layer.get(i, {})) for i in range(L)],
            "recompute_flops": [self.to_sympy(u1.recompute_flops_by_layer.get(i, {})) for i in range(L)],
        }

    # ---------------------------------------------------------------- chain model

    def chain_polys(self) -> dict[str, Any]:
        """The chain model's costs (``solvers.ChainCosts`` fields) as lists of Pareto
        polynomial sets (a Max) per layer, calibrated from the liveness profiles of
        ``none``, ``uniform(1)`` and ``uniform(L)``. See ``chain_costs``."""
        L = self.num_layers
        none = self.profile(schedules.none(L))
        u1 = self.profile(schedules.uniform(1, L))
        uL = self.profile(schedules.uniform(L, L))
        out: dict[str, Any] = {}
        out["stored_saved_bytes"] = [[none.saved_by_layer.get(i, {})] for i in range(L)]
        out["last_saved_bytes"] = [[u1.saved_by_layer.get(i, {})] for i in range(L)]
        out["member_saved_bytes"] = [[uL.saved_by_layer.get(i, {})] if i < L - 1 else [{}] for i in range(L)]
        out["last_recompute_flops"] = [[u1.recompute_flops_by_layer.get(i, {})] for i in range(L)]
        out["member_recompute_flops"] = [
            [uL.recompute_flops_by_layer.get(i, {})] if i < L - 1 else [{}] for i in range(L)
        ]

        def prefix(prof: SymbolicStep, j: int) -> Poly:
            acc: Poly = {}
            for i in range(j):
                acc = _padd(acc, prof.saved_by_layer.get(i, {}))
            return acc

        def regions(prof: SymbolicStep) -> tuple[dict, dict, list, list]:
            fw: dict[int, list[Poly]] = {}
            bw: dict[int, list[Poly]] = {}
            head: list[Poly] = []
            outer: list[Poly] = []
            first_fw = min((i for i, l in enumerate(prof.layers) if l is not None and prof.phases[i] == "forward"), default=0)
            first_bw = min((i for i, l in enumerate(prof.layers) if l is not None and prof.phases[i] == "backward"), default=len(prof.layers))
            for i, (ph, lay) in enumerate(zip(prof.phases, prof.layers)):
                if lay is not None:
                    (fw if ph == "forward" else bw).setdefault(lay, []).append(prof.live[i])
                elif first_fw < i < first_bw:
                    head.append(prof.live[i])
                else:
                    outer.append(prof.live[i])
            return fw, bw, head, outer

        def above(polys: list[Poly], base: Poly) -> list[Poly]:
            return pareto_max(_padd(p, base, -1) for p in polys)

        n_fw, n_bw, n_head, n_outer = regions(none)
        r_fw, r_bw, _, _ = regions(u1)
        _, l_bw, _, _ = regions(uL)
        out["stored_forward_bytes"] = [above(n_fw.get(j, [{}]), prefix(none, j)) for j in range(L)]
        out["stored_backward_bytes"] = [above(n_bw.get(j, [{}]), prefix(none, j)) for j in range(L)]
        # outer values every group reads (a mask), saved once when any group exists
        shared = _padd(u1.saved_by_layer.get(None, {}), none.saved_by_layer.get(None, {}), -1)
        out["shared_checkpoint_bytes"] = [shared]
        out["recomputed_forward_bytes"] = [
            above(r_fw.get(j, [{}]), _padd(prefix(u1, j), shared)) for j in range(L)
        ]
        # in uniform(1) layer 0 is the lowest group: the shared values die at its recompute
        out["recomputed_backward_bytes"] = [
            above(r_bw.get(j, [{}]), _padd(prefix(u1, j), shared if j else {})) for j in range(L)
        ]
        out["head_bytes"] = above(n_head or [{}], prefix(none, L))
        out["outer_bytes"] = pareto_max(n_outer or [{}])
        out["forward_flops"] = [pareto_max([_padd({}, sum_polys(none.forward_flops_by_layer.values()))])]
        # carry: U_j = (peak of layer j's backward in one group of all layers) - (alone);
        # carry_i = U_{i+1} - U_i, each a Max, so it is evaluated at concrete values.
        out["_uL_backward"] = [l_bw.get(j, [{}]) for j in range(L)]
        return out

    def chain_costs(self, **values: int) -> "Any":
        """``solvers.ChainCosts`` at concrete symbol values (bytes and FLOPs as ints).

        ``carry_bytes[i] = U(i+1) - U(i)`` where ``U(j)`` is the backward peak of layer j
        inside one group of all layers minus its backward peak alone (uniform(1)),
        both above the bytes saved by the layers before; by construction the model
        reproduces ``none``, ``uniform(1)`` and ``uniform(L)``.
        """
        from solvers import ChainCosts

        vals = self._values(values) if self.gens else []
        polys = self.chain_polys()

        def ev(ps: list[Poly]) -> int:
            return max(_peval(p, vals) for p in ps)

        L = self.num_layers
        fields = {}
        for k in ("stored_saved_bytes", "last_saved_bytes", "member_saved_bytes",
                  "stored_forward_bytes", "recomputed_forward_bytes", "stored_backward_bytes",
                  "recomputed_backward_bytes", "last_recompute_flops", "member_recompute_flops"):
            fields[k] = tuple(ev(ps) for ps in polys[k])
        u = [ev(polys["_uL_backward"][j]) - fields["recomputed_backward_bytes"][j] for j in range(L)]
        fields["carry_bytes"] = tuple(u[i + 1] - u[i] if i + 1 < L else 0 for i in range(L))
        return ChainCosts(
            **fields,
            head_bytes=ev(polys["head_bytes"]),
            outer_bytes=ev(polys["outer_bytes"]),
            forward_flops=ev(polys["forward_flops"][0]),
            shared_checkpoint_bytes=ev(polys["shared_checkpoint_bytes"]),
        )

    # ---------------------------------------------------------------- closed forms

    def closed_forms(self, layer: int | None = None) -> dict[str, sympy.Expr]:
        """Closed forms of the chain model for a stack of L layers all like ``layer``
        (default: the middle one), in K, N, L and the shape symbols.

        Terms read off the graph: ``s`` (bytes a group saves: its output, RNG states),
        ``a`` (bytes a stored layer saves; also what a rebuilt layer keeps live under
        the next layer's backward), ``g`` (a layer's parameter-gradient bytes, live from
        its backward to the end), and the region peaks, each a Max of polynomials:
        ``w`` / ``v`` (backward of the top layer rebuilt / stored, above what the layers
        below saved), ``h`` (head above everything saved), ``o`` (rest of the outer
        region). With ``G = ceil(L/K)``:

        - ``peak_uniform = Max((K-1)·a + w + (L-K)·g, (G-1)·s + (K-1)·a + w, G·s + h, o)``
          (the lowest group, where all gradients above are live, and the top group,
          where all checkpoints below are live; exact when K divides L)
        - ``peak_block = Max(w + (L-1)·g, (N-1)·s + w + (L-N)·g, N·s + v + (L-1-N)·g,
          N·s + (L-1-N)·a + v, N·s + (L-N)·a + h, o)``
        - ``K_star = sqrt(L·s / a)``: where ``L·s/K + K·a`` is least (continuous K).

        ``w``, ``v``, ``h``, ``o`` are returned as symbols and, under ``terms``, as
        their Max expressions. The exact peak of one schedule is ``peak(schedule)``.
        """
        L = self.num_layers
        j = L // 2 if layer is None else layer
        polys = self.chain_polys()
        K, N, Ls = sympy.symbols("K N L", positive=True, integer=True)

        def mx(ps: list[Poly]) -> sympy.Expr:
            ex = [self.to_sympy(p) for p in ps]
            return sympy.Max(*ex, evaluate=False) if len(ex) > 1 else ex[0]

        s_ = mx(polys["last_saved_bytes"][j])
        a = mx(polys["stored_saved_bytes"][j])
        prefix = f"{self.stack.path}.{self.stack.child_names[j]}." if self.stack.path else f"{self.stack.child_names[j]}."
        g = sympy.Integer(sum(
            int(v.untyped_storage().nbytes())
            for v, kind, label in zip(self.joint.primal_values, self.joint.primal_kinds, self.joint.primal_labels)
            if kind == "param" and label.startswith(prefix)
        ))
        w, v, h, o = sympy.symbols("w v h o", positive=True)
        terms = {
            w: mx(polys["recomputed_backward_bytes"][L - 1]),
            v: mx(polys["stored_backward_bytes"][L - 1]),
            h: mx(polys["head_bytes"]),
            o: mx(polys["outer_bytes"]),
        }
        G = sympy.ceiling(Ls / K)
        return {
            "s": s_, "a": a, "g": g, "w": w, "v": v, "h": h, "o": o, "terms": terms,
            "peak_uniform": sympy.Max((K - 1) * a + w + (Ls - K) * g, (G - 1) * s_ + (K - 1) * a + w,
                                      G * s_ + h, o, evaluate=False),
            "peak_block": sympy.Max(w + (Ls - 1) * g, (N - 1) * s_ + w + (Ls - N) * g,
                                    N * s_ + v + (Ls - 1 - N) * g, N * s_ + (Ls - 1 - N) * a + v,
                                    N * s_ + (Ls - N) * a + h, o, evaluate=False),
            "K_star": sympy.sqrt(Ls * s_ / a),
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
            vals = self._values({**fixed, symbol: x})
            return max((_peval(p, vals) for p in terms), default=0) <= budget_bytes

        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        if hi > limit:
            return limit if fits(limit) else _bisect(fits, lo, limit)
        return _bisect(fits, lo, hi)


def _inline_sizes(joint: JointGraph) -> int:
    """Replace every size computation of a symbolic joint graph by its value (in place).

    AOTAutograd computes sizes in the graph (``sym_size(view_50, 1)``, ``mul`` of
    sizes), also in backward, reading them off activations. For the pass they are not
    data: liveness would keep an activation alive for its shape alone, and the rewrite
    would save, recompute or move a recompute segment for a size. The concrete trace has
    none of them. Each use of such a node is replaced by its SymInt (``meta["val"]``)
    as a constant argument and the nodes are erased, so the symbolic graph holds the
    same tensor ops, in the same order, as the concrete one. The graph is then for
    analysis only (it is never run).

    Returns:
        The number of size nodes removed.
    """
    graph = joint.gm.graph
    size_nodes = [
        n for n in graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)
    ]
    warnings.filterwarnings("ignore", message="Raw SymInt value")
    for n in size_nodes:
        val = n.meta["val"]
        for user in list(n.users):
            user.args = _replace_arg(user.args, n, val)
            user.kwargs = _replace_arg(user.kwargs, n, val)
    for n in reversed(size_nodes):
        if not n.users:
            graph.erase_node(n)
    return len(size_nodes)


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


def _bisect(fits: Any, lo: int, hi: int) -> int:
    """Largest x in [lo, hi) with fits(x), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def sum_polys(polys: Iterable[Poly]) -> Poly:
    """The sum of polynomials."""
    acc: Poly = {}
    for p in polys:
        acc = _padd(acc, p)
    return acc


def trace_symbolic(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Any = None,
    symbols: Mapping[str, Any] | None = None,
    layers: str | None = None,
) -> SymbolicModel:
    """Trace with named shape symbols and wrap the result (see ``trace_joint``).

    Args:
        model, example_inputs, loss_fn: as ``trace_joint``.
        symbols: input dimensions to name, e.g. ``{"batch": [("input_ids", 0),
            ("labels", 0)], "seq": [("input_ids", 1), ("labels", 1)]}``.
        layers: module path of the layer stack (found automatically when None).

    Raises:
        UnsupportedGraph: the model specializes a named size (see ``trace_joint``).
    """
    joint = trace_joint(model, example_inputs, loss_fn, symbols=symbols)
    return SymbolicModel.from_joint(joint, layers=layers)


# --------------------------------------------------------------------------- planning


@dataclasses.dataclass(frozen=True)
class Plan:
    """The optimized schedule for one peak budget, predicted and checked.

    Attributes:
        budget_bytes: the peak budget asked for.
        schedule: the chosen Schedule (``schedule.optimized``).
        model_peak_bytes: the chain model's peak of that schedule.
        predicted_peak_bytes: liveness (``analyze``) peak of the rewritten step.
        recompute_flops, forward_flops: liveness FLOPs of that step.
        least_feasible_peak_bytes: least liveness peak the solver can reach.
        unconstrained_peak_bytes: liveness peak of ``none``.
        solve_time_s: seconds in the solver (all re-solves included).
        resolves: how many times the budget was tightened because the liveness peak
            of the model's answer exceeded it.
    """

    budget_bytes: int
    schedule: Schedule
    model_peak_bytes: int
    predicted_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    least_feasible_peak_bytes: int
    unconstrained_peak_bytes: int
    solve_time_s: float
    resolves: int

    @property
    def recompute_fraction(self) -> float:
        """Recompute FLOPs / forward FLOPs."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def describe(self) -> str:
        """Groups and stored layers, e.g. ``recompute [0-3] [4-5], store 6 7``."""
        return schedules.describe_groups(self.schedule.groups, self.schedule.num_layers)


class Planner:
    """Solves for optimized schedules of one traced step and checks them with liveness.

    The solver (``solvers.chain``) works on the chain model's costs; the answer is
    rewritten and analysed (``liveness.analyze``), and if its liveness peak exceeds the
    budget, the model budget is lowered by the excess and the solve repeated, so the
    returned schedule's liveness peak is always within the budget. Budgets are served
    from largest to smallest consistently: a schedule that fits a budget is kept for
    smaller budgets it still fits (the measured peak never rises as the budget falls).

    Args:
        session: a ``sweep.Session`` (concrete shapes).
    """

    def __init__(self, session: Any):
        from .liveness import analyze

        self.session = session
        self._analyze = analyze
        self.model = SymbolicModel.from_joint(session.joint, session.stack)
        t0 = time.perf_counter()
        self.costs = self.model.chain_costs()
        self.calibrate_s = time.perf_counter() - t0
        self._reports: dict[Schedule, Any] = {}
        L = self.model.num_layers
        self.unconstrained_peak_bytes = self.report(schedules.none(L)).peak_bytes
        self._least: tuple[Schedule, int] | None = None

    def report(self, schedule: Schedule) -> Any:
        """Liveness report of ``schedule`` (cached)."""
        if schedule not in self._reports:
            self._reports[schedule] = self.session.prepare(schedule)[1]
        return self._reports[schedule]

    def _schedule(self, groups: tuple) -> Schedule:
        return schedules.optimized(groups, self.model.num_layers)

    def least_feasible(self) -> tuple[Schedule, int]:
        """The schedule of least liveness peak the solver finds, and that peak."""
        if self._least is None:
            from solvers import least_feasible_peak, pareto_front

            L = self.model.num_layers
            cands = [least_feasible_peak(self.costs)]
            if L <= 16:  # also the next lowest-peak answers of the front
                cands += pareto_front(self.costs)[-3:]
            best: tuple[Schedule, int] | None = None
            # the lowest-peak model answers, checked with liveness
            for sol in cands:
                sch = self._schedule(sol.groups)
                pk = self.report(sch).peak_bytes
                if best is None or pk < best[1]:
                    best = (sch, pk)
            self._least = best
        return self._least  # type: ignore[return-value]

    def plan(self, budget_bytes: int, max_resolves: int = 20) -> Plan:
        """The least-recompute schedule whose liveness peak is <= ``budget_bytes``.

        Raises:
            InfeasibleBudget: ``budget_bytes`` is below the least feasible peak
                (carried in bytes by the error).
        """
        from solvers import least_recompute

        least_sched, least_peak = self.least_feasible()
        if budget_bytes < least_peak:
            raise InfeasibleBudget(
                f"no schedule fits a peak budget of {budget_bytes} bytes "
                f"({budget_bytes / 2**20:.2f} MiB): the least feasible peak is {least_peak} "
                f"bytes ({least_peak / 2**20:.2f} MiB, {least_sched.provenance}); raise "
                "the budget to at least that",
                least_feasible_peak_bytes=least_peak,
                budget_bytes=budget_bytes,
            )
        t0 = time.perf_counter()
        model_budget = budget_bytes
        chosen: Schedule | None = None
        model_peak = 0
        resolves = 0
        for resolves in range(max_resolves + 1):
            try:
                sol = least_recompute(self.costs, model_budget)
            except InfeasibleBudget:
                break
            sch = self._schedule(sol.groups)
            pk = self.report(sch).peak_bytes
            if pk <= budget_bytes:
                chosen, model_peak = sch, sol.peak_bytes
                break
            model_budget -= max(pk - budget_bytes, 1)
        solve_s = time.perf_counter() - t0
        if chosen is None:  # the model's answers kept overshooting: take the least peak
            from solvers import model_peak as chain_peak

            chosen = least_sched
            model_peak = chain_peak(self.costs, chosen.groups).peak_bytes
        rep = self.report(chosen)
        return Plan(
            budget_bytes=budget_bytes,
            schedule=chosen,
            model_peak_bytes=int(model_peak),
            predicted_peak_bytes=rep.peak_bytes,
            recompute_flops=rep.recompute_flops,
            forward_flops=rep.forward_flops,
            least_feasible_peak_bytes=least_peak,
            unconstrained_peak_bytes=self.unconstrained_peak_bytes,
            solve_time_s=solve_s,
            resolves=resolves,
        )

    def plan_many(self, budgets: Sequence[int]) -> list[Plan]:
        """``plan`` for each budget, served from the largest down: when the schedule
        chosen for a larger budget still fits a smaller one and costs no more recompute,
        it is kept, so the predicted peak never rises as the budget falls."""
        order = sorted(range(len(budgets)), key=lambda i: -budgets[i])
        out: dict[int, Plan] = {}
        prev: Plan | None = None
        for i in order:
            p = self.plan(budgets[i])
            if prev is not None and prev.predicted_peak_bytes <= budgets[i] and (
                prev.recompute_flops <= p.recompute_flops
                and (prev.recompute_flops < p.recompute_flops or prev.predicted_peak_bytes < p.predicted_peak_bytes)
            ):
                p = dataclasses.replace(prev, budget_bytes=budgets[i], solve_time_s=p.solve_time_s)
            out[i] = p
            prev = p
        return [out[i] for i in range(len(budgets))]


# --------------------------------------------------------------------------- command line


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


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def model_text(sm: SymbolicModel) -> str:
    """The symbolic formulas of ``sm`` as text and LaTeX (``remat-pass model``)."""
    L = sm.num_layers
    agg = sm.aggregates()
    cf = sm.closed_forms()
    lines = [f"layer stack {sm.stack.path!r}, L = {L}; symbols {', '.join(sm.gens)} "
             f"(traced at {', '.join(f'{k}={v}' for k, v in sm.hints.items())}); bytes, fp as traced", ""]
    lines.append("per-layer aggregates (read off the graph):")
    for name, label in (("s", "s  (saved as a group of one)"), ("a", "a  (saved when stored)"),
                        ("forward_flops", "forward FLOPs"), ("recompute_flops", "recompute FLOPs (alone)")):
        vals = agg[name]
        same = all(sympy.simplify(v - vals[0]) == 0 for v in vals)
        if same:
            lines.append(f"  {label:32s} = {vals[0]}   (every layer)")
        else:
            for i, v in enumerate(vals):
                lines.append(f"  {label:32s} layer {i} = {v}")
    lines.append(f"  {'outer saved bytes':32s} = {agg['outer']}")
    lines.append("")
    lines.append(f"chain-model terms (middle layer): s = {cf['s']}, a = {cf['a']}, g = {cf['g']} (parameter-gradient bytes)")
    for sym, ex in cf["terms"].items():
        lines.append(f"  {sym} = {ex}")
    lines.append("")
    lines.append(f"peak_uniform(K) = {cf['peak_uniform']}")
    lines.append(f"peak_block(N)   = {cf['peak_block']}")
    lines.append(f"K* (continuous) = {cf['K_star']}")
    K, N, Ls = sympy.symbols("K N L", positive=True, integer=True)
    if sm.hints:
        at = {sm.symbol(k): v for k, v in sm.hints.items()}
        sub = {sym: ex.xreplace(at) for sym, ex in cf["terms"].items()}
        exact = {k: sm.peak_at(schedules.uniform(k, L), **sm.hints) for k in range(1, L + 1)}
        closed = {k: int(cf["peak_uniform"].xreplace(at).xreplace(sub).xreplace({K: k, Ls: L})) for k in exact}
        exact_b = {n: sm.peak_at(schedules.block(n, L), **sm.hints) for n in range(0, L + 1)}
        closed_b = {n: int(cf["peak_block"].xreplace(at).xreplace(sub).xreplace({N: n, Ls: L})) for n in exact_b}
        best = min(exact, key=lambda k: (exact[k], k))
        kstar = cf["K_star"].xreplace(at).xreplace({Ls: L})
        err_u = max(abs(closed[k] - exact[k]) / exact[k] for k in exact)
        err_b = max(abs(closed_b[n] - exact_b[n]) / exact_b[n] for n in exact_b)
        lines.append(f"at {', '.join(f'{k}={v}' for k, v in sm.hints.items())}: K* = {float(kstar):.2f}; "
                     f"the exact peak of uniform(K) is least at K = {best} ({_fmt_bytes(exact[best])}); "
                     f"closed forms vs exact liveness peaks: uniform K=1..{L} within {100 * err_u:.2f} %, "
                     f"block N=0..{L} within {100 * err_b:.2f} %")
    lines.append("")
    lines.append("LaTeX:")
    lines.append(f"  \\mathrm{{peak}}_{{uniform}}(K) = {sympy.latex(cf['peak_uniform'])}")
    lines.append(f"  \\mathrm{{peak}}_{{block}}(N) = {sympy.latex(cf['peak_block'])}")
    lines.append(f"  K^* = {sympy.latex(cf['K_star'])}")
    return "\n".join(lines)


def max_batch_rows(sm: SymbolicModel, budget_bytes: int, symbol: str = "batch",
                   schedule_list: Sequence[Schedule] | None = None) -> list[dict[str, Any]]:
    """Largest ``symbol`` value that fits ``budget_bytes`` per schedule (others at their
    traced values): rows with schedule, the largest value, and the exact peak there and
    at the next value."""
    from .sweep import megatron_schedules

    fixed = {k: v for k, v in sm.hints.items() if k != symbol}
    rows = []
    for sch in schedule_list or megatron_schedules(sm.num_layers):
        best = sm.largest_fitting(sch, budget_bytes, symbol, **fixed)
        rows.append({
            "schedule": sch.provenance,
            symbol: best,
            "peak_bytes": sm.peak_at(sch, **fixed, **{symbol: best}) if best else None,
            "next_peak_bytes": sm.peak_at(sch, **fixed, **{symbol: best + 1}),
        })
    return rows


def plan_command(session: Any, budget_bytes: int, json_path: str | None = None) -> int:
    """``remat-pass plan --budget``: solve, rewrite, predict, measure; print and write JSON.

    Returns:
        The exit status: 0, or 1 when the gradients differ from the un-rewritten step.

    Raises:
        InfeasibleBudget: the budget is below the least feasible peak.
    """
    import sys

    from .report import write_json

    t0 = time.perf_counter()
    planner = Planner(session)
    try:
        p = planner.plan(budget_bytes)
    except InfeasibleBudget as e:
        if json_path:
            write_json(json_path, {
                "budget_bytes": budget_bytes, "schedule": None, "error": str(e),
                "least_feasible_peak_bytes": e.least_feasible_peak_bytes,
                "unconstrained_peak_bytes": planner.unconstrained_peak_bytes,
            })
        raise
    result = session.evaluate(p.schedule)
    L = p.schedule.num_layers
    print(f"budget             {budget_bytes} bytes ({_fmt_bytes(budget_bytes)})")
    print(f"schedule           {p.describe()}")
    print(f"  groups           {' '.join(str(list(g)) for g in p.schedule.groups) or 'none'}")
    print(f"  stored layers    {' '.join(map(str, p.schedule.stored_layers)) or 'none'} (of L={L})")
    print(f"predicted peak     {p.predicted_peak_bytes} bytes ({_fmt_bytes(p.predicted_peak_bytes)}); "
          f"chain model {p.model_peak_bytes}")
    print(f"measured peak      {result.measured_peak_bytes} bytes ({_fmt_bytes(result.measured_peak_bytes)}), "
          f"{100 * (result.measured_peak_bytes - budget_bytes) / budget_bytes:+.2f} % vs budget")
    print(f"recompute          {p.recompute_flops} FLOPs = {100 * p.recompute_fraction:.1f} % of forward")
    print(f"gradients          {'bitwise equal' if result.grads_equal else 'DIFFER'} to the un-rewritten step")
    print(f"unconstrained peak {p.unconstrained_peak_bytes} bytes ({_fmt_bytes(p.unconstrained_peak_bytes)}, none)")
    print(f"least feasible     {p.least_feasible_peak_bytes} bytes ({_fmt_bytes(p.least_feasible_peak_bytes)})")
    print(f"solve time         {1000 * p.solve_time_s:.1f} ms ({p.resolves} re-solves; calibration "
          f"{planner.calibrate_s:.2f} s; total {time.perf_counter() - t0:.1f} s)")
    if json_path:
        write_json(json_path, {
            "budget_bytes": budget_bytes,
            "schedule": {
                "description": p.describe(),
                "provenance": p.schedule.provenance,
                "groups": [list(g) for g in p.schedule.groups],
                "stored_layers": list(p.schedule.stored_layers),
                "num_layers": L,
            },
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "model_peak_bytes": p.model_peak_bytes,
            "measured_peak_bytes": result.measured_peak_bytes,
            "recompute_flops": p.recompute_flops,
            "forward_flops": p.forward_flops,
            "recompute_fraction": p.recompute_fraction,
            "grads_equal": result.grads_equal,
            "least_feasible_peak_bytes": p.least_feasible_peak_bytes,
            "unconstrained_peak_bytes": p.unconstrained_peak_bytes,
            "solve_time_s": p.solve_time_s,
        })
        print(f"wrote {json_path}", file=sys.stderr)
    return 0 if result.grads_equal else 1
