"""Find the layer stacks of a model and give every joint-graph node its layer index.

A layer stack is a repeated block list (GPT-2's ``transformer.h``): an ``nn.ModuleList``
/ ``nn.Sequential`` whose children all have one class. A model may have several (T5's
``encoder.block`` and ``decoder.block``, any encoder-decoder): every such container that
the step calls and that sits inside no layer of another is a stack. Their layers form
one chain, numbered 0..L-1 stack after stack in the order the forward first runs them
(T5: encoder layers 0..5, decoder layers 6..11); ``LayerStack.stacks`` says where each
stack's layers are. A node belongs to layer i when the module path recorded on it
(``nn_module_stack`` for forward nodes, ``fwd_nn_module_stack`` for backward nodes) lies
under that layer's module. Everything else is *outer* (layer ``None``): embeddings,
final norms, head, loss.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from .costs import is_random
from ..errors import LayerStackNotFound
from .module_paths import recorded_paths
from .trace import JointGraph


@dataclasses.dataclass(frozen=True)
class StackSpan:
    """One layer stack inside the chain of a step's stacks.

    Attributes:
        path: module path of the stack (``"decoder.block"``).
        child_names: its child names in order (``"0"``, ``"1"``, ...).
        first_layer: the chain index of its layer 0 (its layer j is chain layer
            ``first_layer + j``).
    """

    path: str
    child_names: tuple[str, ...]
    first_layer: int

    @property
    def num_layers(self) -> int:
        """The number of layers of this stack."""
        return len(self.child_names)

    @property
    def layers(self) -> range:
        """Its chain layer indices."""
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The layer stack (or the chain of several stacks) of a traced step.

    Attributes:
        path: module path of the stack (e.g. ``"transformer.h"``); for several stacks,
            their paths joined by ``", "`` in chain order.
        child_names: the stack's child names in order (``"0"``, ``"1"``, ...); for
            several stacks, each stack's child names, stack after stack.
        num_layers: L, the number of layers (of all stacks together).
        layer_of: joint node name -> layer index in 0..L-1, or None for outer nodes.
        forward_nodes: names of the joint graph's forward nodes (ancestors of the
            forward outputs, placeholders included), in graph order.
        stack_spans: the stacks when there are several, in chain order; empty for one
            (see ``stacks``).
    """

    path: str
    child_names: tuple[str, ...]
    num_layers: int
    layer_of: Mapping[str, int | None]
    forward_nodes: tuple[str, ...]
    stack_spans: tuple[StackSpan, ...] = ()

    @property
    def stacks(self) -> tuple[StackSpan, ...]:
        """Every stack of the chain in chain order (one for a single stack)."""
        return self.stack_spans or (StackSpan(self.path, tuple(self.child_names), 0),)

    @property
    def layers_per_stack(self) -> tuple[int, ...]:
        """L of each stack in chain order: what ``schedule.uniform`` / ``block`` /
        ``megatron_schedules`` take to apply per stack (``(12,)`` for GPT-2)."""
        return tuple(s.num_layers for s in self.stacks)

    def layer_path(self, layer: int) -> str:
        """The module path of chain layer ``layer`` (``"decoder.block.1"``).

        Raises:
            IndexError: ``layer`` is outside 0..L-1.
        """
        for s in self.stacks:
            if layer in s.layers:
                return _join(s.path, s.child_names[layer - s.first_layer])
        raise IndexError(f"layer {layer} is outside 0..{self.num_layers - 1}")

    def describe(self) -> str:
        """E.g. ``'transformer.h' (L=12)`` or ``'encoder.block' (layers 0-5), 'decoder.block' (layers 6-11)``."""
        if len(self.stacks) == 1:
            return f"{self.path!r} (L={self.num_layers})"
        return ", ".join(f"{s.path!r} (layers {s.first_layer}-{s.first_layer + s.num_layers - 1})"
                         for s in self.stacks)

    def nodes_of_layer(self, layer: int) -> list[str]:
        """Names of the forward and backward nodes of ``layer``, in graph order."""
        return [n for n, i in self.layer_of.items() if i == layer]


def find_layer_stack(model: torch.nn.Module, layers: str | None = None) -> tuple[str, list[str]]:
    """The layer stack's module path and its child names (the longest stack when the
    model has several; ``find_layer_stacks`` finds them all).

    Args:
        model: the module.
        layers: module path of the stack (``"transformer.h"``); None to search for the
            longest ``nn.ModuleList`` / ``nn.Sequential`` of two or more children of one
            class (ties: the first in ``named_modules`` order), leaving out containers
            that sit inside a layer of another such container (MoE experts).

    Returns:
        ``(path, child_names)``.

    Raises:
        LayerStackNotFound: ``layers`` names no ModuleList/Sequential of the model, no
            such container with two or more same-class children exists, or one module
            instance sits at two positions of a container.
    """
    if layers is not None:
        return find_layer_stacks(model, layers)[0]
    found = find_layer_stacks(model)
    return max(found, key=lambda c: len(c[1]))  # max keeps the first of equal lengths


def find_layer_stacks(model: torch.nn.Module, layers: str | Sequence[str] | None = None
                      ) -> list[tuple[str, list[str]]]:
    """Every layer stack of ``model``: module paths and child names.

    Args:
        model: the module.
        layers: the module path of a stack (``"transformer.h"``), several paths
            (``["encoder.block", "decoder.block"]``), or None to search: every
            ``nn.ModuleList`` / ``nn.Sequential`` of two or more children of one class
            that sits inside no layer of another such container (MoE experts and
            attention heads belong to their layer).

    Returns:
        ``[(path, child_names), ...]`` in ``named_modules`` order (named: in the order
        given). Which of them the step calls, and in which order, ``assign_layers``
        decides.

    Raises:
        LayerStackNotFound: a named path is no ModuleList/Sequential of the model, has
            no children, is named twice or lies inside a layer of another named stack;
            (search) no container with two or more same-class children exists; or one
            module instance sits at two positions of a stack.
    """
    containers = {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential))
    }
    if layers is not None:
        return _named_stacks(model, containers, [layers] if isinstance(layers, str) else list(layers))
    for name, mod in containers.items():
        _refuse_shared_children(name, mod)
    candidates = {
        name: [n for n, _ in mod.named_children()]
        for name, mod in containers.items()
        if len(list(mod.children())) >= 2 and len({type(c) for c in mod.children()}) == 1
    }
    found = [(name, kids) for name, kids in candidates.items() if _inside_layer_of(name, candidates) is None]
    if not found:
        raise LayerStackNotFound(
            f"{type(model).__name__} has no layer stack: looked for an nn.ModuleList or "
            "nn.Sequential of two or more children of one class, and found "
            f"{'only ' + ', '.join(repr(c) for c in containers) if containers else 'none'}. "
            "Put the repeated blocks in an nn.ModuleList, or name the stack with "
            "layers='path.to.stack' (--stack on the command line)."
        )
    return found


def _inside_layer_of(name: str, stacks: Mapping[str, Sequence[str]]) -> str | None:
    """The stack of ``stacks`` one of whose layers is or holds the module ``name``, or
    None (a container inside one layer of another: the experts of an MoE layer)."""
    for other, kids in stacks.items():
        if other != name and any(name == _join(other, k) or name.startswith(_join(other, k) + ".")
                                 for k in kids):
            return other
    return None


def _named_stacks(model: torch.nn.Module, containers: Mapping[str, torch.nn.Module],
                  paths: list[str]) -> list[tuple[str, list[str]]]:
    """The stacks the user named (``layers=`` / ``--stack``), validated."""
    if not paths:
        raise LayerStackNotFound("layers= names no stack: give a module path such as 'transformer.h'")
    out: dict[str, list[str]] = {}
    for path in paths:
        if not isinstance(path, str) or path not in containers:
            exists = isinstance(path, str) and path in dict(model.named_modules())
            named = sorted(repr(c) if c else "'' (the model itself)" for c in containers)
            raise LayerStackNotFound(
                f"layers={path!r} " + ("is not an nn.ModuleList or nn.Sequential" if exists else "names no module")
                + f" of {type(model).__name__}; its ModuleLists / Sequentials: {', '.join(named) or 'none'}"
            )
        if path in out:
            raise LayerStackNotFound(f"layers= names the stack {path!r} twice")
        _refuse_shared_children(path, containers[path])
        children = [n for n, _ in containers[path].named_children()]
        if not children:
            raise LayerStackNotFound(f"the layer stack {path!r} has no children")
        out[path] = children
    for path in out:
        outer = _inside_layer_of(path, out)
        if outer is not None:
            raise LayerStackNotFound(
                f"the layer stack {path!r} lies inside a layer of the stack {outer!r}: a layer "
                "cannot belong to two stacks; name one of them"
            )
    return list(out.items())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _refuse_shared_children(path: str, container: torch.nn.Module) -> None:
    """Raise LayerStackNotFound when one module instance sits at two positions."""
    seen: dict[int, str] = {}
    for name, child in container._modules.items():
        if child is None:
            continue
        if id(child) in seen:
            raise LayerStackNotFound(
                f"{_join(path, name)} is the same module instance as "
                f"{_join(path, seen[id(child)])}: a layer used twice cannot be given one "
                "layer index. Give every layer its own module (weights may still be tied "
                "by sharing Parameters), or name another stack with layers="
            )
        seen[id(child)] = name


def input_closure(start: Iterable[fx.Node], follow: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """``start`` and, transitively, the inputs of its nodes that ``follow`` accepts
    (default: every input): the ancestors of ``start`` within a region of the graph."""
    out: set[fx.Node] = set()
    todo = list(start)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(a for a in n.all_input_nodes if a not in out and (follow is None or follow(a)))
    return out


def forward_node_names(gm: fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    """Names of the joint graph's forward nodes, in graph order.

    A node is forward when it is an ancestor of the first ``num_fwd_outputs`` outputs,
    or when AOTAutograd traced it during the forward (``meta["partitioner_tag"] ==
    "is_forward"``: e.g. a layer norm's mean and rstd, read only by backward), or is an
    ancestor of such a node. Primals are forward values even when unused there.
    """
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    roots = [a for a in output.args[0][:num_fwd_outputs] if isinstance(a, fx.Node)]
    roots += [
        n for n in nodes
        if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"
    ]
    seen = input_closure(roots)
    if any(n.name.startswith("tangents") for n in seen):
        raise AssertionError("a forward node depends on a tangent: the joint graph is malformed")
    for n in nodes:
        if n.op == "placeholder" and n.name.startswith("primals"):
            seen.add(n)
    return [n.name for n in nodes if n in seen]


def assign_layers(joint: JointGraph, layers: str | Sequence[str] | None = None) -> LayerStack:
    """Find the layer stacks of ``joint.model`` and the layer of every joint node.

    Forward nodes take the layer of their ``nn_module_stack``; backward nodes that of
    ``fwd_nn_module_stack``. Backward nodes with no recorded stack (gradient
    accumulation, for example) take the layer of the closest earlier backward node that
    has one, since AOTAutograd emits them right after the op whose gradient they sum.

    Args:
        joint: the traced step.
        layers: the stack's module path, several paths, or None to find them (see
            find_layer_stacks); found stacks that the step never calls are left out.

    Returns:
        The LayerStack; ``node.meta["remat_layer"]`` is also set on every joint node.

    Raises:
        LayerStackNotFound: as find_layer_stacks, or no node of the graph lies in a
            named stack, or in any found one (the modules are not called by ``forward``).
    """
    stacks = find_layer_stacks(joint.model, layers)
    if layers is None and len(stacks) > 1:
        return assign_layers_to_stacks(joint.gm, joint.num_fwd_outputs, stacks, drop_uncalled=True)
    return assign_layers_to_stacks(joint.gm, joint.num_fwd_outputs, stacks)


def _layers_of_unrecorded(gm: fx.GraphModule, forward: set[str],
                           layer_of: Mapping[str, int | None]) -> dict[str, int]:
    """Layers for forward ops that carry no module path at all.

    Graph passes create such nodes: under ``dynamic=True`` Dynamo keeps Python floats
    symbolic (``torch._dynamo.config.specialize_float = False``), and
    ``torch/fx/passes/_tensorify_python_scalars.py`` turns a model's float constants
    (GPT-2's attention scaling, gelu_new's ``sqrt(2 / pi)``) into 0-dim tensor ops with
    no ``nn_module_stack``; the attention scores times the scale is then a full-size
    activation outside every layer, which the partition would save. Such a node takes
    the layer of its forward users when they agree on one (visited in reverse graph
    order, so chains of such nodes resolve), else of its inputs when they agree; a
    value shared by several layers, and random ops (their RNG state belongs to no
    layer), stay outer.

    Returns:
        ``{node name: layer}`` for the nodes given a layer.
    """
    layer = dict(layer_of)
    nodes = [n for n in gm.graph.nodes
             if n.op == "call_function" and n.name in forward and layer[n.name] is None
             and not n.meta.get("nn_module_stack") and not is_random(n)]
    changed: dict[str, int] = {}

    def agree(others: Iterable[fx.Node]) -> int | None:
        found = {layer.get(o.name) for o in others} - {None}
        return found.pop() if len(found) == 1 else None

    for n in reversed(nodes):
        got = agree(u for u in n.users if u.name in forward)
        if got is not None:
            layer[n.name] = changed[n.name] = got
    for n in nodes:
        if layer[n.name] is None:
            got = agree(n.all_input_nodes)
            if got is not None:
                layer[n.name] = changed[n.name] = got
    return changed


def assign_layers_to_graph(
    gm: fx.GraphModule, num_fwd_outputs: int, path: str, children: list[str] | tuple[str, ...]
) -> LayerStack:
    """The layer of every node of a joint graph, given the stack's path and children.

    The graph-level half of ``assign_layers``, for callers that hold a joint graph but
    no JointGraph or module (the torch.compile backend). Recorded module paths are
    normalized with ``module_paths.normalize_module_path``.

    Args:
        gm: the joint graph (``primals_*``, ``tangents_*`` placeholders).
        num_fwd_outputs: the joint graph's number of forward outputs.
        path: the stack's module path (``"transformer.h"``).
        children: the stack's child names in order; layer i is ``children[i]``.

    Returns:
        The LayerStack; ``node.meta["remat_layer"]`` is also set on every node.

    Raises:
        LayerStackNotFound: no node of the graph lies in the stack.
    """
    return assign_layers_to_stacks(gm, num_fwd_outputs, [(path, children)])


def assign_layers_to_stacks(
    gm: fx.GraphModule, num_fwd_outputs: int, stacks: Sequence[tuple[str, Sequence[str]]],
    drop_uncalled: bool = False,
) -> LayerStack:
    """The layer of every node of a joint graph, given one or several stacks.

    The stacks' layers form one chain: stacks are ordered by the first forward node
    that lies in them (graph order), and stack s's layer j is chain layer
    ``first_layer(s) + j``.

    Args:
        gm, num_fwd_outputs: as ``assign_layers_to_graph``.
        stacks: ``(path, child_names)`` of each stack (no stack inside a layer of another).
        drop_uncalled: leave out the stacks no node lies in (found stacks) instead of
            refusing them (named stacks).

    Returns:
        The LayerStack (``stack_spans`` set when more than one stack remains);
        ``node.meta["remat_layer"]`` is also set on every node.

    Raises:
        LayerStackNotFound: no node lies in a stack (and ``drop_uncalled`` is False), or
            in any stack.
    """
    prefixes = [(p + "." if p else "", {c: i for i, c in enumerate(kids)}) for p, kids in stacks]
    fwd = forward_node_names(gm, num_fwd_outputs)
    fwd_set = set(fwd)
    local: dict[str, tuple[int, int] | None] = {}
    last_bw: tuple[int, int] | None = None
    first_seen: dict[int, int] = {}
    for pos, n in enumerate(gm.graph.nodes):
        if n.op in ("placeholder", "output"):
            where = None
        elif n.name in fwd_set:
            where = _stack_layer(n.meta.get("nn_module_stack"), prefixes)
            if where is not None:
                first_seen.setdefault(where[0], pos)
        else:
            recorded = n.meta.get("fwd_nn_module_stack") or n.meta.get("nn_module_stack")
            where = _stack_layer(recorded, prefixes) if recorded else last_bw
            last_bw = where
        local[n.name] = where
    used = {w[0] for w in local.values() if w is not None}
    empty = [stacks[i][0] for i in range(len(stacks)) if i not in used]
    if not used or (empty and not drop_uncalled):
        path = empty[0] if empty else stacks[0][0]
        raise LayerStackNotFound(
            f"no node of the traced step lies in the layer stack {path!r}: its modules "
            "are not called by the model's forward; name the stack that is, with layers="
        )
    order = sorted(used, key=lambda i: first_seen.get(i, len(local)))
    spans, first = [], 0
    for i in order:
        spans.append(StackSpan(stacks[i][0], tuple(stacks[i][1]), first))
        first += len(stacks[i][1])
    offset = {i: span.first_layer for i, span in zip(order, spans)}
    layer_of: dict[str, int | None] = {}
    for n in gm.graph.nodes:
        where = local[n.name]
        layer = None if where is None else offset[where[0]] + where[1]
        layer_of[n.name] = layer
        n.meta["remat_layer"] = layer
    for name, layer in _layers_of_unrecorded(gm, fwd_set, layer_of).items():
        layer_of[name] = layer
    for n in gm.graph.nodes:
        n.meta["remat_layer"] = layer_of[n.name]
    return LayerStack(
        path=", ".join(s.path for s in spans),
        child_names=tuple(c for s in spans for c in s.child_names),
        num_layers=first,
        layer_of=layer_of,
        forward_nodes=tuple(fwd),
        stack_spans=tuple(spans) if len(spans) > 1 else (),
    )


def _stack_layer(recorded: Mapping | None, prefixes: Sequence[tuple[str, Mapping[str, int]]]
                 ) -> tuple[int, int] | None:
    """``(stack index, layer index in it)`` of the innermost recorded module path that
    lies in a layer of one of the stacks, or None."""
    found = None
    for path, _ in recorded_paths(recorded):
        for si, (prefix, index) in enumerate(prefixes):
            if path.startswith(prefix):
                child = path[len(prefix):].split(".", 1)[0]
                if child in index:
                    found = (si, index[child])
    return found
