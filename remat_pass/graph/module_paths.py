"""Module paths recorded on fx nodes (``nn_module_stack``, ``fwd_nn_module_stack``):
Dynamo's sources as ``named_modules`` paths, and the layer stack a graph's recorded paths
show when the module is not at hand (a graph Dynamo captured, in the torch.compile
backend).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch.fx as fx

from ..errors import LayerStackNotFound

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


def recorded_paths(stack: Mapping | None) -> list[tuple[str, object]]:
    """(normalized path, module type) of each entry of an nn_module_stack, outermost first."""
    out = []
    for value in (stack or {}).values():
        path, kind = (value[0], value[1]) if isinstance(value, tuple) else (str(value), None)
        out.append((normalize_module_path(str(path)), kind))
    return out


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
            for path, kind in recorded_paths(n.meta.get(key)):
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
