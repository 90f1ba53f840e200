"""Pure transforms of fx graphs for the torch.compile backend: AOTAutograd's joint graph
read as a JointGraph, its input-mutation epilogue, its calling convention, the roles of
its outputs, the bytes a graph's forward outputs hold. (Sizes of symbolic shapes, at the
example or at a step's shapes, are ``liveness.symbolic_sizes``'.)

Each function takes graphs and returns new ones (inputs are never modified); they hold
no state and know nothing of Dynamo.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from ..errors import UnsupportedGraph
from ..recompute.rewrite import RewrittenStep
from ..graph.trace import JointGraph


def is_sym_node(node: Any) -> bool:
    """Whether ``node``'s value is a SymInt / SymFloat / SymBool or a Python number."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def split_input_mutations(
    joint: fx.GraphModule, primals: Sequence[str]
) -> tuple[fx.GraphModule, list[tuple[str, str]]]:
    """The joint graph without its input-mutation epilogue, and that epilogue.

    AOTAutograd keeps a mutation of a primal (BatchNorm's running statistics in train
    mode) in the joint as ``aten.copy_(primal, new_value)`` with no users, at the end
    of forward. The rewrite refuses in-place ops, so they are taken out here and put
    back at the end of the forward graph by ``aot_graphs``.

    Returns:
        ``(joint without those copy_ nodes, [(primal name, new value's node name)])``;
        ``joint`` itself is not modified.
    """
    primal_set = set(primals)
    drop = [
        n for n in joint.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
        and isinstance(n.args[0], fx.Node) and n.args[0].name in primal_set and not n.users
    ]
    if not drop:
        return joint, []
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    dropped = set(drop)
    for n in joint.graph.nodes:
        if n in dropped:
            continue
        if n.op == "output":
            g.output(fx.node.map_arg(n.args[0], env.__getitem__))
            continue
        env[n] = g.node_copy(n, env.__getitem__)
        env[n].meta = dict(n.meta)
    g.lint()
    return fx.GraphModule(joint, g), [(n.args[0].name, n.args[1].name) for n in drop]


def aot_graphs(
    step: RewrittenStep, mutations: Sequence[tuple[str, str]] = ()
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``step``'s graphs in AOTAutograd's calling convention.

    ``forward(*primals) -> (*fwd_outputs, *saved_tensors, *saved_symints)`` and
    ``backward(*saved_symints, *saved_tensors, *tangents) -> one gradient per primal``,
    as ``torch._functorch.partitioners._extract_fwd_bwd_modules`` builds them. The
    primals backward reads (``step.backward_primal_indices``) are saved tensors (or
    SymInts) returned by forward. ``step`` is not modified.

    ``mutations`` (``split_input_mutations``): each ``(primal, value)`` becomes
    ``aten.copy_(primal, value)`` at the end of forward, as AOTAutograd placed it. A
    recomputed node that reads a mutated primal must see the value forward saw: forward
    saves a clone of the primal taken before the mutation, and the recompute reads it
    (backward nodes read the primal itself, as under AOTAutograd's own partition).
    """
    fw = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_args = fw.graph_copy(step.forward.graph, env)
    k = step.num_fwd_outputs
    fwd_outs, saved_outs = list(out_args[:k]), list(out_args[k:])
    placeholders = {n.name: n for n in fw.nodes if n.op == "placeholder"}
    by_name = {n.name: n for n in fw.nodes}
    bw_src = [n for n in step.backward.graph.nodes if n.op == "placeholder"]
    n_saved = len(step.saved)
    bw_primals = bw_src[n_saved : n_saved + len(step.backward_primal_indices)]
    tangents = bw_src[n_saved + len(bw_primals) :]
    saved_fw = saved_outs + [placeholders[p.name] for p in bw_primals]
    saved_bw: list[Any] = bw_src[: n_saved + len(bw_primals)]

    clones = _pre_mutation_clones(fw, step, mutations, placeholders)
    stale = dict(clones)  # primal name -> its pre-mutation clone (forward)
    saved_fw += [pre for _, pre in clones]
    saved_bw += [pre for _, pre in clones]  # each stands in for its backward placeholder
    sym = [i for i, n in enumerate(saved_fw) if is_sym_node(n)]
    tensors = [i for i in range(len(saved_fw)) if i not in set(sym)]
    bindings = _symbol_bindings(fw, [saved_fw[i] for i in sym],
                                [*(saved_fw[i] for i in tensors), *(saved_fw[i] for i in sym), *tangents])
    for dst, src in mutations:
        fw.call_function(torch.ops.aten.copy_.default, (placeholders[dst], by_name[src]))
    fw.output([*fwd_outs, *(saved_fw[i] for i in tensors), *bindings, *(saved_fw[i] for i in sym)])
    fw.lint()

    bw = fx.Graph()
    benv: dict[Any, fx.Node] = {}
    for node in bindings:  # read by no backward node: only Inductor's size bindings need them
        bw.placeholder(node.name).meta = dict(node.meta)
    for src in [*(saved_bw[i] for i in sym), *(saved_bw[i] for i in tensors), *tangents]:
        ph = bw.placeholder(src.name)
        ph.meta = dict(src.meta)
        benv[src] = ph
    clone_ph = {dst: benv[pre] for dst, pre in stale.items()}
    for n in step.backward.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            bw.output(fx.node.map_arg(n.args[0], benv.__getitem__))
            continue
        if step.kind_of.get(n.name) == "recompute" and stale:
            def lookup(a: fx.Node) -> fx.Node:
                if a.op == "placeholder" and a.name in clone_ph:
                    return clone_ph[a.name]
                return benv[a]

            benv[n] = bw.node_copy(n, lookup)
        else:
            benv[n] = bw.node_copy(n, benv.__getitem__)
    bw.lint()
    return (
        fx.GraphModule(step.forward, fw, class_name="RematForward"),
        fx.GraphModule(step.backward, bw, class_name="RematBackward"),
    )


def _symbol_bindings(fw: fx.Graph, saved_syms: Sequence[fx.Node], backward_inputs: Sequence[fx.Node]) -> list[fx.Node]:
    """The forward nodes binding each shape symbol a backward input's size, stride or
    value uses that no saved SymInt binds (``s0`` of a saved tensor of size
    ``s0*(s1 + 1)``): Inductor's backward must be given every such symbol as an input
    of its own (``codegen_inputs``: "expected [s0] to have been codegen-ed"), as
    ``torch._functorch.partitioners._extract_fwd_bwd_modules`` saves them. In
    ``fw``'s order of first binding; empty under static shapes."""
    from torch.fx.experimental.symbolic_shapes import (find_symbol_binding_fx_nodes, free_symbols,
                                                       is_symbol_binding_fx_node)

    bound = {is_symbol_binding_fx_node(n) for n in saved_syms} - {None}
    needed: set[Any] = set()
    for n in backward_inputs:
        val = n.meta.get("val")
        if isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            needed |= free_symbols(val)
    missing = needed - bound
    if not missing:
        return []
    return [node for sym, node in find_symbol_binding_fx_nodes(fw).items() if sym in missing]


def _pre_mutation_clones(
    fw: fx.Graph, step: RewrittenStep, mutations: Sequence[tuple[str, str]], placeholders: dict[str, fx.Node]
) -> list[tuple[str, fx.Node]]:
    """For each mutated primal a recomputed node of ``step`` reads, a clone of it taken
    in ``fw`` (the forward graph being built) right after its placeholders, before the
    mutation: ``[(primal name, clone)]`` in the order of ``mutations``."""
    recompute_readers = {
        a.name
        for n in step.backward.graph.nodes
        if step.kind_of.get(n.name) == "recompute"
        for a in n.all_input_nodes
        if a.op == "placeholder"
    }
    last_placeholder = [n for n in fw.nodes if n.op == "placeholder"][-1]
    clones = []
    for dst, src in mutations:
        if dst in recompute_readers:
            with fw.inserting_after(last_placeholder):
                pre = fw.create_node("call_function", torch.ops.aten.clone.default,
                                     (placeholders[dst],), name=f"{dst}_before_mutation")
            pre.meta = dict(placeholders[dst].meta)
            clones.append((dst, pre))
    return clones


def boundary_bytes(step: RewrittenStep) -> int:
    """Bytes of the distinct storages of the forward graph's outputs (not its inputs)."""
    out = step.forward.graph.output_node()
    placeholders = {n for n in step.forward.graph.nodes if n.op == "placeholder"}
    inputs = {n.meta["val"].untyped_storage()._cdata for n in placeholders
              if isinstance(n.meta.get("val"), torch.Tensor)}
    seen: set[int] = set()
    total = 0
    for a in out.args[0][: step.num_fwd_outputs]:
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(val, torch.Tensor):
            key = val.untyped_storage()._cdata
            if key not in seen and key not in inputs:
                seen.add(key)
                total += int(val.untyped_storage().nbytes())
    return total


def dynamo_joint(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    static_indices: Sequence[int],
    labels: Sequence[str],
    graph_id: str,
) -> tuple[JointGraph, list[tuple[str, str]]]:
    """The JointGraph of a joint graph AOTAutograd built for Dynamo, and its
    input-mutation epilogue (``split_input_mutations``).

    Args:
        joint: AOTAutograd's joint graph (``primals_*`` then ``tangents_*``).
        num_fwd_outputs: its number of forward outputs.
        static_indices: primals with a static lifetime (parameters, buffers).
        labels: a label per primal (Dynamo's placeholder names), or anything of another
            length to label them by their placeholder names.
        graph_id: Dynamo's compile id, for messages.

    Returns:
        ``(JointGraph with model None and fake example values, [(primal, value)])``.

    Raises:
        UnsupportedGraph: a placeholder is neither a primal nor a tangent (RNG
            functionalization, ``torch._functorch.config.functionalize_rng_ops``, is on).
    """
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    primals = [n.name for n in placeholders if n.name.startswith("primals")]
    tangents = [n.name for n in placeholders if n.name.startswith("tangents")]
    other = [n.name for n in placeholders if n.name not in primals and n.name not in tangents]
    if other:
        raise UnsupportedGraph(
            f"graph {graph_id}: joint placeholders {other} are neither primals nor tangents (RNG "
            "functionalization, torch._functorch.config.functionalize_rng_ops, is on?); the remat "
            "backend replays RNG state itself: turn that option off"
        )
    joint, mutations = split_input_mutations(joint, primals)
    static = set(static_indices)
    vals = {n.name: n.meta.get("val") for n in placeholders}
    joint_graph = JointGraph(
        gm=joint,
        primals=primals,
        tangents=tangents,
        num_fwd_outputs=num_fwd_outputs,
        primal_values=[vals[p] for p in primals],
        primal_kinds=["param" if i in static else "input" for i in range(len(primals))],
        primal_labels=list(labels) if len(labels) == len(primals) else primals,
        tangent_values=[vals[t] for t in tangents],
        model=None,  # Dynamo hands over a graph, not a module
    )
    return joint_graph, mutations


_OWN_STORAGE_OUTPUTS = ("non_alias", "unsafe_view_alias", "custom_function_view")
_INTERMEDIATE_ALIASES = ("alias_of_intermediate", "alias_of_intermediate_save_as_output")


def output_roles(fw_metadata: Any, num_fwd_outputs: int, num_tangents: int
                 ) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Which forward output of the partitioned graph, and which tangent of its backward,
    each output the caller receives corresponds to.

    AOTAutograd's forward returns ``(*mutated inputs, *user outputs, *intermediate
    bases)`` and its backward takes one tangent per entry of that list that is
    differentiable: a mutated input that requires grad, a user output that is not an
    alias (``non_alias``, ``unsafe_view_alias``, ``custom_function_view``) and requires
    grad for backward, every intermediate base
    (``torch/_functorch/_aot_autograd/graph_capture_wrappers.py``,
    ``fn_prepped_for_autograd``). An output that is a view of an intermediate is
    regenerated at run time from its base (``output_info[k].base_idx``), so its storage
    is the base's.

    Args:
        fw_metadata: AOTAutograd's ``ViewAndMutationMeta`` (``TracingContext.fw_metadata``
            while the forward compiles), or None when not known.
        num_fwd_outputs: the joint's forward outputs.
        num_tangents: the joint's tangents.

    Returns:
        ``(output_joint, output_tangent)``: per user output, the index of the forward
        output holding its storage and the index of its tangent (None where none). With
        no metadata, output k is forward output k and, when every forward output has a
        tangent, tangent k.
    """
    if fw_metadata is None:
        k = num_fwd_outputs
        return tuple(range(k)), tuple(range(k)) if num_tangents == k else tuple([None] * k)
    mutated = [fw_metadata.input_info[i] for i in fw_metadata.mutated_inp_runtime_indices]
    outs = list(fw_metadata.output_info)
    num_mutated, num_user = len(mutated), len(outs)
    user_tangent: list[int | None] = []
    t = sum(1 for m in mutated if m.mutates_data and m.requires_grad)
    for o in outs:
        has = (o.output_type.name in _OWN_STORAGE_OUTPUTS and isinstance(o.raw_type, type)
               and issubclass(o.raw_type, torch.Tensor) and bool(getattr(o, "requires_grad_for_backward", o.requires_grad)))
        user_tangent.append(t if has else None)
        t += has
    base_tangent0 = t
    joint: list[int | None] = []
    tangent: list[int | None] = []
    for k, o in enumerate(outs):
        kind = o.output_type.name
        if kind in _OWN_STORAGE_OUTPUTS:
            joint.append(num_mutated + k)
            tangent.append(user_tangent[k])
        elif kind in _INTERMEDIATE_ALIASES and o.base_idx is not None:
            joint.append(num_mutated + num_user + o.base_idx)
            tangent.append(base_tangent0 + o.base_idx if base_tangent0 + o.base_idx < num_tangents else None)
        elif kind == "alias_of_intermediate_base_is_user_output" and o.base_idx is not None:
            joint.append(num_mutated + o.base_idx)
            tangent.append(user_tangent[o.base_idx])
        else:  # an alias of an input, or an input: no storage of its own
            joint.append(None)
            tangent.append(None)
    return tuple(joint), tuple(tangent)


