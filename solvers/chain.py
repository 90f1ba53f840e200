"""The chain model of a layer stack under full recompute: per-layer costs in, the peak
and recompute of a schedule out (its exact solvers: ``solvers.chain_search``).

A schedule splits the L layers of the stack into *recomputed groups* of consecutive
layers (any sizes) and *stored* layers (anywhere). The model predicts its peak bytes
from per-layer costs, all plain integers (bytes, FLOPs) calibrated from the graph's
liveness (``remat_pass.plan.chain_calibration.chain_costs``):

- ``M(<p)``: bytes saved in forward by the layers before ``p`` and still held in
  backward: ``stored_saved_bytes[i]`` for a stored layer, ``last_saved_bytes[i]`` for
  the last layer of a group (its output, the next checkpoint), ``member_saved_bytes[i]``
  for the other members (RNG states).
- Forward of layer j: ``M(<j) + stored_forward_bytes[j]`` (stored) or, in a group
  starting at p, ``M(<p) + sum(member_saved_bytes[p:j]) + recomputed_forward_bytes[j]``.
- Backward of layer j: ``M(<j) + stored_backward_bytes[j]`` (stored) or, in a group
  starting at p, ``M(<p) + sum(carry_bytes[p:j]) + recomputed_backward_bytes[j]``: the
  layers of the group below j were rebuilt together with j and are still live.
- The head (final norm, logits, loss and their backward): ``M(<L) + head_bytes``; the
  rest of the outer region: ``outer_bytes``.
- Several layer stacks (an encoder and a decoder) form one chain, stack after stack;
  ``stack_starts`` lists the first layer of every stack after the first, and no group
  spans a stack boundary (a group is rebuilt from one saved input).
- Between two stacks, the outer steps there (the encoder's final norm, the decoder's
  embedding, and their backward) are ``M(<b) + `` a ``StackGap`` term at the boundary b
  (``stack_gaps``, one per entry of ``stack_starts``): its forward term with or without
  groups in the schedule, its backward term with or without a group below b (the values
  saved once for the groups, below, are in the grouped terms). Without them a
  constant ``outer_bytes`` would count the encoder's stored activations there in every
  schedule.
- A schedule with at least one group also saves ``shared_checkpoint_bytes``: outer
  values every group reads (an attention mask), saved once. They are live in every
  forward region, the head, and the backward of every layer above the lowest group
  (they die at the lowest group's recompute, before its backward).
- Op-level options (``stored_options``): a stored layer may instead keep only part of
  its activations and recompute the rest inside its own backward (a ``StoredOption``:
  its saved bytes, forward and backward peaks above ``M(<j)``, and recompute cost).
  Option 0 is the plain stored layer above, at no recompute.

The peak is the largest of these. Recompute costs add up per layer
(``last_recompute_flops`` / ``member_recompute_flops``; options carry their own, in the
same unit).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from .errors import InvalidSchedule


class StoredOption(NamedTuple):
    """One way to store a layer that recomputes part of it in its own backward.

    Attributes:
        saved_bytes: bytes it holds from forward into backward.
        forward_bytes: its forward peak above ``M(<j)`` (bytes).
        backward_bytes: its backward peak above ``M(<j)`` (bytes).
        recompute_flops: its recompute cost (FLOPs, or the caller's integer cost unit).
        name: a label (e.g. the op-level policy it came from).
    """

    saved_bytes: int
    forward_bytes: int
    backward_bytes: int
    recompute_flops: int
    name: str = ""


class StackGap(NamedTuple):
    """The outer steps between two layer stacks, above ``M(<b)`` (b: the later stack's
    first layer), in bytes.

    Attributes:
        forward_bytes: their forward peak in a schedule without groups.
        forward_grouped_bytes: the same with a group anywhere.
        backward_bytes: their backward peak with no group below b.
        backward_grouped_bytes: the same with a group below b.
    """

    forward_bytes: int
    forward_grouped_bytes: int
    backward_bytes: int
    backward_grouped_bytes: int

    def forward(self, grouped: bool) -> int:
        """The forward term (bytes) with or without groups in the schedule."""
        return self.forward_grouped_bytes if grouped else self.forward_bytes

    def backward(self, group_below: bool) -> int:
        """The backward term (bytes) with or without a group below the boundary."""
        return self.backward_grouped_bytes if group_below else self.backward_bytes


@dataclasses.dataclass(frozen=True)
class ChainCosts:
    """Per-layer costs of a layer stack (bytes and FLOPs, plain ints; length L each).

    See the module docstring for how each enters the peak. ``stored_options[i]`` lists
    layer i's op-level options (empty: none; the whole tuple may be empty).
    ``stack_starts``: the first layer of each stack after the first when the chain is
    several stacks (no group spans one of these boundaries); empty for one stack.
    ``stack_gaps``: the outer steps at each of those boundaries (``StackGap``; empty:
    none modelled there).
    """

    stored_saved_bytes: tuple[int, ...]
    last_saved_bytes: tuple[int, ...]
    member_saved_bytes: tuple[int, ...]
    stored_forward_bytes: tuple[int, ...]
    recomputed_forward_bytes: tuple[int, ...]
    stored_backward_bytes: tuple[int, ...]
    recomputed_backward_bytes: tuple[int, ...]
    carry_bytes: tuple[int, ...]
    last_recompute_flops: tuple[int, ...]
    member_recompute_flops: tuple[int, ...]
    head_bytes: int
    outer_bytes: int
    forward_flops: int = 0
    shared_checkpoint_bytes: int = 0
    stored_options: tuple[tuple[StoredOption, ...], ...] = ()
    stack_starts: tuple[int, ...] = ()
    stack_gaps: tuple[StackGap, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.stored_saved_bytes)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("stack_starts", "stack_gaps") or (f.name == "stored_options" and not v):
                continue
            if isinstance(v, tuple) and len(v) != n:
                raise ValueError(f"ChainCosts.{f.name} has {len(v)} entries for L={n} layers")
        if list(self.stack_starts) != sorted(set(self.stack_starts)) or any(
                not 0 < s < n for s in self.stack_starts):
            raise ValueError(f"ChainCosts.stack_starts {self.stack_starts} are not increasing layers in 1..{n - 1}")
        if self.stack_gaps and len(self.stack_gaps) != len(self.stack_starts):
            raise ValueError(f"ChainCosts.stack_gaps has {len(self.stack_gaps)} entries for "
                             f"{len(self.stack_starts)} stack boundaries")

    def gap_at(self, boundary: int) -> StackGap | None:
        """The ``StackGap`` at a layer boundary (None: no stack starts there, or none is
        modelled)."""
        if not self.stack_gaps or boundary not in self.stack_starts:
            return None
        return self.stack_gaps[self.stack_starts.index(boundary)]

    def stack_end(self, layer: int) -> int:
        """One past the last layer of the stack holding ``layer`` (L for the last stack)."""
        return min((s for s in self.stack_starts if s > layer), default=self.num_layers)

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.stored_saved_bytes)

    def options(self, layer: int) -> list[StoredOption]:
        """Layer ``layer``'s ways to be stored: option 0 keeps everything (no recompute),
        then ``stored_options[layer]``."""
        plain = StoredOption(self.stored_saved_bytes[layer], self.stored_forward_bytes[layer],
                             self.stored_backward_bytes[layer], 0, "stored")
        return [plain, *(self.stored_options[layer] if self.stored_options else ())]


@dataclasses.dataclass(frozen=True)
class Solution:
    """One schedule of the chain model.

    Attributes:
        groups: the recomputed groups (tuples of consecutive layers); others stored.
        peak_bytes: the model's peak.
        recompute_flops: the model's recompute cost.
        options: the option index (``ChainCosts.options``) of every layer, 0 for layers
            in a group; empty when every stored layer uses option 0.
    """

    groups: tuple[tuple[int, ...], ...]
    peak_bytes: int
    recompute_flops: int
    options: tuple[int, ...] = ()


class _GroupTerms(NamedTuple):
    """What a recomputed group p..q adds: its peak above M(<p) (bytes), the bytes it
    saves, its recompute FLOPs, and its forward peak above M(<p) (bytes)."""

    peak_above_bytes: int
    saved_bytes: int
    recompute_flops: int
    forward_peak_above_bytes: int


def _group_terms_from(c: ChainCosts, p: int) -> list[_GroupTerms]:
    """The terms of groups p..q for q = p .. L-1, in one pass (index q - p)."""
    out = []
    member_saved = carry = flops = 0
    fw = bw = 0
    for q in range(p, c.num_layers):
        fw = max(fw, member_saved + c.recomputed_forward_bytes[q])
        bw = max(bw, carry + c.recomputed_backward_bytes[q])
        out.append(_GroupTerms(max(fw, bw), member_saved + c.last_saved_bytes[q],
                               flops + c.last_recompute_flops[q], fw))
        member_saved += c.member_saved_bytes[q]
        carry += c.carry_bytes[q]
        flops += c.member_recompute_flops[q]
    return out


def _group_terms(c: ChainCosts, p: int, q: int) -> _GroupTerms:
    """The terms of group p..q (see ``_GroupTerms``)."""
    return _group_terms_from(c, p)[q - p]


def model_peak(c: ChainCosts, groups: Sequence[Sequence[int]], options: Sequence[int] = ()) -> Solution:
    """The chain model's peak and recompute cost of one schedule.

    Args:
        c: the chain costs.
        groups: the recomputed groups.
        options: per layer, the index into ``c.options(layer)`` of a stored layer
            (empty: 0 for every layer).

    Raises:
        InvalidSchedule: a group is not a run of consecutive layers in 0..L-1, groups
            overlap, a group spans two stacks, or an option index does not exist.
    """
    start_of: dict[int, int] = {}
    covered: set[int] = set()
    for g in groups:
        g = list(g)
        if not g or g != list(range(g[0], g[0] + len(g))) or g[0] < 0 or g[-1] >= c.num_layers:
            raise InvalidSchedule(f"group {g} is not a run of consecutive layers in 0..{c.num_layers - 1}")
        if covered & set(g):
            raise InvalidSchedule(f"group {g} overlaps another group")
        if g[-1] >= c.stack_end(g[0]):
            raise InvalidSchedule(f"group {g} spans two layer stacks (stacks start at 0 {c.stack_starts})")
        covered |= set(g)
        start_of[g[0]] = g[-1]
    opts = tuple(options) or (0,) * c.num_layers
    if len(opts) != c.num_layers:
        raise InvalidSchedule(f"{len(opts)} option indices for L={c.num_layers} layers")
    x = c.shared_checkpoint_bytes if start_of else 0
    m = peak = flops = 0
    seen_group = False
    i = 0
    while i < c.num_layers:
        gap = c.gap_at(i)
        if gap is not None:
            peak = max(peak, m + gap.forward(bool(start_of)), m + gap.backward(seen_group))
        if i in start_of:
            q = start_of[i]
            g = _group_terms(c, i, q)
            peak = max(peak, m + g.peak_above_bytes + (x if seen_group else 0))
            m += g.saved_bytes
            flops += g.recompute_flops
            seen_group = True
            i = q + 1
        else:
            choices = c.options(i)
            if not 0 <= opts[i] < len(choices):
                raise InvalidSchedule(f"layer {i} has options 0..{len(choices) - 1}, not {opts[i]}")
            o = choices[opts[i]]
            peak = max(peak, m + x + o.forward_bytes, m + (x if seen_group else 0) + o.backward_bytes)
            m += o.saved_bytes
            flops += o.recompute_flops
            i += 1
    peak = max(peak, m + x + c.head_bytes, c.outer_bytes)
    used = tuple(0 if l in covered else opts[l] for l in range(c.num_layers))
    return Solution(tuple(tuple(g) for g in groups), peak, flops, used if any(used) else ())


def saved_at_boundaries(c: ChainCosts, sol: Solution) -> list[int]:
    """M at every layer boundary 0..L of a schedule (inside a group: M at its start)."""
    start_of = {g[0]: g[-1] for g in sol.groups}
    opts = sol.options or (0,) * c.num_layers
    out, m, i = [], 0, 0
    while i < c.num_layers:
        if i in start_of:
            q = start_of[i]
            out += [m] * (q - i + 1)
            m += _group_terms(c, i, q).saved_bytes
            i = q + 1
        else:
            out.append(m)
            m += c.options(i)[opts[i]].saved_bytes
            i += 1
    return out + [m]
