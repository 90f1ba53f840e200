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

Several stacks (T5's encoder and decoder): their layers form one chain 0..L-1, stack
after stack, and a schedule built from the layers of each stack (``num_layers=(6, 6)``)
applies per stack, as Megatron-LM applies ``--recompute-num-layers`` to each transformer
block: uniform(K) splits each stack into groups of K (the last of each stack may be
shorter), block(N) checkpoints the first N layers of each stack. No group spans two
stacks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from ..errors import InvalidSchedule

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
        stack_sizes: L of each stack when the chain is several stacks, in chain order
            (they add up to ``num_layers``); empty for one stack.
    """

    method: str
    num_layers: int
    recompute_num_layers: int | None = None
    groups: tuple[tuple[int, ...], ...] = ()
    stack_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidSchedule(f"schedule method {self.method!r} is not one of {METHODS}")
        if self.stack_sizes and (len(self.stack_sizes) < 2 or sum(self.stack_sizes) != self.num_layers
                                 or min(self.stack_sizes) < 1):
            raise InvalidSchedule(
                f"stack sizes {self.stack_sizes} are not two or more stacks of L >= 1 adding up to "
                f"L={self.num_layers}"
            )
        starts = set(self.stack_starts)
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
            if any(i in starts for i in g[1:]):
                raise InvalidSchedule(
                    f"group {g} spans two layer stacks (stacks of {', '.join(map(str, self.stack_sizes))} "
                    "layers): a group lies inside one stack"
                )
            seen |= set(g)

    @property
    def stack_starts(self) -> tuple[int, ...]:
        """The first layer of each stack after the first (empty for one stack)."""
        return tuple(sum(self.stack_sizes[:i]) for i in range(1, len(self.stack_sizes)))

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


Layers = int | Sequence[int]
"""L of one stack, or L of each stack in chain order (``LayerStack.layers_per_stack``)."""


def _chain(num_layers: Layers) -> tuple[int, tuple[int, ...]]:
    """``(L, stack_sizes)``: one stack given as an int or a 1-tuple has no sizes."""
    if isinstance(num_layers, int):
        return num_layers, ()
    sizes = tuple(int(n) for n in num_layers)
    return (sizes[0], ()) if len(sizes) == 1 else (sum(sizes), sizes)


def _per_stack(sizes: tuple[int, ...], num_layers: int) -> list[tuple[int, int]]:
    """``(first layer, L)`` of each stack."""
    out, first = [], 0
    for n in sizes or (num_layers,):
        out.append((first, n))
        first += n
    return out


def _range_text(what: str, value: object, low: int, num_layers: int, sizes: tuple[int, ...]) -> str:
    if not sizes:
        return f"{what}={value!r} is outside {low}..L: the layer stack has L={num_layers} layers"
    return (f"{what}={value!r} is outside {low}..L: it applies to each layer stack, and the longest "
            f"has L={max(sizes)} layers (stacks of {', '.join(map(str, sizes))})")


def none(num_layers: Layers) -> Schedule:
    """The baseline: nothing recomputed."""
    L, sizes = _chain(num_layers)
    return Schedule("none", L, stack_sizes=sizes)


def uniform(k: int, num_layers: Layers) -> Schedule:
    """Megatron ``--recompute-method uniform --recompute-num-layers K``, in each stack.

    Args:
        k: K, 1..L (1..the longest stack's L for several stacks).
        num_layers: L, or L of each stack.

    Raises:
        InvalidSchedule: K is not an integer in 1..L.
    """
    L, sizes = _chain(num_layers)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= max(sizes or (L,)):
        raise InvalidSchedule(_range_text("uniform K", k, 1, L, sizes))
    groups = tuple(
        tuple(range(first + s, first + min(s + k, n)))
        for first, n in _per_stack(sizes, L) for s in range(0, n, k)
    )
    assert len(groups) == sum(math.ceil(n / k) for _, n in _per_stack(sizes, L))
    return Schedule("uniform", L, k, groups, sizes)


def block(n: int, num_layers: Layers) -> Schedule:
    """Megatron ``--recompute-method block --recompute-num-layers N``, in each stack.

    Args:
        n: N, 0..L (0..the longest stack's L for several stacks; a shorter stack then
            checkpoints all its layers).
        num_layers: L, or L of each stack.

    Raises:
        InvalidSchedule: N is not an integer in 0..L.
    """
    L, sizes = _chain(num_layers)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= max(sizes or (L,)):
        raise InvalidSchedule(_range_text("block N", n, 0, L, sizes))
    groups = tuple((first + i,) for first, size in _per_stack(sizes, L) for i in range(min(n, size)))
    return Schedule("block", L, n, groups, sizes)


def optimized(groups: tuple[tuple[int, ...], ...], num_layers: Layers) -> Schedule:
    """A solver's schedule: recomputed ``groups``, every other layer stored.

    Raises:
        InvalidSchedule: a group is not consecutive, overlaps another, leaves 0..L-1 or
            spans two stacks.
    """
    L, sizes = _chain(num_layers)
    return Schedule("optimized", L, None, tuple(tuple(g) for g in groups), sizes)


def make(method: str, recompute_num_layers: int | None, num_layers: Layers) -> Schedule:
    """Build ``none`` / ``uniform`` / ``block`` from a method name and K or N.

    Args:
        method: ``none``, ``uniform`` or ``block`` (Megatron-LM's ``--recompute-method``).
        recompute_num_layers: K (uniform) or N (block), Megatron-LM's
            ``--recompute-num-layers``; ignored for none.
        num_layers: L, the layers of the stack (or L of each stack).

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


def megatron_schedules(num_layers: Layers) -> list[Schedule]:
    """``none``, uniform K = 1..L, block N = 0..L: every Megatron-LM full-recompute
    setting (L: the longest stack's, for several stacks)."""
    longest = max(_chain(num_layers)[1] or (_chain(num_layers)[0],))
    return (
        [none(num_layers)]
        + [uniform(k, num_layers) for k in range(1, longest + 1)]
        + [block(n, num_layers) for n in range(0, longest + 1)]
    )


def distinct_megatron_schedules(num_layers: Layers) -> list[Schedule]:
    """``megatron_schedules`` less the repeats of one rewrite: schedules with the same
    ``groups`` (``none`` = ``block(N=0)``, ``uniform(K=1)`` = ``block(N=L)``), the first
    of each kept.

    >>> [s.provenance for s in distinct_megatron_schedules(2)]
    ['none', 'uniform(K=1)', 'uniform(K=2)', 'block(N=1)']
    """
    out, seen = [], set()
    for s in megatron_schedules(num_layers):
        if s.groups not in seen:
            seen.add(s.groups)
            out.append(s)
    return out


def megatron_equivalent(schedule: Schedule) -> Schedule | None:
    """The Megatron-LM setting (``none``, uniform K, block N; the first of
    ``distinct_megatron_schedules``) that recomputes the same groups as ``schedule``, or
    None when no Megatron flag expresses it (e.g. groups of three with stored layers
    after them). The groups are compared, so an ``optimized`` plan that is block(N=16)
    is named as such.

    >>> megatron_equivalent(optimized(((0,), (1,)), 4)).provenance
    'block(N=2)'
    """
    sizes = schedule.stack_sizes or schedule.num_layers
    return next((s for s in distinct_megatron_schedules(sizes) if s.groups == schedule.groups), None)


def megatron_flags(method: str, recompute_num_layers: int | None) -> str:
    """Megatron-LM's command-line flags for one setting (``--recompute-granularity full
    --recompute-method`` and ``--recompute-num-layers``, Megatron-LM's arguments.py).

    Example:
        >>> megatron_flags("uniform", 2)
        '--recompute-granularity full --recompute-method uniform --recompute-num-layers 2'
    """
    if method == "none":
        return "(no recompute flags)"
    return (f"--recompute-granularity full --recompute-method {method} "
            f"--recompute-num-layers {recompute_num_layers}")


def recompute_fraction(recompute_flops: int, forward_flops: int) -> float:
    """Recompute FLOPs as a fraction of forward FLOPs (0 when forward has none)."""
    return recompute_flops / forward_flops if forward_flops else 0.0
