"""Polynomials with integer coefficients in positive integer symbols (batch, seq), the
algebra of symbolic memory sizes.

A ``Poly`` maps exponent tuples (one exponent per symbol, in a fixed order the caller
keeps) to int coefficients: ``{(1, 1): 4096, (1, 0): 8}`` is ``4096·b·s + 8·b`` over
``(b, s)``. It supports ``+``, ``-`` and multiplication by an int, so the live-bytes
sweep of ``remat_pass.liveness.timeline`` runs on it unchanged. A Max of polynomials (a peak) is
kept as the list of those not dominated coefficient by coefficient (``pareto_max``),
which is exact for every positive value of the symbols.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Mapping, Sequence


class Poly(Mapping):
    """An immutable polynomial ``{exponent tuple: int coefficient}`` (zero terms dropped).

    Example:
        >>> p = Poly({(1, 0): 8, (1, 1): 4096})
        >>> (p + p - Poly({(1, 0): 16})).evaluate([2, 3])
        49152
        >>> 0 + p == p, bool(Poly())
        (True, False)
    """

    __slots__ = ("_terms", "_hash")

    def __init__(self, terms: Mapping[tuple[int, ...], int] | None = None):
        self._terms = {k: int(v) for k, v in (terms or {}).items() if v}
        self._hash: int | None = None

    @classmethod
    def constant(cls, value: int, num_symbols: int) -> "Poly":
        """The constant ``value`` over ``num_symbols`` symbols."""
        return cls({(0,) * num_symbols: value})

    def __getitem__(self, key: tuple[int, ...]) -> int:
        return self._terms[key]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._terms)

    def __len__(self) -> int:
        return len(self._terms)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(sorted(self._terms.items())))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int) and not isinstance(other, bool):
            return self == Poly({(): other}) if other else not self._terms
        if isinstance(other, Poly):
            return self._terms == other._terms
        return isinstance(other, Mapping) and self._terms == dict(other)

    def __repr__(self) -> str:
        return f"Poly({dict(sorted(self._terms.items()))})"

    def _combine(self, other: "Poly | int", sign: int) -> "Poly":
        if isinstance(other, int) and not isinstance(other, bool):
            if not other:
                return self
            raise TypeError("add a Poly, not a nonzero int: the number of symbols is unknown")
        out = dict(self._terms)
        for k, v in (other._terms if isinstance(other, Poly) else other).items():
            w = out.get(k, 0) + sign * int(v)
            if w:
                out[k] = w
            else:
                out.pop(k, None)
        return Poly._of(out)

    @classmethod
    def _of(cls, terms: dict[tuple[int, ...], int]) -> "Poly":
        """A Poly holding ``terms`` itself (int coefficients, none zero: the caller's
        promise), without the copy ``__init__`` makes: the liveness sweep adds millions."""
        p = cls.__new__(cls)
        p._terms, p._hash = terms, None
        return p

    def __add__(self, other: "Poly | int") -> "Poly":
        return self._combine(other, 1)

    __radd__ = __add__

    def __sub__(self, other: "Poly | int") -> "Poly":
        return self._combine(other, -1)

    def __neg__(self) -> "Poly":
        return Poly._of({k: -v for k, v in self._terms.items()})

    def __mul__(self, factor: int) -> "Poly":
        return Poly({k: v * factor for k, v in self._terms.items()})

    __rmul__ = __mul__

    def evaluate(self, values: Sequence[int]) -> int:
        """The value at ``values`` (one int per symbol, in exponent order)."""
        return sum(c * math.prod(v**e for v, e in zip(values, k)) for k, c in self._terms.items())

    def dominates(self, other: Mapping[tuple[int, ...], int]) -> bool:
        """``self >= other`` for every positive value of the symbols, coefficient by
        coefficient (sufficient, not necessary)."""
        return all(self._terms.get(k, 0) >= v for k, v in other.items()) and all(
            v >= 0 for k, v in self._terms.items() if k not in other
        )

    def sort_key(self) -> list[tuple[tuple[int, ...], int]]:
        """A deterministic order for sets of polynomials."""
        return sorted(self._terms.items())


def pareto_max(polys: Iterable[Poly]) -> list[Poly]:
    """The polynomials not dominated by another: their Max equals the Max of all of them
    for every positive value of the symbols. Sorted deterministically.

    Example:
        >>> pareto_max([Poly({(1,): 2}), Poly({(1,): 3}), Poly({(0,): 5})])
        [Poly({(0,): 5}), Poly({(1,): 3})]
    """
    uniq = {p: p for p in (Poly(q) for q in polys)}
    cands = sorted(uniq, key=lambda p: (-sum(p.values()), p.sort_key()))
    kept: list[Poly] = []
    for p in cands:
        if not any(k.dominates(p) for k in kept):
            kept = [k for k in kept if not p.dominates(k)] + [p]
    return sorted(kept, key=Poly.sort_key)


def max_value(polys: Iterable[Poly], values: Sequence[int]) -> int:
    """The Max of ``polys`` at ``values`` (0 for none)."""
    return max((p.evaluate(values) for p in polys), default=0)
