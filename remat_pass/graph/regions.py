"""Find the layer stacks of a model and give every joint-graph node its layer index.

A layer stack is a repeated block list (GPT-2's ``transformer.h``): an ``nn.ModuleList``
/ ``nn.Sequential`` whose children all have one class. A model may have several (T5's
``encoder.block`` and ``decoder.block``, any encoder-decoder): every such container that
the step calls and that sits inside no layer of another is a stack (``stacks_among``: one
rule, for a module's containers and for the module paths a Dynamo graph records). Their layers form
one chain, numbered 0..L-1 stack after stack in the order the forward first runs them
(T5: encoder layers 0..5, decoder layers 6..11); ``LayerStack.stacks`` says where each
stack's layers are. A node belongs to layer i when the module path recorded on it
(``nn_module_stack`` for forward nodes, ``fwd_nn_module_stack`` for backward nodes) lies
under that layer's module. Everything else is *outer* (layer ``None``): embeddings,
final norms, head, loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Mapping, Sequence

import torch
import torch.fx as fx

from ..errors import LayerStackNotFound
from .forward_nodes import forward_node_names, layers_of_unrecorded
from .module_paths import is_container, recorded_children, recorded_paths
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

    def widened(self, num_layers: int) -> "LayerStack":
        """This stack continued past the graph to at least ``num_layers`` layers in its
        last stack (after a graph break the stack may go on in another graph, so a K or
        N above the layers seen here is valid): the last stack's children run on as
        integer names (``"3"``, ``"4"``, ...; layers no node lies in).

        Example:
            >>> s = LayerStack("h", ("0", "1"), 2, {}, ())
            >>> s.widened(4).child_names, s.widened(1) == s
            (('0', '1', '2', '3'), True)
        """
        last = self.stacks[-1]
        extra = tuple(str(i) for i in range(last.num_layers, num_layers))
        spans = self.stack_spans and self.stack_spans[:-1] + (
            dataclasses.replace(last, child_names=last.child_names + extra),)
        return dataclasses.replace(self, child_names=self.child_names + extra, num_layers=self.num_layers + len(extra),
                                   stack_spans=spans) if extra else self

    def nodes_of_layer(self, layer: int) -> list[str]:
        """Names of the forward and backward nodes of ``layer``, in graph order."""
        return [n for n, i in self.layer_of.items() if i == layer]


def find_layer_stack(model: torch.nn.Module, layers: str | None = None) -> tuple[str, list[str]]:
    """The layer stack's module path and its child names (the longest stack when the
    model has several; ``find_layer_stacks`` finds them all).

    Args:
        model: the module.
        layers: module path of the stack (``"transformer.h"``); None to search (the
            rule of ``find_layer_stacks``; ties: the first in ``named_modules`` order).

    Returns:
        ``(path, child_names)``.

    Raises:
        LayerStackNotFound: as ``find_layer_stacks``.
    """
    if layers is not None:
        return find_layer_stacks(model, layers)[0]
    found = find_layer_stacks(model)
    return max(found, key=lambda c: len(c[1]))  # max keeps the first of equal lengths


def find_layer_stacks(model: torch.nn.Module, layers: str | Sequence[str] | None = None
                      ) -> list[tuple[str, list[str]]]:
    """Every layer stack of ``model``: module paths and child names.

    The containers are the model's ``nn.ModuleList`` / ``nn.Sequential`` modules and
    every module whose children are keyed by layer index (``"0"`` .. ``"L-1"``:
    torchtitan's ``layers`` ``nn.ModuleDict``; ``is_container``); the stacks among them follow the one rule of ``stacks_among`` (also that of a Dynamo
    graph, ``find_layer_stacks_in_graph``).

    Args:
        model: the module.
        layers: the module path of a stack (``"transformer.h"``), several paths
            (``["encoder.block", "decoder.block"]``), or None to search.

    Returns:
        ``[(path, child_names), ...]`` in ``named_modules`` order (named: in the order
        given). Which of them the step calls, and in which order, ``assign_layers``
        decides.

    Raises:
        LayerStackNotFound: a named path is no container (``is_container``) of the model, has
            no children, is named twice or lies inside a layer of another named stack;
            (search) no container with two or more same-class children exists; or one
            module instance sits at two positions of a stack.
    """
    containers = {name: mod for name, mod in model.named_modules() if is_container(mod)}
    if layers is not None:
        return _named_stacks(model, containers, [layers] if isinstance(layers, str) else list(layers))
    for name, mod in containers.items():
        _refuse_shared_children(name, mod)
    found = stacks_among({name: {n: type(c) for n, c in mod.named_children()} for name, mod in containers.items()})
    if not found:
        raise LayerStackNotFound(
            f"{type(model).__name__} has no layer stack: looked for an nn.ModuleList, "
            "nn.Sequential or layer-index-keyed nn.ModuleDict of two or more children of one class, and found "
            f"{'only ' + ', '.join(repr(c) for c in containers) if containers else 'none'}. "
            "Put the repeated blocks in an nn.ModuleList, or name the stack with "
            "layers='path.to.stack' (--stack on the command line)."
        )
    return found


def stacks_among(containers: Mapping[str, Mapping[str, object]]) -> list[tuple[str, list[str]]]:
    """The layer stacks among ``containers``: the one rule of a layer stack, for a
    module (``find_layer_stacks``) and for a Dynamo graph (``find_layer_stacks_in_graph``).

    A stack is a container of two or more children of one kind (class) that lies inside
    no layer of another such container (MoE experts and attention heads belong to their
    layer); a model may have several (T5's ``encoder.block`` and ``decoder.block``).

    Args:
        containers: module path -> {child name: the child's kind}, in the order found.

    Returns:
        ``[(path, child_names), ...]`` in the order of ``containers``; empty when none.

    Example:
        >>> stacks_among({"h": {"0": "Block", "1": "Block"}, "h.0.experts": {"0": "E", "1": "E"},
        ...               "h.0.mix": {"0": "A", "1": "B"}})
        [('h', ['0', '1'])]
    """
    candidates = {
        path: list(kids) for path, kids in containers.items()
        if len(kids) >= 2 and len(set(kids.values())) == 1
    }
    return [(path, kids) for path, kids in candidates.items() if _inside_layer_of(path, candidates) is None]


def find_layer_stacks_in_graph(gm: fx.GraphModule, layers: str | Sequence[str] | None = None
                               ) -> list[tuple[str, list[str]]]:
    """Every layer stack of a graph whose nodes record module paths, without the module
    (a graph Dynamo captured: the torch.compile backend sees no ``nn.Module``).

    The containers are the recorded module paths (``nn_module_stack`` /
    ``fwd_nn_module_stack``, normalized by ``module_paths.normalize_module_path``) whose
    recorded children are all integer-named (what an ``nn.ModuleList`` or
    ``nn.Sequential`` of blocks records: a graph does not show a container's class),
    each child's kind its recorded type; the stacks among them follow the rule of
    ``stacks_among``, as for a module.

    Args:
        gm: the graph (Dynamo's, or AOTAutograd's joint graph).
        layers: a stack's module path relative to the compiled module
            (``"transformer.h"``; a recorded path that ends with it matches: a closure or
            global root leaves a prefix), several paths, or None to search.

    Returns:
        ``[(path, child_names), ...]`` in the order first recorded (named: as given).
        Child names are ``"0" .. str(max index)`` for integer-named children, so a
        layer's index is the same in every graph of a model even when a graph holds
        only some layers (after a graph break).

    Raises:
        LayerStackNotFound: a named path is recorded on no node, is named twice or lies
            inside a layer of another named stack, or (search) no recorded path has two
            or more integer-named children of one type.
    """
    children = recorded_children(gm)
    if layers is not None:
        named: dict[str, list[str]] = {}
        for want in [layers] if isinstance(layers, str) else list(layers):
            path = next((p for p in children if p == want or p.endswith("." + want)), None)
            if path is None:
                raise LayerStackNotFound(
                    f"layers={want!r}: no module under it is recorded on the graph's nodes; "
                    f"recorded containers with children: {sorted(children) or 'none'}")
            if path in named:
                raise LayerStackNotFound(f"layers= names the stack {want!r} twice")
            named[path] = _child_names(children[path])
        _refuse_nested(named)
        return list(named.items())
    found = stacks_among({p: kids for p, kids in children.items() if all(c.isdigit() for c in kids)})
    if not found:
        raise LayerStackNotFound(
            "no layer stack is recorded on the graph's nodes: looked for a module path "
            "with two or more integer-named children of one type (an nn.ModuleList or "
            f"nn.Sequential of blocks); recorded containers: {sorted(children) or 'none'}. "
            "Name the stack with layers='path.to.stack'."
        )
    return [(path, _child_names(children[path])) for path, _ in found]


def _child_names(kids: Mapping[str, object]) -> list[str]:
    """``"0" .. str(max index)`` for integer-named children, else the names as recorded."""
    if all(c.isdigit() for c in kids):
        return [str(i) for i in range(max(int(c) for c in kids) + 1)]
    return list(kids)


def _inside_layer_of(name: str, stacks: Mapping[str, Sequence[str]]) -> str | None:
    """The stack of ``stacks`` one of whose layers is or holds the module ``name``, or
    None (a container inside one layer of another: the experts of an MoE layer)."""
    for other, kids in stacks.items():
        if other != name and any(name == _join(other, k) or name.startswith(_join(other, k) + ".")
                                 for k in kids):
            return other
    return None


def _refuse_nested(named: Mapping[str, Sequence[str]]) -> None:
    """Raise LayerStackNotFound when a named stack lies inside a layer of another."""
    for path in named:
        outer = _inside_layer_of(path, named)
        if outer is not None:
            raise LayerStackNotFound(
                f"the layer stack {path!r} lies inside a layer of the stack {outer!r}: a layer "
                "cannot belong to two stacks; name one of them"
            )


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
                f"layers={path!r} " + ("is not an nn.ModuleList, nn.Sequential or module keyed by layer index"
                                       if exists else "names no module")
                + f" of {type(model).__name__}; its containers of layers: {', '.join(named) or 'none'}"
            )
        if path in out:
            raise LayerStackNotFound(f"layers= names the stack {path!r} twice")
        _refuse_shared_children(path, containers[path])
        children = [n for n, _ in containers[path].named_children()]
        if not children:
            raise LayerStackNotFound(f"the layer stack {path!r} has no children")
        out[path] = children
    _refuse_nested(out)
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


def assign_layers_in_graph(gm: fx.GraphModule, num_fwd_outputs: int, layers: str | Sequence[str] | None = None,
                           known: Sequence[str] = ()) -> LayerStack:
    """The layer stacks of a joint graph whose nodes record module paths, without the
    module (the torch.compile backend), and the layer of every node: ``assign_layers``
    for a graph, the stacks found by ``find_layer_stacks_in_graph``.

    Args:
        gm: the joint graph (``primals_*``, ``tangents_*`` placeholders).
        num_fwd_outputs: the joint graph's number of forward outputs.
        layers: the stack's module path, several paths, or None to find them.
        known: with ``layers`` None, the stack paths an earlier graph of the same model
            found: those recorded here are taken first (after a graph break a graph may
            hold a single layer of a stack, too few for the search); when none of them
            holds a node, the stacks are searched for.

    Returns:
        The LayerStack; ``node.meta["remat_layer"]`` is also set on every node.

    Raises:
        LayerStackNotFound: as ``find_layer_stacks_in_graph``, or no forward node lies
            in a named stack, or in any found one.
    """
    found: list[tuple[str, list[str]]] = []
    for path in known if layers is None else ():
        with contextlib.suppress(LayerStackNotFound):  # not recorded in this graph
            found += find_layer_stacks_in_graph(gm, path)
    with contextlib.suppress(LayerStackNotFound):  # no forward node lies in them: search
        if found:
            return assign_layers_to_stacks(gm, num_fwd_outputs, found, drop_uncalled=True)
    stacks = find_layer_stacks_in_graph(gm, layers)
    return assign_layers_to_stacks(gm, num_fwd_outputs, stacks, drop_uncalled=layers is None and len(stacks) > 1)


def assign_layers_to_stacks(
    gm: fx.GraphModule, num_fwd_outputs: int, stacks: Sequence[tuple[str, Sequence[str]]],
    drop_uncalled: bool = False,
) -> LayerStack:
    """The layer of every node of a joint graph, given one or several stacks.

    The stacks' layers form one chain: stacks are ordered by the first forward node
    that lies in them (graph order), and stack s's layer j is chain layer
    ``first_layer(s) + j``.

    Args:
        gm: the joint graph (``primals_*``, ``tangents_*`` placeholders); recorded module
            paths are normalized with ``module_paths.normalize_module_path``.
        num_fwd_outputs: the joint graph's number of forward outputs.
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
    for name, layer in layers_of_unrecorded(gm, fwd_set, layer_of).items():
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
    """``(stack index, layer index in it)`` of a recorded path in a layer of a stack, or
    None: the innermost stack's outermost path (the calling layer; a module all layers
    share is recorded under one layer's path, ``named_modules`` lists it once)."""
    found, met = None, set()
    for path, _ in recorded_paths(recorded):
        for si, (prefix, index) in enumerate(prefixes):
            if si not in met and path.startswith(prefix):
                child = path[len(prefix):].split(".", 1)[0]
                if child in index:
                    found = (si, index[child])
                    met.add(si)
    return found
