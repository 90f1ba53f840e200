"""The node-level decision of a schedule: which forward values are saved (and why),
which are recomputed in which segment, and the order segments run in backward.

``partition(joint, stack, schedule)`` turns a layer-level Schedule into a Partition;
``rewrite.rewrite`` builds the forward and backward graphs from a Partition only, so a
schedule that is not layer-level (an op-level policy) produces a Partition directly:
``op_level_partition(joint, stack, choice, schedule)`` (see ``OpLevelChoice`` and the
op-level rules at the end of this docstring).

For every recomputed group g (layers ``schedule.groups[g]``), Megatron-LM's full
recompute (``--recompute-granularity full``; ``CheckpointFunction`` in
``megatron/core/tensor_parallel/random.py``):

- The values of group g that group g's backward reads are recomputed from the group's
  inputs (checkpoints: values defined outside the group and read by the recomputed
  nodes). Checkpoints are saved; a checkpoint shared by many groups (a mask, a rotary
  table) is saved once.
- The recompute segment runs immediately before the first backward node that reads a
  recomputed value of group g (the start of group g's backward), so one group's
  recomputed values are live at a time, and each dies at its last backward use.
- A value of group g that a backward node of *another* layer or of the outer region
  reads (the group's output, read by the next layer's or the final norm's backward) is
  saved: recomputing it there would rebuild the group early.
- Random ops in a segment replay the forward's RNG state (``rewrite`` does it).

Everything outside the groups (stored layers, outer) follows ``none``: every forward
value backward reads is saved, as AOTAutograd's ``default_partition`` does.

Op-level (``op_level_partition``): in the stored layers, a policy names the values it
does not keep (``OpLevelChoice.recomputable``). A value backward reads is recomputed
when the policy does not keep it, unless a backward node outside its layer reads it or
the policy must save it (``must_save``); its recompute runs its ancestors back to values
that are saved, kept by the policy (they become saved: JAX's "saveable" semantics,
``jax.checkpoint`` policies), primals, or lie outside its layer (saved as checkpoints).
Each recomputed value is rebuilt just in time: a segment runs right before the first
backward node that reads a value not rebuilt yet, and rebuilds it with the ancestors not
rebuilt yet, so a recomputed value lives from its first backward use to its last (as
PyTorch's selective activation checkpointing and Megatron-LM's
``--recompute-granularity selective``, which recompute core attention inside its own
backward). Random ops replay the forward's RNG state. Layers in the schedule's groups
are recomputed whole, as above.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Mapping

import torch.fx as fx

from ..graph.costs import is_random, tensor_val
from ..errors import InvalidSchedule
from ..graph.forward_nodes import input_closure
from ..graph.regions import LayerStack
from .schedule import Schedule, none
from ..graph.trace import JointGraph

SAVE_REASONS = (
    "checkpoint",              # a recompute segment starts from it
    "read outside its group",  # a recomputed group's value read by another layer's backward
    "stored layer",            # read by the backward of a layer that is not recomputed
    "outer",                   # read by the backward of the outer region
    "user-saved",              # named by the user (save_only_these_names)
    "saved by policy",         # an op-level policy chose to save it
    "random op",               # a random op that is not recomputed
    "mutated input",           # read after an in-place update of an input
    "read outside its layer",  # an op-level layer's value read by another layer's backward
    "read outside its module",  # a recomputed module's value read by backward outside it
)


@dataclasses.dataclass(frozen=True)
class SavedValue:
    """One forward value that forward hands to backward.

    Attributes:
        name: the joint-graph node.
        reason: why it is saved, one of ``SAVE_REASONS``.
        detail: the evidence, e.g. ``"read by the backward of layer 2 (mm_3), outside
            the group"``; empty when the reason says it all.
    """

    name: str
    reason: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in SAVE_REASONS:
            raise InvalidSchedule(f"saved value {self.name}: reason {self.reason!r} is not one of {SAVE_REASONS}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One recompute, as it runs in backward.

    Attributes:
        group: index of the recomputed unit (``Schedule.groups`` for a layer schedule).
        layers: its layers.
        nodes: joint-graph names of the recomputed forward nodes, in run order.
        checkpoints: saved forward values the segment reads (sorted names; primals are
            not listed).
        insert_before: the backward node the segment runs just before.
        rng_replayed: recomputed random ops that replay the forward's RNG state.
    """

    group: int
    layers: tuple[int, ...]
    nodes: tuple[str, ...]
    checkpoints: tuple[str, ...]
    insert_before: str
    rng_replayed: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Partition:
    """The node-level recompute decision for one joint graph.

    Attributes:
        provenance: what produced it, e.g. ``uniform(K=4)``.
        saved: the saved values with their reasons, in joint-graph order (RNG states of
            replayed random ops are not listed: ``rewrite`` adds one per
            ``Segment.rng_replayed``).
        segments: the recompute segments in the order they run in backward.
        schedule: the layer-level Schedule it came from: its groups are recomputed whole
            (None: no layer-level schedule).
        policy: the op-level policy of the stored layers (``dots_saveable``,
            ``selective(core_attn)``, ...); None for a layer-level partition.
    """

    provenance: str
    saved: tuple[SavedValue, ...]
    segments: tuple[Segment, ...]
    schedule: Schedule | None = None
    policy: str | None = None

    @property
    def saved_names(self) -> tuple[str, ...]:
        """Names of the saved values, in joint-graph order."""
        return tuple(s.name for s in self.saved)

    @property
    def forced_saves(self) -> dict[str, str]:
        """Values of a recomputed group saved because another layer's backward reads
        them: ``{name: detail}`` in graph order."""
        return {s.name: s.detail for s in self.saved if s.reason == "read outside its group"}

    @property
    def recomputed_names(self) -> tuple[str, ...]:
        """Every recomputed node, segment by segment in run order."""
        return tuple(n for seg in self.segments for n in seg.nodes)

    def reason_of(self, name: str) -> SavedValue | None:
        """The SavedValue called ``name`` (None when it is not saved)."""
        return next((s for s in self.saved if s.name == name), None)


@dataclasses.dataclass(frozen=True)
class _Graph:
    """What partitioning reads of a joint graph and its layer stack."""

    nodes: list[fx.Node]
    order: dict[fx.Node, int]
    forward: set[fx.Node]            # forward nodes, primals included
    forward_computed: set[fx.Node]   # forward nodes that are not primals
    backward_readers: dict[fx.Node, list[fx.Node]]  # forward value -> backward nodes reading it
    layer: Mapping[str, int | None]


def _read_graph(joint: JointGraph, stack: LayerStack) -> _Graph:
    nodes = list(joint.gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    forward = {by_name[name] for name in stack.forward_nodes}
    primals = {by_name[p] for p in joint.primals}
    forward_computed = forward - primals
    readers: dict[fx.Node, list[fx.Node]] = {}
    for b in nodes:
        if b in forward or b.op != "call_function":
            continue
        for a in b.all_input_nodes:
            if a in forward_computed:
                readers.setdefault(a, []).append(b)
    return _Graph(nodes, {n: i for i, n in enumerate(nodes)}, forward, forward_computed, readers, stack.layer_of)


def _outside_reader(g: _Graph, value: fx.Node, group: tuple[int, ...]) -> str | None:
    """Why ``value`` of ``group`` must be saved: a backward reader in another layer."""
    for b in g.backward_readers.get(value, ()):
        other = g.layer[b.name]
        if other not in group:
            where = f"layer {other}" if other is not None else "the outer region"
            return f"read by the backward of {where} ({b.name}), outside the group"
    return None


def _recompute_sets(g: _Graph, members: list[set[fx.Node]], forced: set[fx.Node]
                    ) -> tuple[list[set[fx.Node]], set[fx.Node]]:
    """Per group, the nodes to recompute, and the checkpoints (fixed point: a value
    that becomes a checkpoint stops the closure of every group)."""
    checkpoints: set[fx.Node] = set()
    recompute: list[set[fx.Node]] = [set() for _ in members]
    non_tensors = {v for v in g.forward_computed if tensor_val(v) is None}
    for _ in range(len(g.nodes) + 1):
        stop = forced | checkpoints
        new_checkpoints: set[fx.Node] = set()
        for gi, group_members in enumerate(members):
            needed = [v for v in group_members if v in g.backward_readers and v not in stop]
            # a multi-output op stays with the getitems that read it
            allowed = group_members | non_tensors
            r = input_closure(needed, lambda a: a in allowed and a not in stop)
            recompute[gi] = r
            for v in r:
                for a in v.all_input_nodes:
                    if a in g.forward_computed and a not in r:
                        new_checkpoints.add(a)
        if new_checkpoints == checkpoints:
            break
        checkpoints = new_checkpoints
    return recompute, checkpoints


def partition(joint: JointGraph, stack: LayerStack, schedule: Schedule) -> Partition:
    """The node-level decision of a layer-level ``schedule`` on ``joint``.

    Args:
        joint: the traced step (not modified).
        stack: the layer stack and the layer of every joint node (``assign_layers``).
        schedule: which layers are recomputed, in which groups (Megatron-LM semantics,
            see ``schedule.py``).

    Returns:
        The Partition: saved values in graph order with their reasons, segments in the
        order they run (a group whose values backward never reads has no segment).

    Raises:
        InvalidSchedule: the schedule is for another number of layers than the stack,
            or for other stack sizes (build it from ``stack.layers_per_stack``).

    Example:
        >>> from remat_pass.models import linear_chain
        >>> from remat_pass.graph.regions import assign_layers
        >>> from remat_pass.graph.trace import trace_joint
        >>> from remat_pass.recompute import schedule
        >>> joint = trace_joint(*linear_chain(batch=4, width=8, layers=4))
        >>> p = partition(joint, assign_layers(joint), schedule.uniform(2, 4))
        >>> p.saved, [s.layers for s in p.segments]
        ((SavedValue(name='addmm_1', reason='read outside its group', detail='read by the backward of layer 2 (mm_3), outside the group'),), [(2, 3), (0, 1)])
    """
    if schedule.num_layers != stack.num_layers:
        raise InvalidSchedule(
            f"schedule {schedule.provenance} is for L={schedule.num_layers} layers but the "
            f"layer stack {stack.path!r} has L={stack.num_layers}"
        )
    if (schedule.stack_sizes or (schedule.num_layers,)) != stack.layers_per_stack:
        raise InvalidSchedule(
            f"schedule {schedule.provenance} is for layer stacks of "
            f"{', '.join(map(str, schedule.stack_sizes or (schedule.num_layers,)))} layers but the step's "
            f"stacks are {stack.describe()}: build it from stack.layers_per_stack"
        )
    g = _read_graph(joint, stack)
    members = [{n for n in g.forward_computed if g.layer[n.name] in grp} for grp in schedule.groups]
    forced: dict[fx.Node, str] = {}
    for grp, group_members in zip(schedule.groups, members):
        for v in group_members:
            why = _outside_reader(g, v, grp)
            if why is not None:
                forced[v] = why
    recompute, checkpoints = _recompute_sets(g, members, set(forced))
    recomputed_any = set().union(*recompute)
    saved_nodes = sorted({v for v in g.backward_readers if v not in recomputed_any} | checkpoints,
                         key=g.order.__getitem__)
    saved = tuple(_saved_value(v, forced, checkpoints, g.layer) for v in saved_nodes)

    # each segment runs before the first backward node reading its values
    placed: list[tuple[int, int, list[fx.Node], fx.Node]] = []
    for gi, r in enumerate(recompute):
        readers = [b for v in r for b in g.backward_readers.get(v, ())]
        if readers:
            first = min(readers, key=g.order.__getitem__)
            placed.append((g.order[first], gi, sorted(r, key=g.order.__getitem__), first))
    placed.sort(key=lambda p: (p[0], p[1]))
    segments = tuple(
        Segment(
            group=gi,
            layers=schedule.groups[gi],
            nodes=tuple(v.name for v in seg_nodes),
            checkpoints=tuple(sorted({a.name for v in seg_nodes for a in v.all_input_nodes
                                      if a in g.forward_computed and a not in set(seg_nodes)})),
            insert_before=first.name,
            rng_replayed=tuple(v.name for v in seg_nodes if is_random(v)),
        )
        for _, gi, seg_nodes, first in placed
    )
    return Partition(schedule.provenance, saved, segments, schedule)


def _saved_value(v: fx.Node, forced: dict[fx.Node, str], checkpoints: set[fx.Node],
                 layer: Mapping[str, int | None]) -> SavedValue:
    if v in forced:
        return SavedValue(v.name, "read outside its group", forced[v])
    if v in checkpoints:
        return SavedValue(v.name, "checkpoint")
    return SavedValue(v.name, "outer" if layer[v.name] is None else "stored layer")


# --------------------------------------------------------------------------- op-level


@dataclasses.dataclass(frozen=True)
class OpLevelChoice:
    """What an op-level policy decides for the stored layers of a step.

    Attributes:
        name: the policy, e.g. ``dots_saveable`` (becomes ``Partition.policy``).
        recomputable: joint forward nodes the policy does not keep; recomputed when
            backward reads them (a node of a multi-output op follows its op).
        must_save: nodes saved whatever ``recomputable`` says, ``{name: (reason,
            detail)}`` with a reason of ``SAVE_REASONS``.
        kept_reason: the reason of the values the policy keeps (``saved by policy``,
            ``user-saved``, ``stored layer``), and its detail.
    """

    name: str
    recomputable: frozenset[str]
    must_save: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    kept_reason: tuple[str, str] = ("saved by policy", "")


def op_level_partition(joint: JointGraph, stack: LayerStack, choice: OpLevelChoice,
                       schedule: Schedule | None = None) -> Partition:
    """The Partition of an op-level policy in the stored layers of ``schedule``.

    Args:
        joint, stack: the traced step and its layer stack (``assign_layers``).
        choice: the policy's decision (see ``OpLevelChoice`` and the module docstring).
        schedule: the layer-level groups, recomputed whole (default: none, every layer
            follows the policy).

    Returns:
        The Partition: saved values in graph order with reasons, the groups' segments
        and the just-in-time segments of the op-level layers, in the order they run.

    Raises:
        InvalidSchedule: ``schedule`` is for another number of layers than the stack.

    Example:
        >>> from remat_pass.models import linear_chain
        >>> from remat_pass.graph.regions import assign_layers
        >>> from remat_pass.graph.trace import trace_joint
        >>> joint = trace_joint(*linear_chain(batch=4, width=8, layers=3))
        >>> stack = assign_layers(joint)
        >>> p = op_level_partition(joint, stack, OpLevelChoice("nothing_saveable", frozenset(stack.forward_nodes)))
        >>> [(s.name, s.reason) for s in p.saved], [(s.nodes, s.insert_before) for s in p.segments]
        ([('addmm', 'read outside its layer'), ('addmm_1', 'read outside its layer')], [(('t_2',), 't_3'), (('t_1',), 't_7')])
    """
    base = partition(joint, stack, schedule or none(stack.layers_per_stack))
    g = _read_graph(joint, stack)
    by_name = {n.name: n for n in g.nodes}
    grouped = {i for grp in base.schedule.groups for i in grp}
    op_layers = {i for i in range(stack.num_layers) if i not in grouped}
    in_op = {v for v in g.forward_computed if g.layer[v.name] in op_layers}
    saved: dict[fx.Node, tuple[str, str]] = {}
    for s_ in base.saved:  # outer values and the groups' saves stay
        v = by_name[s_.name]
        if v not in in_op or s_.reason == "checkpoint":
            saved[v] = (s_.reason, s_.detail)
    for name, why in choice.must_save.items():
        if by_name.get(name) in in_op:
            saved.setdefault(by_name[name], why)
    for v in in_op:
        if v in g.backward_readers and v not in saved:
            why = _outside_reader(g, v, (g.layer[v.name],))
            if why is not None:
                saved[v] = ("read outside its layer", why.replace("outside the group", "outside the layer"))

    def recomputable(v: fx.Node) -> bool:
        owner = v.args[0] if v.target is operator.getitem and isinstance(v.args[0], fx.Node) else v
        return owner.name in choice.recomputable or tensor_val(owner) is None and owner is v

    recompute: set[fx.Node] = set()
    todo = [v for v in in_op if v in g.backward_readers and v not in saved and recomputable(v)]
    while todo:
        v = todo.pop()
        if v in recompute:
            continue
        recompute.add(v)
        for a in v.all_input_nodes:
            if a not in g.forward_computed or a in saved or a in recompute:
                continue
            if g.layer[a.name] != g.layer[v.name] or a not in in_op:
                saved[a] = ("checkpoint", f"read by the recompute of {v.name} (layer {g.layer[v.name]})")
            elif recomputable(a):
                todo.append(a)
            else:
                saved[a] = choice.kept_reason
    for v in in_op:  # the rest of what backward reads is kept
        if v in g.backward_readers and v not in recompute and v not in saved:
            saved[v] = choice.kept_reason
    segments = list(base.segments) + _just_in_time_segments(g, recompute, set(saved), len(base.schedule.groups))
    segments.sort(key=lambda seg: (g.order[by_name[seg.insert_before]], seg.group))
    saved_values = tuple(SavedValue(v.name, *saved[v]) for v in sorted(saved, key=g.order.__getitem__))
    policy = choice.name
    provenance = policy if not grouped else f"{base.provenance} + {policy}"
    return Partition(provenance, saved_values, tuple(segments), base.schedule, policy)


def _just_in_time_segments(g: _Graph, recompute: set[fx.Node], saved: set[fx.Node], first_group: int
                           ) -> list[Segment]:
    """One segment before each backward node that reads a recomputed value not rebuilt
    yet: that value and its recomputed ancestors not rebuilt yet, in graph order."""
    done: set[fx.Node] = set()
    out: list[Segment] = []
    for b in g.nodes:
        if b.op != "call_function" or b in g.forward:
            continue
        wanted = [a for a in b.all_input_nodes if a in recompute and a not in done]
        if not wanted:
            continue
        nodes = input_closure(wanted, lambda a: a in recompute and a not in done)
        done |= nodes
        ordered = sorted(nodes, key=g.order.__getitem__)
        out.append(Segment(
            group=first_group + len(out),
            layers=tuple(sorted({g.layer[v.name] for v in ordered if g.layer[v.name] is not None})),
            nodes=tuple(v.name for v in ordered),
            checkpoints=tuple(sorted({a.name for v in ordered for a in v.all_input_nodes if a in saved})),
            insert_before=b.name,
            rng_replayed=tuple(v.name for v in ordered if is_random(v)),
        ))
    return out
