"""Find the layer stack of a model and give every joint-graph node its layer index.

The layer stack is the repeated block list (GPT-2's ``transformer.h``): by default the
longest ``nn.ModuleList`` / ``nn.Sequential`` whose children all have one class. A node
belongs to layer i when the module path recorded on it (``nn_module_stack`` for forward
nodes, ``fwd_nn_module_stack`` for backward nodes) lies under ``<stack>.<i>``. Everything
else is *outer* (layer ``None``): embedding, final norm, head, loss.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx

from .costs import is_random
from .errors import LayerStackNotFound
from .trace import JointGraph


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The layer stack of a traced step.

    Attributes:
        path: module path of the stack (e.g. ``"transformer.h"``).
        child_names: the stack's child names in order (``"0"``, ``"1"``, ...).
        num_layers: L, the number of layers.
        layer_of: joint node name -> layer index in 0..L-1, or None for outer nodes.
        forward_nodes: names of the joint graph's forward nodes (ancestors of the
            forward outputs, placeholders included), in graph order.
    """

    path: str
    child_names: tuple[str, ...]
    num_layers: int
    layer_of: Mapping[str, int | None]
    forward_nodes: tuple[str, ...]

    def nodes_of_layer(self, layer: int) -> list[str]:
        """Names of the forward and backward nodes of ``layer``, in graph order."""
        return [n for n, i in self.layer_of.items() if i == layer]


def find_layer_stack(model: torch.nn.Module, layers: str | None = None) -> tuple[str, list[str]]:
    """The layer stack's module path and its child names.

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
    containers = {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential))
    }
    if layers is not None:
        if layers not in containers:
            raise LayerStackNotFound(
                f"layers={layers!r} is not an nn.ModuleList or nn.Sequential of "
                f"{type(model).__name__}; those it has: {sorted(containers) or 'none'}"
            )
        _refuse_shared_children(layers, containers[layers])
        children = [n for n, _ in containers[layers].named_children()]
        if not children:
            raise LayerStackNotFound(f"the layer stack {layers!r} has no children")
        return layers, children
    for name, mod in containers.items():
        _refuse_shared_children(name, mod)
    candidates = {
        name: [n for n, _ in mod.named_children()]
        for name, mod in containers.items()
        if len(list(mod.children())) >= 2 and len({type(c) for c in mod.children()}) == 1
    }
    # a container inside one layer of another candidate (the experts of an MoE layer,
    # the heads of an attention) is part of that layer, not the stack
    nested = {
        name for name in candidates
        for other, kids in candidates.items()
        if other != name and any(name.startswith(_join(other, k) + ".") for k in kids)
    }
    best: tuple[str, list[str]] | None = None
    for name, kids in candidates.items():
        if name in nested:
            continue
        if best is None or len(kids) > len(best[1]):
            best = (name, kids)
    if best is None:
        raise LayerStackNotFound(
            f"{type(model).__name__} has no layer stack: looked for an nn.ModuleList or "
            "nn.Sequential of two or more children of one class, and found "
            f"{'only ' + ', '.join(repr(c) for c in containers) if containers else 'none'}. "
            "Put the repeated blocks in an nn.ModuleList, or name the stack with "
            "layers='path.to.stack' (--stack on the command line)."
        )
    return best


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


_ROOT = re.compile(r"^[LG]\[(?:'[^']*'|\"[^\"]*\")\]")
_GETATTR = re.compile(r"getattr\(([^()]*), '([^']*)'\)")
_ITEM = re.compile(r"(?:\._modules)?\[(?:'([^']*)'|\"([^\"]*)\"|(\d+))\]")


def normalize_module_path(path: str) -> str:
    """A module path as recorded in ``nn_module_stack``, as a dotted path relative to
    the traced root, matching ``root.named_modules()``.

    Dynamo records sources rooted at the compiled frame's local or global
    (``L['self'].transformer.h[0]``, ``L['self']._modules['h']._modules['0']``,
    ``getattr(L['self'].h, '0')``, ``G['model'].blocks.0``); ``trace_joint`` records
    ``named_modules`` paths, which are returned unchanged.

    Example:
        >>> normalize_module_path("L['self'].transformer.h[0].attn")
        'transformer.h.0.attn'
        >>> normalize_module_path("transformer.h.0")
        'transformer.h.0'
    """
    p = path
    while True:
        q = _GETATTR.sub(r"\1.\2", p)
        if q == p:
            break
        p = q
    m = _ROOT.match(p)
    if m:
        p = p[m.end():]
    p = _ITEM.sub(lambda m: "." + next(g for g in m.groups() if g is not None), p)
    return p.lstrip(".")


def _recorded_paths(stack: Mapping | None) -> list[tuple[str, object]]:
    """(normalized path, module type) of each entry of an nn_module_stack, outermost first."""
    out = []
    for value in (stack or {}).values():
        path, kind = (value[0], value[1]) if isinstance(value, tuple) else (str(value), None)
        out.append((normalize_module_path(str(path)), kind))
    return out


def _layer_from_stack(stack: Mapping | None, prefix: str, index: dict[str, int]) -> int | None:
    if not stack:
        return None
    layer = None
    for path, _ in _recorded_paths(stack):
        if path.startswith(prefix):
            child = path[len(prefix) :].split(".", 1)[0]
            if child in index:
                layer = index[child]
    return layer


def find_layer_stack_in_graph(gm: fx.GraphModule, layers: str | None = None) -> tuple[str, list[str]]:
    """The layer stack of a graph whose nodes record module paths, without the module.

    For a graph that Dynamo captured (the torch.compile backend sees no ``nn.Module``):
    the candidates are module paths ``P`` with integer-named children ``P.0``, ``P.1``,
    ... (``P`` may be ``""``, the compiled module itself, e.g. an ``nn.Sequential``)
    recorded on the graph's nodes (``nn_module_stack`` / ``fwd_nn_module_stack``),
    the children of one candidate all of one type (what an ``nn.ModuleList`` or
    ``nn.Sequential`` of blocks records). The candidate with the most children is the
    stack (ties: the first recorded).

    Args:
        gm: the graph (Dynamo's, or AOTAutograd's joint graph).
        layers: the stack's module path relative to the compiled module
            (``"transformer.h"``; a recorded path that ends with it matches), or None
            to search.

    Returns:
        ``(path, child_names)``: child names are ``"0" .. str(max index)`` for
        integer-named children, so a layer's index is the same in every graph of a
        model even when a graph holds only some layers (after a graph break).

    Raises:
        LayerStackNotFound: ``layers`` names no path recorded in the graph, or (search)
            no path has two or more integer-named children of one type.
    """
    children: dict[str, dict[str, object]] = {}
    seen: set[str] = set()
    for n in gm.graph.nodes:
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            for path, kind in _recorded_paths(n.meta.get(key)):
                seen.add(path)
                if path:
                    parent, child = path.rsplit(".", 1) if "." in path else ("", path)
                    children.setdefault(parent, {}).setdefault(child, kind)
    def _names(kids: dict[str, object]) -> list[str]:
        ints = sorted(int(c) for c in kids if c.isdigit())
        if len(ints) == len(kids):
            return [str(i) for i in range(ints[-1] + 1)]
        return list(kids)

    if layers is not None:
        # a closure or global root leaves a prefix before the user's path
        found = [p for p in children if p == layers or p.endswith("." + layers)]
        kids = children[found[0]] if found else {}
        if not kids:
            raise LayerStackNotFound(
                f"layers={layers!r}: no module under it is recorded on the graph's nodes; "
                f"recorded containers with children: {sorted(children) or 'none'}"
            )
        return found[0], _names(kids)
    best: tuple[str, dict[str, object]] | None = None
    for parent, kids in children.items():
        if not all(c.isdigit() for c in kids) or len(set(map(str, kids.values()))) != 1:
            continue
        if len(kids) >= 2 and (best is None or len(kids) > len(best[1])):
            best = (parent, kids)
    if best is None:
        raise LayerStackNotFound(
            "no layer stack is recorded on the graph's nodes: looked for a module path "
            "with two or more integer-named children of one type (an nn.ModuleList or "
            f"nn.Sequential of blocks); recorded containers: {sorted(children) or 'none'}. "
            "Name the stack with layers='path.to.stack'."
        )
    return best[0], _names(best[1])


def assign_layers(joint: JointGraph, layers: str | None = None) -> LayerStack:
    """Find the layer stack of ``joint.model`` and the layer of every joint node.

    Forward nodes take the layer of their ``nn_module_stack``; backward nodes that of
    ``fwd_nn_module_stack``. Backward nodes with no recorded stack (gradient
    accumulation, for example) take the layer of the closest earlier backward node that
    has one, since AOTAutograd emits them right after the op whose gradient they sum.

    Args:
        joint: the traced step.
        layers: the stack's module path, or None to find it (see find_layer_stack).

    Returns:
        The LayerStack; ``node.meta["remat_layer"]`` is also set on every joint node.

    Raises:
        LayerStackNotFound: as find_layer_stack, or no node of the graph lies in the
            stack (the stack's modules are not called by ``forward``).
    """
    path, children = find_layer_stack(joint.model, layers)
    return assign_layers_to_graph(joint.gm, joint.num_fwd_outputs, path, children)


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
    normalized with ``normalize_module_path``.

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
    index = {c: i for i, c in enumerate(children)}
    prefix = path + "." if path else ""
    fwd = forward_node_names(gm, num_fwd_outputs)
    fwd_set = set(fwd)
    layer_of: dict[str, int | None] = {}
    last_bw_layer: int | None = None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            layer = None
        elif n.name in fwd_set:
            layer = _layer_from_stack(n.meta.get("nn_module_stack"), prefix, index)
        else:
            stack = n.meta.get("fwd_nn_module_stack") or n.meta.get("nn_module_stack")
            layer = _layer_from_stack(stack, prefix, index) if stack else last_bw_layer
            last_bw_layer = layer
        layer_of[n.name] = layer
        n.meta["remat_layer"] = layer
    if not any(v is not None for v in layer_of.values()):
        raise LayerStackNotFound(
            f"no node of the traced step lies in the layer stack {path!r}: its modules "
            "are not called by the model's forward; name the stack that is, with layers="
        )
    for name, layer in _layers_of_unrecorded(gm, fwd_set, layer_of).items():
        layer_of[name] = layer
    for n in gm.graph.nodes:
        n.meta["remat_layer"] = layer_of[n.name]
    return LayerStack(
        path=path,
        child_names=tuple(children),
        num_layers=len(children),
        layer_of=layer_of,
        forward_nodes=tuple(fwd),
    )
