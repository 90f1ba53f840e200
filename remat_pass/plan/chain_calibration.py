"""The planner's chain model calibrated from liveness: the per-layer costs of
``solvers.chain`` read off the symbolic profiles (``liveness.symbolic``) of ``none``,
``uniform(1)`` and ``uniform(L)``, as polynomials in the shape symbols
(``chain_polys``), at concrete values for the solver (``chain_costs``), and in closed
form in K / N (``closed_forms``, ``solvers.closed_forms``).

A concrete trace gives constant polynomials, so the layer-level planner
(``planner.Planner``) calibrates with the same code; the op-level planner reads a
rewritten step's regions the same way (``regions``). By construction the chain model
reproduces the liveness peaks of the three schedules it is calibrated from.
"""

from __future__ import annotations

from typing import Any

from solvers import ChainCosts, StackGap
from solvers.closed_forms import ClosedForms, megatron_closed_forms
from solvers.poly import Poly, max_value, pareto_max

from ..recompute import schedule as schedules
from ..liveness.symbolic import SymbolicModel, SymbolicStep


def gap_boundaries(prof: SymbolicStep, stack_starts: tuple[int, ...] | list[int]) -> list[int | None]:
    """Per step, the stack boundary an outer step lies at (None: a layer's step, or an
    outer step not between two stacks): in forward, one past the highest layer run so
    far; in backward, the lowest layer whose backward (or recompute) has run."""
    out: list[int | None] = []
    ran_fw, lowest_bw = 0, None
    for phase, layer in zip(prof.phases, prof.layers):
        if layer is not None:
            if phase == "forward":
                ran_fw = max(ran_fw, layer + 1)
            else:
                lowest_bw = layer if lowest_bw is None else min(lowest_bw, layer)
            out.append(None)
            continue
        b = ran_fw if phase == "forward" else lowest_bw
        out.append(b if b in stack_starts else None)
    return out


def stack_gap_regions(prof: SymbolicStep, stack_starts: tuple[int, ...] | list[int]
                      ) -> dict[int, tuple[list[Poly], list[Poly]]]:
    """Live bytes of the outer steps between two stacks: boundary -> (forward steps,
    backward steps) (``gap_boundaries``)."""
    out: dict[int, tuple[list[Poly], list[Poly]]] = {b: ([], []) for b in stack_starts}
    for i, b in enumerate(gap_boundaries(prof, stack_starts)):
        if b is not None:
            out[b][0 if prof.phases[i] == "forward" else 1].append(prof.live[i])
    return out


def regions(prof: SymbolicStep, stack_starts: tuple[int, ...] | list[int] = ()
            ) -> tuple[dict[int, list[Poly]], dict[int, list[Poly]], list[Poly], list[Poly]]:
    """Live bytes of every step grouped by region: forward and backward per layer, the
    head (outer steps between the first forward layer step and the first backward one),
    and the rest of the outer region; the outer steps between two stacks
    (``stack_gap_regions``, for boundaries in ``stack_starts``) are in neither."""
    fw: dict[int, list[Poly]] = {}
    bw: dict[int, list[Poly]] = {}
    head: list[Poly] = []
    outer: list[Poly] = []
    first_fw = min((i for i, l in enumerate(prof.layers) if l is not None and prof.phases[i] == "forward"), default=0)
    first_bw = min((i for i, l in enumerate(prof.layers) if l is not None and prof.phases[i] == "backward"),
                   default=len(prof.layers))
    gaps = gap_boundaries(prof, stack_starts)
    for i, (phase, layer) in enumerate(zip(prof.phases, prof.layers)):
        if layer is not None:
            (fw if phase == "forward" else bw).setdefault(layer, []).append(prof.live[i])
        elif gaps[i] is not None:
            continue
        elif first_fw < i < first_bw:
            head.append(prof.live[i])
        else:
            outer.append(prof.live[i])
    return fw, bw, head, outer


def chain_polys(model: SymbolicModel) -> dict[str, Any]:
    """The chain model's costs (``solvers.ChainCosts`` fields) as lists of Pareto
    polynomial sets (a Max) per layer, calibrated from the liveness profiles of
    ``none``, ``uniform(1)`` and ``uniform(L)`` (for several stacks: each stack one
    group). See ``chain_costs``.

    Args:
        model: the symbolic model (``SymbolicModel``; ``layer_reuse.ReusedLayersModel``
            for a stack analysed from a template).
    """
    L, per_stack = model.num_layers, model.layers_per_stack
    last = _last_layers(model)
    none = model.profile(schedules.none(per_stack))
    u1 = model.profile(schedules.uniform(1, per_stack))
    uL = model.profile(schedules.uniform(max(per_stack), per_stack))
    out: dict[str, Any] = {}
    out["stored_saved_bytes"] = [[none.saved_by_layer.get(i, Poly())] for i in range(L)]
    out["last_saved_bytes"] = [[u1.saved_by_layer.get(i, Poly())] for i in range(L)]
    out["member_saved_bytes"] = [[uL.saved_by_layer.get(i, Poly())] if i not in last else [Poly()]
                                 for i in range(L)]
    out["last_recompute_flops"] = [[u1.recompute_flops_by_layer.get(i, Poly())] for i in range(L)]
    out["member_recompute_flops"] = [
        [uL.recompute_flops_by_layer.get(i, Poly())] if i not in last else [Poly()] for i in range(L)
    ]

    def prefix(prof: SymbolicStep, j: int) -> Poly:
        return sum((prof.saved_by_layer.get(i, Poly()) for i in range(j)), Poly())

    def above(polys: list[Poly], base: Poly) -> list[Poly]:
        return pareto_max(p - base for p in polys)

    starts = _stack_starts(model)[1:]
    n_fw, n_bw, n_head, n_outer = regions(none, starts)
    r_fw, r_bw, _, _ = regions(u1, starts)
    _, l_bw, _, _ = regions(uL, starts)
    # the outer steps between two stacks, above the bytes the layers below saved:
    # without groups (none) and with groups everywhere (uniform(1))
    n_gap, r_gap = stack_gap_regions(none, starts), stack_gap_regions(u1, starts)
    out["stack_gaps"] = [
        [above(n_gap[b][0] or [Poly()], prefix(none, b)), above(r_gap[b][0] or [Poly()], prefix(u1, b)),
         above(n_gap[b][1] or [Poly()], prefix(none, b)), above(r_gap[b][1] or [Poly()], prefix(u1, b))]
        for b in starts]
    out["stored_forward_bytes"] = [above(n_fw.get(j, [Poly()]), prefix(none, j)) for j in range(L)]
    out["stored_backward_bytes"] = [above(n_bw.get(j, [Poly()]), prefix(none, j)) for j in range(L)]
    # outer values every group reads (a mask), saved once when any group exists
    shared = u1.saved_by_layer.get(None, Poly()) - none.saved_by_layer.get(None, Poly())
    out["shared_checkpoint_bytes"] = [shared]
    out["recomputed_forward_bytes"] = [
        above(r_fw.get(j, [Poly()]), prefix(u1, j) + shared) for j in range(L)
    ]
    # in uniform(1) layer 0 is the lowest group: the shared values die at its recompute
    out["recomputed_backward_bytes"] = [
        above(r_bw.get(j, [Poly()]), prefix(u1, j) + (shared if j else Poly())) for j in range(L)
    ]
    out["head_bytes"] = above(n_head or [Poly()], prefix(none, L))
    out["outer_bytes"] = pareto_max(n_outer or [Poly()])
    out["forward_flops"] = [[sum(none.forward_flops_by_layer.values(), Poly())]]
    # carry: U_j = (peak of layer j's backward in one group of all layers of its
    # stack) - (alone);
    # carry_i = U_{i+1} - U_i, each a Max, so it is evaluated at concrete values.
    out["uniform_all_backward"] = [l_bw.get(j, [Poly()]) for j in range(L)]
    return out


def chain_costs(model: SymbolicModel, **values: int) -> ChainCosts:
    """``solvers.ChainCosts`` at concrete symbol values (bytes and FLOPs as ints).

    ``carry_bytes[i] = U(i+1) - U(i)`` where ``U(j)`` is the backward peak of layer j
    inside one group of all layers minus its backward peak alone (uniform(1)),
    both above the bytes saved by the layers before; by construction the model
    reproduces ``none``, ``uniform(1)`` and ``uniform(L)``. For several stacks the
    chain is the stacks' layers in chain order, and ``ChainCosts.stack_starts`` keeps
    every group inside one stack.

    Args:
        model: as ``chain_polys``.
        values: the value of every shape symbol (none for a concrete trace).

    Raises:
        ValueError: a symbol has no value.
    """
    vals = model.symbol_values(values) if model.gens else []
    polys = chain_polys(model)
    L = model.num_layers
    per_layer = ("stored_saved_bytes", "last_saved_bytes", "member_saved_bytes", "stored_forward_bytes",
                 "recomputed_forward_bytes", "stored_backward_bytes", "recomputed_backward_bytes",
                 "last_recompute_flops", "member_recompute_flops")
    fields = {k: tuple(max_value(ps, vals) for ps in polys[k]) for k in per_layer}
    u = [max_value(polys["uniform_all_backward"][j], vals) - fields["recomputed_backward_bytes"][j]
         for j in range(L)]
    last = _last_layers(model)
    fields["carry_bytes"] = tuple(u[i + 1] - u[i] if i not in last else 0 for i in range(L))
    return ChainCosts(
        **fields,
        head_bytes=max_value(polys["head_bytes"], vals),
        outer_bytes=max_value(polys["outer_bytes"], vals),
        forward_flops=max_value(polys["forward_flops"][0], vals),
        shared_checkpoint_bytes=max_value(polys["shared_checkpoint_bytes"], vals),
        stack_starts=tuple(_stack_starts(model)[1:]),
        stack_gaps=tuple(StackGap(*(max_value(ps, vals) for ps in gap)) for gap in polys["stack_gaps"]),
    )


def closed_forms(model: SymbolicModel, layer: int | None = None) -> ClosedForms:
    """Closed forms of the chain model for a stack of L layers all like ``layer``
    (default: the middle one), in K, N, L and the shape symbols
    (``solvers.closed_forms``; the terms read off this graph). The exact peak of
    one schedule is ``SymbolicModel.peak(schedule)``."""
    L = model.num_layers
    j = L // 2 if layer is None else layer
    polys = chain_polys(model)
    prefix = model.stack.layer_path(j) + "."
    param_grad_bytes = sum(
        int(v.untyped_storage().nbytes())
        for v, kind, label in zip(model.joint.primal_values, model.joint.primal_kinds, model.joint.primal_labels)
        if kind == "param" and label.startswith(prefix)
    )
    return megatron_closed_forms(
        checkpoint_bytes=model.max_sympy(polys["last_saved_bytes"][j]),
        stored_layer_bytes=model.max_sympy(polys["stored_saved_bytes"][j]),
        param_grad_bytes=param_grad_bytes,
        rebuilt_backward_peak_bytes=model.max_sympy(polys["recomputed_backward_bytes"][L - 1]),
        stored_backward_peak_bytes=model.max_sympy(polys["stored_backward_bytes"][L - 1]),
        head_peak_bytes=model.max_sympy(polys["head_bytes"]),
        outer_peak_bytes=model.max_sympy(polys["outer_bytes"]),
    )


def _stack_starts(model: SymbolicModel) -> list[int]:
    """The first layer of every stack, in chain order."""
    starts, first = [], 0
    for n in model.layers_per_stack:
        starts.append(first)
        first += n
    return starts


def _last_layers(model: SymbolicModel) -> set[int]:
    """The last layer of every stack."""
    return {first + n - 1 for first, n in zip(_stack_starts(model), model.layers_per_stack)}


def layer_terms(prof: SymbolicStep, num_layers: int) -> tuple[dict, dict, dict]:
    """Per layer of a profiled step (``symbolic.SymbolicStep``): its saved bytes and
    its forward and backward peaks above the bytes saved by the layers below (bytes),
    the terms ``chain_calibration`` reads off for stored layers."""
    fw, bw, _, _ = regions(prof)
    L = num_layers
    saved = {i: max_value([prof.saved_by_layer[i]], []) if i in prof.saved_by_layer else 0 for i in range(L)}
    below = {i: sum(saved[k] for k in range(i)) for i in range(L)}
    fw_above = {i: max_value(fw.get(i, []), []) - below[i] for i in range(L)}
    bw_above = {i: max_value(bw.get(i, []), []) - below[i] for i in range(L)}
    return saved, fw_above, bw_above
