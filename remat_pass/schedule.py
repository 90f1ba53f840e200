"""The Schedule value: which layers are recomputed, in which groups.

Semantics follow Megatron-LM's ``--recompute-granularity full``:

- ``none``: nothing is recomputed; backward reads what AOTAutograd's default partition
  would save (every forward value backward uses).
- ``uniform(K)`` (``--recompute-method uniform --recompute-num-layers K``): layers split
  into ceil(L/K) groups of K consecutive layers (the last may be shorter); only each
  group's inputs are saved and the group is recomputed in backward.
- ``block(N)`` (``--recompute-method block --recompute-num-layers N``): layers 0..N-1
  are each a group of one; layers N..L-1 save everything.
- ``optimized``: any split of the stack into recomputed groups of any sizes, the other
  layers stored whole (chosen by a solver in ``solvers/``).

Outer nodes (embedding, final norm, head, loss) follow ``none``.
"""

from __future__ import annotations

import dataclasses
import math

from .errors import InvalidSchedule

METHODS = ("none", "uniform", "block", "optimized")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Layer-level recompute schedule.

    Attributes:
        method: ``"none"``, ``"uniform"``, ``"block"`` or ``"optimized"``.
        num_layers: L, the length of the layer stack the schedule is for.
        recompute_num_layers: K for uniform, N for block (Megatron-LM's
            ``--recompute-num-layers``), None otherwise.
        groups: the recomputed groups, each a tuple of consecutive layer indices, in
            layer order; layers in no group are stored (nothing recomputed).
    """

    method: str
    num_layers: int
    recompute_num_layers: int | None = None
    groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidSchedule(f"schedule method {self.method!r} is not one of {METHODS}")
        seen: set[int] = set()
        for g in self.groups:
            if not g or list(g) != list(range(g[0], g[0] + len(g))):
                raise InvalidSchedule(f"group {g} is not a run of consecutive layers")
            if g[0] < 0 or g[-1] >= self.num_layers:
                raise InvalidSchedule(
                    f"group {g} holds a layer outside 0..{self.num_layers - 1} (L={self.num_layers})"
                )
            if seen & set(g):
                raise InvalidSchedule(f"group {g} overlaps another group")
            seen |= set(g)

    @property
    def provenance(self) -> str:
        """A readable name: ``none``, ``uniform(K=4)``, ``block(N=3)`` or the groups."""
        if self.method == "uniform":
            return f"uniform(K={self.recompute_num_layers})"
        if self.method == "block":
            return f"block(N={self.recompute_num_layers})"
        if self.method == "optimized":
            return f"optimized({describe_groups(self.groups, self.num_layers)})"
        return "none"

    @property
    def stored_layers(self) -> tuple[int, ...]:
        """Layers in no recomputed group (they save all their activations)."""
        inside = {i for g in self.groups for i in g}
        return tuple(i for i in range(self.num_layers) if i not in inside)

    def group_of(self, layer: int | None) -> int | None:
        """Index into ``groups`` of the group holding ``layer``, or None."""
        if layer is None:
            return None
        for gi, g in enumerate(self.groups):
            if layer in g:
                return gi
        return None


def describe_groups(groups: tuple[tuple[int, ...], ...], num_layers: int) -> str:
    """E.g. ``recompute [0-3] [4-5], store 6 7`` for L=8."""
    inside = {i for g in groups for i in g}
    parts = [f"[{g[0]}-{g[-1]}]" if len(g) > 1 else f"[{g[0]}]" for g in groups]
    stored = [str(i) for i in range(num_layers) if i not in inside]
    text = "recompute " + " ".join(parts) if parts else "recompute nothing"
    return text + (", store " + " ".join(stored) if stored else "")


def none(num_layers: int) -> Schedule:
    """The baseline: nothing recomputed."""
    return Schedule("none", num_layers)


def uniform(k: int, num_layers: int) -> Schedule:
    """Megatron ``--recompute-method uniform --recompute-num-layers K``.

    Raises:
        InvalidSchedule: K is not an integer in 1..L.
    """
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_layers:
        raise InvalidSchedule(
            f"uniform K={k!r} is outside 1..L: the layer stack has L={num_layers} layers"
        )
    groups = tuple(
        tuple(range(s, min(s + k, num_layers))) for s in range(0, num_layers, k)
    )
    assert len(groups) == math.ceil(num_layers / k)
    return Schedule("uniform", num_layers, k, groups)


def block(n: int, num_layers: int) -> Schedule:
    """Megatron ``--recompute-method block --recompute-num-layers N``.

    Raises:
        InvalidSchedule: N is not an integer in 0..L.
    """
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= num_layers:
        raise InvalidSchedule(
            f"block N={n!r} is outside 0..L: the layer stack has L={num_layers} layers"
        )
    return Schedule("block", num_layers, n, tuple((i,) for i in range(n)))


def optimized(groups: tuple[tuple[int, ...], ...], num_layers: int) -> Schedule:
    """A solver's schedule: recomputed ``groups``, every other layer stored.

    Raises:
        InvalidSchedule: a group is not consecutive, overlaps another or leaves 0..L-1.
    """
    return Schedule("optimized", num_layers, None, tuple(tuple(g) for g in groups))


def make(method: str, recompute_num_layers: int | None, num_layers: int) -> Schedule:
    """Build ``none`` / ``uniform`` / ``block`` from a method name and K or N.

    Args:
        method: ``none``, ``uniform`` or ``block`` (Megatron-LM's ``--recompute-method``).
        recompute_num_layers: K (uniform) or N (block), Megatron-LM's
            ``--recompute-num-layers``; ignored for none.
        num_layers: L, the layers of the stack.

    Raises:
        InvalidSchedule: unknown method, or K / N out of range (message names L).
    """
    if method == "none":
        return none(num_layers)
    if method == "uniform":
        return uniform(recompute_num_layers, num_layers)  # type: ignore[arg-type]
    if method == "block":
        return block(recompute_num_layers, num_layers)  # type: ignore[arg-type]
    raise InvalidSchedule(f"schedule {method!r} is not one of none, uniform, block")


def megatron_schedules(num_layers: int) -> list[Schedule]:
    """``none``, uniform K = 1..L, block N = 0..L: every Megatron-LM full-recompute setting."""
    return (
        [none(num_layers)]
        + [uniform(k, num_layers) for k in range(1, num_layers + 1)]
        + [block(n, num_layers) for n in range(0, num_layers + 1)]
    )


def recompute_fraction(recompute_flops: int, forward_flops: int) -> float:
    """Recompute FLOPs as a fraction of forward FLOPs (0 when forward has none)."""
    return recompute_flops / forward_flops if forward_flops else 0.0
