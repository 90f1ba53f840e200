"""When layers are alike: the one rule, and the evidence each caller compares.

Three places ask whether layers are alike, each seeing a layer differently:

- ``models.configs.differing_layer``, before tracing: may a short template stand for
  every layer of a config's model (layer reuse)? It sees the modules, built on the meta
  device (``module_evidence``), and the config's per-layer lists.
- ``liveness.layer_template.BlockType.matches``: do two blocks of one role in the
  rewritten templates allocate alike, so that one table of reads serves both? It sees a
  block's ops and the storages it allocates (``block_evidence``).
- ``plan.op_planner`` (its layer kinds): which layers can share one op-level solution,
  node for node? It sees a layer's forward nodes: ops, arguments, shapes, strides, dtypes and
  who reads each value in backward (``node_evidence``).

The rule (``first_unlike``; ``alike`` is its yes / no, ``alike_key`` its grouping):
a layer's evidence is a mapping from the name of a fact to its value in which nothing
names the layer itself. An fx node's inputs are positions inside the layer (or "outside"
and the kind of node), a ``get_attr`` constant is its shape and dtype (``op_identity``:
each layer has its own attribute), and the facts that number the layers (layer i holds
``i + c``: a module's ``layer_idx``) are left out (``numbering``). Two layers are alike
when every remaining fact of either agrees; a fact one of them lacks counts as None.

Why the evidence differs (and the rule does not): each caller can see, and needs, only
its own. Before tracing there are modules and a config but no graph, and the question is
whether the traced layers will be alike; a block of a rewritten template has no module,
and what liveness needs of it is the storages it allocates, at which step, of how many
bytes (the template's reads are checked apart, ``Template.storage_reads``); the op-level
planner maps one layer's solution onto another by node position, so it needs the
dataflow inside the layer and which values backward reads, and layer 0 (reading the
model's input) may be a kind of its own.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
import torch.fx as fx

Evidence = Mapping[Hashable, Any]
"""What one layer shows: the name of a fact -> its value (compared with ``==``)."""

_SIMPLE = (bool, int, float, str, type(None))


def numbering(layers: Sequence[Evidence]) -> set[Hashable]:
    """The facts that number the layers: an int in layer 0 that is ``v0 + i`` in layer i
    of every layer (``layer_idx``), which names a layer rather than describing it.

    Example:
        >>> sorted(numbering([{"idx": 3, "n": 1}, {"idx": 4, "n": 1}, {"idx": 5, "n": 1}]))
        ['idx']
    """
    if not layers:
        return set()
    first = layers[0]
    return {key for key, v0 in first.items() if type(v0) is int
            and all(type(s.get(key)) is int and s[key] - v0 == i for i, s in enumerate(layers))}


def first_unlike(layers: Sequence[Evidence], order: Callable[[Hashable], Any] | None = None
                 ) -> tuple[int, Hashable] | None:
    """The rule: the first layer unlike layer 0 and the first fact it differs in, or None
    when every layer is alike (the module docstring).

    Args:
        layers: each layer's evidence, in layer order.
        order: sorts the facts, to name the most telling difference first; None: in the
            order first seen.

    Returns:
        ``(layer index, fact)`` (a fact's value in the layer that lacks it is None), or None.

    Example:
        >>> first_unlike([{"idx": 0, "w": (4, 4)}, {"idx": 1, "w": (4, 4)}, {"idx": 2, "w": (4, 8)}])
        (2, 'w')
        >>> first_unlike([{"idx": 0, "w": (4, 4)}, {"idx": 1, "w": (4, 4)}]) is None
        True
    """
    left_out = numbering(layers)
    keys = [k for k in dict.fromkeys(k for ev in layers for k in ev) if k not in left_out]
    if order is not None:
        keys.sort(key=order)
    for i, ev in enumerate(layers[1:], 1):
        key = _differing(layers[0], ev, keys)
        if key is not None:
            return i, key
    return None


def _differing(reference: Evidence, other: Evidence, keys: Sequence[Hashable]) -> Hashable | None:
    """The first of ``keys`` whose value differs between the two (a lacking fact is None)."""
    return next((k for k in keys if other.get(k) != reference.get(k)), None)


def alike(a: Evidence, b: Evidence) -> bool:
    """Whether two layers (or blocks) are alike: ``first_unlike([a, b])`` finds nothing
    (``a`` and ``b`` taken as consecutive layers, for the numbering)."""
    return first_unlike([a, b]) is None


def alike_key(evidence: Evidence) -> Hashable:
    """A hashable form of one layer's evidence, to group many layers into kinds at once:
    two layers' keys are equal exactly when ``alike`` holds for them, for evidence in
    which no fact can number the layers (``node_evidence``: positions and tuples, no
    plain ints). Its values must be hashable.

    Example:
        >>> alike_key({0: ("mm",), 1: None}) == alike_key({0: ("mm",)})
        True
    """
    return frozenset((k, v) for k, v in evidence.items() if v is not None)


def op_identity(n: fx.Node) -> tuple:
    """The op a node runs, with nothing that names its layer: ``(op, target)``, a
    ``get_attr`` constant by its shape and dtype (each layer has its own attribute)."""
    if n.op == "get_attr":
        val = n.meta.get("val")
        return ("get_attr", tuple(getattr(val, "shape", ())), str(getattr(val, "dtype", "")))
    return (n.op, str(n.target))


def module_evidence(layer: torch.nn.Module) -> dict[str, Any]:
    """What decides a layer's graph and sizes, as far as its modules show it: every
    submodule's class (``"name:class"``), its plain attributes (numbers, strings, None,
    tuples of them; ``"name.attr"``) and its parameters' and buffers' shapes and dtypes
    (``"name:param"``), by name."""
    out: dict[str, Any] = {}
    for name, mod in layer.named_modules():
        out[f"{name}:class"] = type(mod).__name__
        for key, value in sorted(vars(mod).items()):
            if not key.startswith("_") and (isinstance(value, _SIMPLE) or (
                    isinstance(value, tuple) and all(isinstance(e, _SIMPLE) for e in value))):
                out[f"{name}.{key}"] = value
        for kind, tensors in (("param", mod.named_parameters(recurse=False)), ("buffer", mod.named_buffers(recurse=False))):
            out.update({f"{name}:{n}": (kind, tuple(t.shape), t.dtype) for n, t in tensors if t is not None})
    return out


def block_evidence(nodes: Sequence[fx.Node], storages: Sequence[tuple]) -> dict[tuple, Any]:
    """A block of a rewritten step: the op of each of its steps (``op_identity``) and each
    storage it allocates (``(step offset in the block, bytes, is scratch)``), in order."""
    out: dict[tuple, Any] = {("op", i): op_identity(n) for i, n in enumerate(nodes)}
    out.update({("storage", j): s for j, s in enumerate(storages)})
    return out


def node_evidence(nodes: Sequence[fx.Node], readers: Mapping[fx.Node, set[int | None]], layer: int
                  ) -> dict[int, tuple]:
    """A layer's forward nodes, node for node: each node's op (``op_identity``), its
    arguments (a node of the layer by its position, another by ``("outside", op)``, a
    constant by ``repr``), the shape, dtype and strides of each value it returns, and
    whether backward reads it in this layer and in another (``readers``: node -> the
    layers of the backward nodes that read it)."""
    position = {n: i for i, n in enumerate(nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, (tuple, list)):
            return tuple(arg(e) for e in a)
        if isinstance(a, fx.Node):
            return ("node", position[a]) if a in position else ("outside", a.op)
        return repr(a)

    out = {}
    for i, n in enumerate(nodes):
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        meta = tuple((tuple(v.shape), str(v.dtype), tuple(v.stride())) if isinstance(v, torch.Tensor) else None
                     for v in vals)
        read = readers.get(n, set())
        out[i] = (op_identity(n), tuple(arg(a) for a in n.args),
                  tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())), meta, layer in read, bool(read - {layer}))
    return out
