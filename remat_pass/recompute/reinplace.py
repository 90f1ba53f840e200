"""In-place reuse restored in a rewritten step: an op whose first input nobody reads
afterwards writes its result into that input's storage, as the user's eager code did
before functionalization made every op allocate.

AOTAutograd traces a functional graph: Megatron-LM's vocab-parallel cross entropy
(``logits -= max``, ``torch.exp(out=)``, ``div_``, and in its backward ``grad[arange,
target] -= 1``, ``mul_``) becomes ``sub``, ``exp``, ``div``, ``index_put``, ``mul``,
each a new [s, b, V] buffer while the one before it is still live. The references are
``torch.fx.passes.reinplace`` and Inductor's reinplacing: a functional op becomes its
in-place overload when writing its first argument changes no value any later op reads.

The rule, per candidate node ``y = op(x, ...)`` of the forward or backward graph:

- ``op`` is pointwise (``torch.Tag.pointwise``) on tensors of one dtype, or
  ``index_put``, not random, and has an in-place overload (``op_`` with the same
  overload name) whose first argument is written;
- ``y`` has ``x``'s shape, strides and dtype (the in-place op returns ``x``);
- no other argument of the op shares ``x``'s storage;
- no node after it in the graph, the graph's output included, reads ``x`` or any value
  sharing its storage (views both ways, by FakeTensor storage);
- ``x``'s storage was made in this step: not a primal (parameter, buffer, batch) or a
  view of one, not a tangent, not a forward output other than a saved value; in the
  backward graph a saved value is made in this step (backward is its last reader);
- no functional collective reads or makes that storage (a backend thread may read its
  input until the wait, and hold its output until it lets go of it:
  ``measure.collective_release``);
- the storage was made by a node of ``y``'s layer (or both are outer): a residual
  stream or its gradient is not carried through the whole stack in one buffer, so each
  layer's storages stay its own (``liveness/layer_template``'s rule: a layer's values
  are read by its neighbours only).

The node keeps its FakeTensor (views of ``y`` share that fake storage); liveness
(``liveness/intervals``) takes ``y`` as ``x``'s storage at run time (``costs.
run_alias_of``: an in-place op returns its first argument), so it counts no new storage
and keeps ``x``'s to the last use of ``y`` or of a view of it. The
values are the same bit for bit (the same kernel writing the same elements, into ``x``).
Ops that read Python numbers are left alone (their wrapped number differs in scratch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..graph.costs import is_random, storage_nbytes

REINPLACED = "remat_reinplaced"
"""``node.meta`` key: the functional op a reinplaced node stood for (``aten.mul.Tensor``)."""

_INDEXED = ("index_put",)


def inplace_overload(op: Any) -> torch._ops.OpOverload | None:
    """The in-place overload of a functional aten op (``aten.mul.Tensor`` ->
    ``aten.mul_.Tensor``), None when it has none or the op is not a candidate (see the
    module docstring: pointwise or ``index_put``, its first argument written)."""
    if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable or op.is_view:
        return None
    name = op.overloadpacket.__name__
    if torch.Tag.pointwise not in op.tags and name not in _INDEXED:
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    inplace = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(inplace, torch._ops.OpOverload):
        return None
    args = inplace._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if [a.name for a in args] != [a.name for a in op._schema.arguments]:
        return None
    return inplace


def _key(val: Any) -> int | None:
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device
            and [str(s) for s in a.shape] == [str(s) for s in b.shape]
            and [str(s) for s in a.stride()] == [str(s) for s in b.stride()]
            and str(a.storage_offset()) == str(b.storage_offset())
            and str(storage_nbytes(a)) == str(a.numel() * a.element_size()))


def _candidate(node: fx.Node) -> torch._ops.OpOverload | None:
    if node.op != "call_function" or is_random(node):
        return None
    inplace = inplace_overload(node.target)
    if inplace is None or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x, y = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and _same_layout(x, y)):
        return None
    leaves: list[Any] = []
    fx.node.map_aggregate((node.args[1:], dict(node.kwargs)), leaves.append)
    if any(isinstance(a, (bool, int, float, complex)) for a in leaves) and node.target.overloadpacket.__name__ \
            not in _INDEXED:
        return None  # a Python number operand: wrapped as a tensor, left as traced
    tensors = [v for a in leaves if isinstance(a, fx.Node) for v in _tensors(a.meta.get("val"))]
    if any(t.dtype != x.dtype for t in tensors) and node.target.overloadpacket.__name__ not in _INDEXED:
        return None
    if any(_key(t) == _key(x) for t in tensors):
        return None
    return inplace


def _reinplace_graph(gm: fx.GraphModule, owned: set[int], layer_of: dict[str, int | None]) -> int:
    """Reinplace the candidates of one graph whose first argument's storage is in
    ``owned`` (storage keys made in this step) and was made by a node of the same layer
    (``layer_of``: node name -> layer, None outer); returns how many nodes changed."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    made_in: dict[int, int | None] = {}  # storage key -> layer of the first node holding it
    for n in nodes:
        for t in _tensors(n.meta.get("val")):
            made_in.setdefault(_key(t), layer_of.get(n.name))
    last_read: dict[int, int] = {}  # storage key -> index of its last reader
    collective: set[int] = set()  # storages a functional collective reads or makes
    for n in nodes:
        is_collective = getattr(n.target, "namespace", "") in ("_c10d_functional", "c10d_functional")
        for a in n.all_input_nodes:
            for t in _tensors(a.meta.get("val")):
                k = _key(t)
                last_read[k] = max(last_read.get(k, -1), order[n])
                if is_collective:
                    collective.add(k)
        if is_collective:
            collective.update(_key(t) for t in _tensors(n.meta.get("val")))
    # a reinplaced node's FakeTensor keeps its own storage (its views share it); at run
    # time that storage is its first argument's: one class of keys (union-find)
    parent: dict[int, int] = {}

    def root(k: int) -> int:
        while parent.get(k, k) != k:
            k = parent[k]
        return k

    changed = 0
    for n in nodes:
        inplace = _candidate(n)
        if inplace is None:
            continue
        kx, ky = root(_key(n.args[0].meta["val"])), root(_key(n.meta["val"]))
        members = [k for k in (*parent, kx) if root(k) == kx] if parent else [kx]
        if kx not in owned or kx in collective or made_in.get(kx) != layer_of.get(n.name) or max(
                last_read.get(k, -1) for k in members) > order[n]:
            continue
        n.meta[REINPLACED] = str(n.target)
        n.target = inplace
        parent[ky] = kx
        parent.setdefault(kx, kx)
        if ky in collective:
            collective.add(kx)
        last_read[kx] = max(last_read.get(kx, -1), last_read.get(ky, -1))
        changed += 1
    if changed:
        gm.recompile()
    return changed


def reinplace(step: Any) -> int:
    """Restore in-place reuse in the forward and backward graphs of ``step`` (a
    ``rewrite.RewrittenStep``, called by ``rewrite.rewrite``; its graphs are modified in
    place) by the rule of the module docstring; returns the number of nodes made
    in-place. Gradients are unchanged bit for bit.
    """
    fw_nodes = list(step.forward.graph.nodes)
    static = {_key(t) for n in fw_nodes if n.op == "placeholder" for t in _tensors(n.meta.get("val"))}
    made = {_key(t) for n in fw_nodes if n.op == "call_function" for t in _tensors(n.meta.get("val"))}
    outputs = fw_nodes[-1].args[0]
    user_outputs = {_key(t) for o in outputs[:step.num_fwd_outputs] if isinstance(o, fx.Node)
                    for t in _tensors(o.meta.get("val"))}
    owned_fw = made - static - user_outputs
    changed = _reinplace_graph(step.forward, owned_fw, step.layer_of)
    # backward: what it makes, and the saved values (their forward storage made in this step)
    bw_nodes = list(step.backward.graph.nodes)
    placeholders = [n for n in bw_nodes if n.op == "placeholder"]
    fw_static = static | user_outputs
    saved_out = outputs[step.num_fwd_outputs:]
    owned_bw: set[int] = set()
    fw_storage = {}
    for ph, out in zip(placeholders[:len(step.saved)], saved_out):
        keys = {_key(t) for t in _tensors(out.meta.get("val"))} if isinstance(out, fx.Node) else {None}
        fw_storage[ph] = keys
        if keys and not keys & fw_static and None not in keys and keys <= made:
            owned_bw |= {_key(t) for t in _tensors(ph.meta.get("val"))}
    other_ph = {_key(t) for ph in placeholders[len(step.saved):] for t in _tensors(ph.meta.get("val"))}
    # a saved placeholder's FakeTensor is the joint node's: refuse one sharing a storage
    # with a primal or tangent placeholder of the backward graph
    owned_bw -= other_ph
    owned_bw |= {_key(t) for n in bw_nodes if n.op == "call_function" for t in _tensors(n.meta.get("val"))} - other_ph
    changed += _reinplace_graph(step.backward, owned_bw, step.layer_of)
    return changed
