"""Chain-model cases for the solver tests: every grouping of L layers and random
heterogeneous chain costs (no torch)."""

from __future__ import annotations

import random

from solvers import ChainCosts, StoredOption


def all_groupings(L: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every schedule: each layer stored or in a group of consecutive layers."""
    out: list[tuple] = []

    def rec(i: int, acc: list) -> None:
        if i == L:
            out.append(tuple(acc))
            return
        rec(i + 1, acc)
        for q in range(i, L):
            rec(q + 1, acc + [tuple(range(i, q + 1))])

    rec(0, [])
    return out


def random_costs(L: int, seed: int, options: int = 0, scale: int = 1) -> ChainCosts:
    """Random heterogeneous chain costs; ``options`` op-level options per layer (each
    saving part of the stored bytes for some recompute); every figure times ``scale``."""
    r = random.Random(seed)

    def v(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(scale * r.randint(lo, hi) for _ in range(L))

    def opts(i: int) -> tuple[StoredOption, ...]:
        return tuple(StoredOption(scale * r.randint(20, 150), scale * r.randint(40, 150),
                                  scale * r.randint(80, 300), scale * r.randint(0, 60)) for _ in range(options))

    return ChainCosts(
        stored_saved_bytes=v(50, 200), last_saved_bytes=v(5, 20), member_saved_bytes=v(0, 3),
        stored_forward_bytes=v(40, 150), recomputed_forward_bytes=v(30, 120),
        stored_backward_bytes=v(100, 300), recomputed_backward_bytes=v(100, 300),
        carry_bytes=v(50, 200), last_recompute_flops=v(10, 100), member_recompute_flops=v(10, 100),
        head_bytes=scale * r.randint(0, 400), outer_bytes=scale * r.randint(0, 300),
        shared_checkpoint_bytes=scale * r.randint(0, 30),
        stored_options=tuple(opts(i) for i in range(L)) if options else (),
    )
