"""A mixture-of-experts step predicted for the worst routing under a capacity bound.

A step traced with real values holds for its batch's routing (``data_scalars``: the
tokens each expert gets are constants of the graph). The memory of another batch
differs: in an eager experts loop every size an expert's tokens set (its activations,
saved or transient) grows with how many it gets, and an expert no token reaches runs
nothing and gets no weight gradient. ``bound_routing(model, capacity)`` makes the
model's router choose the routing that, under the bound "no expert gets more than
``capacity`` tokens" (the expert capacity of GShard / Switch Transformer, Fedus et al.
2021, and Megatron-Core's ``--moe-expert-capacity-factor``), is the most an expert
loop can cost: every expert reached by at least one token (every weight gradient is
there) and the remaining token slots given to as few experts as the bound allows, each
filled to ``capacity`` (the largest single-expert activations). The total of token
slots is fixed (tokens x top-k), so the activations summed over experts are the same
for every routing. This is the worst case of that argument, not of a search over all
routings; a test checks it against the batch's own routing and a balanced one.

How: every ``aten.topk`` over the last dimension of a 2-D input (the router's
``torch.topk(probs, k, dim=-1)`` over (tokens, experts)) returns that routing's expert
indices and the router's probabilities at them (``gather``), so its gradient flows as
topk's does (scattered back at the indices returned). The model's ``forward`` is
wrapped (``unbound_routing`` restores it), so the eager run, the trace and eager
autograd all see the same routing; the trace then specializes to it and says so.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import RematError

TOPK = torch.ops.aten.topk.default
ROUTING_NOTE = "_remat_routing_note"
"""Attribute of a model whose routing is bound: what its figures hold for."""


def worst_counts(tokens: int, top_k: int, experts: int, capacity: int) -> list[int]:
    """Tokens per expert of the bound's worst routing (see the module docstring).

    Args:
        tokens: T, the tokens routed (batch x sequence).
        top_k: experts per token.
        experts: E, the router's experts.
        capacity: the most tokens any expert may get (at most T count).

    Returns:
        E counts, each at most ``min(capacity, T)``, summing to T x top_k: one token for
        every expert the slots reach, the rest filling experts 0, 1, ... to the bound.

    Raises:
        RematError: the bound cannot hold (E x capacity < T x top_k), or a size < 1.
    """
    if min(tokens, top_k, experts, capacity) < 1 or top_k > experts:
        raise RematError(f"a routing of {tokens} tokens to top-{top_k} of {experts} experts with capacity "
                         f"{capacity} is not possible: every size must be >= 1 and top-k <= experts")
    cap = min(capacity, tokens)
    slots = tokens * top_k
    if experts * cap < slots:
        raise RematError(
            f"capacity {capacity} is too small: {tokens} tokens x top-{top_k} = {slots} token slots need at "
            f"least {math.ceil(slots / min(experts, tokens))} per expert over {experts} experts (at most "
            f"{tokens}, one per token)")
    counts = [1 if e < slots else 0 for e in range(experts)]
    left = slots - sum(counts)
    for e in range(experts):
        add = min(cap - counts[e], left)
        counts[e] += add
        left -= add
    return counts


def routing_indices(counts: list[int], tokens: int, top_k: int) -> torch.Tensor:
    """The (T, top_k) int64 expert indices giving each expert ``counts[e]`` tokens, every
    token ``top_k`` distinct experts: the experts, each repeated by its count, laid out
    slot by slot (position p is token p mod T, slot p // T; a run of one expert is at
    most T long, so it never gives one token the same expert twice)."""
    order = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return order.view(top_k, tokens).t().contiguous()


class _ForcedRouting(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module, capacity: int | None, counts: list[int] | None) -> None:
        super().__init__()
        self.model, self.capacity, self.counts = model, capacity, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is not TOPK:
            return func(*args, **kwargs)
        x, k = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        if x.dim() != 2 or dim not in (-1, 1) or not largest:
            return func(*args, **kwargs)
        tokens, experts = int(x.shape[0]), int(x.shape[1])
        if self.counts is None:
            counts = worst_counts(tokens, k, experts, self.capacity)  # type: ignore[arg-type]
            what = f"the worst routing with at most {self.capacity} tokens per expert"
        else:
            counts = list(self.counts)
            if len(counts) != experts or sum(counts) != tokens * k or not all(0 <= c <= tokens for c in counts):
                raise RematError(f"tokens per expert {counts} is not a routing of {tokens} tokens to top-{k} of "
                                 f"{experts} experts: {experts} counts, each 0..{tokens}, summing to {tokens * k}")
            what = "the routing given"
        setattr(self.model, ROUTING_NOTE,
                f"the routing is bound, not this batch's: every router top-{k} over {experts} experts chooses "
                f"{what} (tokens per expert {', '.join(map(str, counts))}: remat_pass.graph.routing)")
        indices = routing_indices(counts, tokens, k).to(x.device)
        return torch.gather(x, 1, indices), indices


def bound_routing(model: torch.nn.Module, capacity: int) -> torch.nn.Module:
    """Make ``model``'s router take the worst routing under ``capacity`` tokens per
    expert (module docstring) from now on, in place (its ``forward`` is wrapped);
    returns ``model``. Trace it as usual: the figures hold for that routing, and the
    JointGraph's notes say so (``ROUTING_NOTE``).

    Raises:
        RematError: ``capacity`` < 1; when the model runs, a bound that cannot hold
            (``worst_counts``).
    """
    if not isinstance(capacity, int) or capacity < 1:
        raise RematError(f"the routing capacity must be a whole number of tokens >= 1, not {capacity!r}")
    return _wrap(model, capacity, None)


def force_routing(model: torch.nn.Module, counts: list[int]) -> torch.nn.Module:
    """Make ``model``'s router give expert e exactly ``counts[e]`` tokens (laid out by
    ``routing_indices``), in place; returns ``model``: the figures of a routing chosen
    by hand ("what if the router sends everything to two experts").

    Raises:
        RematError: when the model runs, ``counts`` is not a routing of its tokens.
    """
    return _wrap(model, None, list(counts))


def _wrap(model: torch.nn.Module, capacity: int | None, counts: list[int] | None) -> torch.nn.Module:
    unbound_routing(model)
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with _ForcedRouting(model, capacity, counts):
            return original(*args, **kwargs)

    forward.__remat_original__ = original  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    return model


def unbound_routing(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``bound_routing`` (nothing when it was not applied); returns ``model``."""
    original = getattr(model.__dict__.get("forward"), "__remat_original__", None)
    if original is not None:
        del model.forward
        model.__dict__.pop(ROUTING_NOTE, None)
    return model
