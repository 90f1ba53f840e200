"""The roles of layers under a schedule, and the blocks a rewritten step runs in order.

Under a layer-level schedule every layer has a *role*: ``S`` stored, ``G1`` a group of
one, ``F`` / ``M`` / ``E`` first / middle / last of a larger group. Under an op-level
plan a stored layer that recomputes part of itself just in time in its own backward
(the k-th point of its trade-off, ``plan.op_planner``) has the role ``S<k>`` (``S3``):
a stored role whose backward block holds those recomputes. The rewritten step
(``rewrite.py``) runs its blocks in this order: ``pre``, the forward of layers
0..L-1, ``head_fw``, ``head_bw``, then from layer L-1 down to 0 the layer's backward,
with its group's recompute (layers in order) inside the top layer's backward (split in
two parts around it); ``post``. A block's steps depend only on its layer's role, so
``layer_reuse`` rewrites short templates whose role strings (``template_role_strings``)
together show every (role, neighbour's role) pair a long schedule has.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from ..recompute import schedule as schedules
from ..errors import UnsupportedGraph
from ..recompute.schedule import Schedule

ROLES = ("S", "G1", "F", "M", "E")
TEMPLATE_LAYERS = 4
_FOLLOWS = {"S": ("S", "G1", "F"), "G1": ("S", "G1", "F"), "E": ("S", "G1", "F"), "F": ("M", "E"), "M": ("M", "E")}


def base_role(role: str) -> str:
    """The layer-level role of ``role``: ``S`` for an op-level ``S<k>``, else itself."""
    return "S" if role.startswith("S") else role


def roles_of(schedule: Schedule, options: Sequence[int] = ()) -> tuple[str, ...]:
    """The role of every layer under ``schedule``: ``S`` stored, ``G1`` a group of one,
    ``F`` / ``M`` / ``E`` first / middle / last of a larger group; with op-level
    ``options`` (per layer, 0: stored whole), a stored layer with option k > 0 is ``S<k>``.

    Raises:
        ValueError: ``options`` is not one per layer, or gives a layer of a group an option.

    Example:
        >>> roles_of(schedules.uniform(3, 7))
        ('F', 'M', 'E', 'F', 'M', 'E', 'G1')
        >>> roles_of(schedules.optimized(((0,),), 3), (0, 2, 0))
        ('G1', 'S2', 'S')
    """
    if options and len(options) != schedule.num_layers:
        raise ValueError(f"{len(options)} options for {schedule.num_layers} layers")
    roles = [f"S{k}" if k else "S" for k in options] if options else ["S"] * schedule.num_layers
    for g in schedule.groups:
        if any(roles[i] != "S" for i in g):
            raise ValueError(f"a layer of group {list(g)} has an op-level option: options are for stored layers")
        if len(g) == 1:
            roles[g[0]] = "G1"
        else:
            roles[g[0]], roles[g[-1]] = "F", "E"
            for i in g[1:-1]:
                roles[i] = "M"
    return tuple(roles)


def schedule_of_roles(roles: Sequence[str]) -> Schedule:
    """The (optimized) Schedule whose ``roles_of`` is ``roles`` (``S<k>`` counts as ``S``).

    Raises:
        ValueError: ``roles`` is not a valid role string (``F`` not followed by ``M`` /
            ``E``, a group left open).
    """
    if not valid_roles(roles):
        raise ValueError(f"{''.join(roles)} is not a valid role string")
    groups, current = [], []
    for i, r in enumerate(roles):
        if r == "G1":
            groups.append((i,))
        elif r in ("F", "M"):
            current.append(i)
        elif r == "E":
            groups.append((*current, i))
            current = []
    return schedules.optimized(tuple(groups), len(roles))


def valid_roles(roles: Sequence[str]) -> bool:
    """Whether ``roles`` is the role string of some schedule."""
    base = [base_role(r) for r in roles]
    if not base or base[0] in ("M", "E") or base[-1] in ("F", "M") or any(r not in _FOLLOWS for r in base):
        return False
    return all(b in _FOLLOWS[a] for a, b in zip(base, base[1:]))


def op_option(role: str) -> int:
    """k of an op-level role ``S<k>``; 0 for every other role."""
    return int(role[1:]) if role.startswith("S") and len(role) > 1 else 0


def requirements(roles: Sequence[str]) -> set[tuple]:
    """What a role string needs from the templates: every adjacent (role, role) pair and
    every (role, is first, is last)."""
    n = len(roles)
    need: set[tuple] = {("pair", a, b) for a, b in zip(roles, roles[1:])}
    need |= {("single", r, i == 0, i == n - 1) for i, r in enumerate(roles)}
    return need


def template_role_strings(needed: set[tuple], length: int = TEMPLATE_LAYERS) -> list[tuple[str, ...]]:
    """Role strings of ``length`` layers that together cover ``needed`` (greedy set
    cover over every valid string of the layer-level roles and the op-level roles
    ``needed`` names, ties broken by the strings' order).

    Raises:
        UnsupportedGraph: something needed is in no valid string of that length.
    """
    extra = sorted({r for need in needed for r in need[1:] if isinstance(r, str) and r not in ROLES})
    candidates = [c for c in itertools.product((*ROLES, *extra), repeat=length) if valid_roles(c)]
    left = set(needed)
    chosen: list[tuple[str, ...]] = []
    while left:
        best = max(candidates, key=lambda c: len(requirements(c) & left))
        gain = requirements(best) & left
        if not gain:
            raise UnsupportedGraph(f"no template of {length} layers shows {sorted(left)}")
        chosen.append(best)
        left -= gain
    return chosen


def block_order(roles: Sequence[str]) -> list[Any]:
    """The blocks of a rewritten step in run order (module docstring): outer names and
    ``(kind, layer, part)``; a backward block has part 1 once its layer was recomputed.

    Example:
        >>> block_order(("G1", "S"))[4:]
        ['head_bw', ('backward', 1, 0), ('backward', 0, 0), ('recompute', 0, 0), ('backward', 0, 1), 'post']
    """
    L = len(roles)
    out: list[Any] = ["pre", *[("forward", j, 0) for j in range(L)], "head_fw", "head_bw"]
    for j in range(L - 1, -1, -1):
        if roles[j] in ("G1", "E"):
            lo = j
            while roles[lo] not in ("G1", "F"):
                lo -= 1
            out += [("backward", j, 0), *[("recompute", i, 0) for i in range(lo, j + 1)], ("backward", j, 1)]
        else:
            out.append(("backward", j, 1 if roles[j] in ("F", "M") else 0))
    out.append("post")
    return out


def block_type(block: Any, roles: Sequence[str]) -> Any:
    """``(kind, role, part)`` of a layer block, the name of an outer one."""
    return block if isinstance(block, str) else (block[0], roles[block[1]], block[2])
