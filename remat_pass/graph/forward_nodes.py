"""The forward nodes of a joint graph (the ancestors of its forward outputs) and the
layer of a forward op that records no module path: the node-level half of
``regions.assign_layers`` (``regions`` re-exports ``input_closure`` and
``forward_node_names``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch.fx as fx

from .costs import is_random


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


def layers_of_unrecorded(gm: fx.GraphModule, forward: set[str],
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
