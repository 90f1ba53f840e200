"""Module paths recorded on fx nodes (``nn_module_stack``, ``fwd_nn_module_stack``):
the modules that may hold a layer stack (``is_container``),
Dynamo's sources as ``named_modules`` paths, and the containers a graph's recorded paths
show when the module is not at hand (a graph Dynamo captured, in the torch.compile
backend; ``regions.find_layer_stacks_in_graph`` finds its layer stacks among them).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
import torch.fx as fx


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


def recorded_children(gm: fx.GraphModule) -> dict[str, dict[str, str]]:
    """Every module path recorded on ``gm``'s nodes (``nn_module_stack`` /
    ``fwd_nn_module_stack``, normalized) that has recorded children: parent path ->
    {child name: the child's recorded type, as text}, in the order first recorded."""
    children: dict[str, dict[str, str]] = {}
    for n in gm.graph.nodes:
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            for path, kind in recorded_paths(n.meta.get(key)):
                if path:
                    parent, child = path.rsplit(".", 1) if "." in path else ("", path)
                    children.setdefault(parent, {}).setdefault(child, str(kind))
    return children


def is_container(module: torch.nn.Module) -> bool:
    """Whether ``module`` may hold a layer stack: an ``nn.ModuleList``, an
    ``nn.Sequential``, or any module (an ``nn.ModuleDict``) whose children are all keyed
    by an integer, their layer index (``{"0": block, "1": block}``)."""
    kids = module._modules
    return isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or (
        bool(kids) and all(k.isdigit() for k in kids))
