"""Op-level policies: which values of each layer are kept and which are recomputed,
as Megatron-LM's recompute modules and as JAX's named save policies.

Module kinds (``KINDS``, Megatron-Core's ``--recompute-modules`` names) are found in
every layer of the stack from the module paths recorded on the nodes
(``nn_module_stack``) and from the data flow between projections:

- ``core_attn``: a module called like Megatron's (``core_attention``,
  ``DotProductAttention``) when the layer has one; else, by data flow: softmax over a
  product of two activations (query x key), or a scaled-dot-product attention op, and everything between the query / key / value
  projections and the output projection (scores, mask, softmax, attention dropout,
  attention over values): upstream back to projections, downstream while every other
  input comes from projections (not from the residual stream). Found by data flow, so
  it works for a Hugging Face attention module and for attention written inline.
- ``mlp``: a child module of the layer whose class name says MLP / feed-forward
  (``GPT2MLP``, ``LlamaMLP``), else two projections joined through an activation.
- ``layernorm``: child modules of the layer whose class name contains ``Norm``.
- ``moe``: the child module that owns an ``experts`` container; ``moe_act``: the
  activations inside its experts; ``shared_experts``: modules named ``shared_expert*``.

``module_names={"mlp": ("ffn",)}`` names the modules of a kind (paths relative to a
layer; ``fnmatch`` patterns) when they are not recognised.

Semantics: ``recompute_modules`` (Megatron-LM ``--recompute-granularity selective`` is
``core_attn`` alone, ``--recompute-modules`` any list) keeps every value outside the
named modules and recomputes the values inside them that the modules' own backward
reads; a value of a module read by backward outside the module (its output, read by
the next projection's weight gradient) is saved. Save policies follow
``jax.checkpoint_policies``: ``dots_saveable`` (alias ``checkpoint_dots``) keeps matmul
and attention outputs, ``dots_with_no_batch_dims_saveable`` keeps only matmuls without
batch dimensions (projections), ``nothing_saveable`` / ``everything_saveable``,
``save_only_these_names`` / ``save_anything_except_these_names`` (names: joint node
names, or module paths relative to a layer, meaning that module's outputs). A kept value
is saved only when backward or a recompute needs it. Random ops that are recomputed
replay their RNG state (``rewrite``); a partition that would not is refused.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
import re
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from ..errors import InvalidSchedule
from ..graph.module_paths import normalize_module_path
from .partition import OpLevelChoice, Partition, op_level_partition
from ..graph.regions import LayerStack
from .schedule import Schedule
from ..graph.trace import JointGraph

KINDS = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts")
POLICIES = ("everything_saveable", "nothing_saveable", "dots_saveable", "checkpoint_dots",
            "dots_with_no_batch_dims_saveable", "save_only_these_names", "save_anything_except_these_names")

_aten = torch.ops.aten
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution"}
_NO_BATCH_MATMULS = {"mm", "addmm", "linear"}
_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "scaled_dot_product_attention", "_flash_attention_forward", "_efficient_attention_forward"}
_SOFTMAX = {"_softmax", "softmax", "_safe_softmax"}
_ACTIVATIONS = {"gelu", "silu", "relu", "tanh", "sigmoid", "elu", "leaky_relu", "hardswish", "mish", "softplus",
                "hardtanh", "relu6"}
_VIEWS = {"t", "transpose", "view", "_unsafe_view", "reshape", "permute", "expand", "detach", "alias",
          "unsqueeze", "squeeze", "slice", "select", "as_strided"}
_MLP_CLASS = re.compile(r"mlp|feedforward|feed_forward|ffn", re.IGNORECASE)
_NORM_CLASS = re.compile(r"norm", re.IGNORECASE)
_CORE_CLASS = re.compile(r"core_?attention|core_attn|dotproductattention", re.IGNORECASE)
_ACT_CLASS = re.compile(r"act|gelu|silu|relu|swish|glu", re.IGNORECASE)


def op_name(node: fx.Node) -> str:
    """The aten op's name without overload (``addmm``), or ``""`` for other nodes."""
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if node.op == "call_function" else ""


@dataclasses.dataclass(frozen=True)
class LayerNodes:
    """The forward nodes of the stack's layers, read for module kinds.

    Attributes:
        layers: per layer, its computed forward nodes (call_function) in graph order.
        module_of: node -> innermost recorded module path relative to its layer
            (``attn.c_attn``; ``""``: the layer itself).
        classes: node -> the recorded class names of its modules inside the layer,
            outermost first, with their relative paths.
        params: the joint's parameter placeholders.
        seq_forward: autograd sequence number -> the forward nodes that carry it (a
            backward node with the same number is part of their gradient).
    """

    layers: dict[int, list[fx.Node]]
    module_of: dict[fx.Node, str]
    classes: dict[fx.Node, tuple[tuple[str, str], ...]]
    params: frozenset[fx.Node]
    seq_forward: dict[int, list[fx.Node]]


def layer_nodes(joint: JointGraph, stack: LayerStack) -> LayerNodes:
    """Read the stack's forward nodes, their module paths and sequence numbers."""
    forward = set(stack.forward_nodes)
    layers: dict[int, list[fx.Node]] = {}
    module_of: dict[fx.Node, str] = {}
    classes: dict[fx.Node, tuple[tuple[str, str], ...]] = {}
    seq_forward: dict[int, list[fx.Node]] = {}
    base = f"{stack.path}." if stack.path else ""
    for n in joint.gm.graph.nodes:
        if n.name not in forward or n.op != "call_function":
            continue
        if n.meta.get("seq_nr") is not None:
            seq_forward.setdefault(n.meta["seq_nr"], []).append(n)
        layer = stack.layer_of.get(n.name)
        if layer is None:
            continue
        layers.setdefault(layer, []).append(n)
        prefix = base + stack.child_names[layer]
        inside = []
        for value in (n.meta.get("nn_module_stack") or {}).values():
            path, kind = (value[0], value[1]) if isinstance(value, tuple) else (str(value), "")
            path = normalize_module_path(str(path))
            if path.startswith(prefix + "."):
                name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
                inside.append((path[len(prefix) + 1:], name.rsplit(".", 1)[-1]))
        module_of[n] = inside[-1][0] if inside else ""
        classes[n] = tuple(inside)
    names = set(joint.primals)
    params = frozenset(n for n in joint.gm.graph.nodes if n.op == "placeholder" and n.name in names
                       and joint.primal_kinds[joint.primals.index(n.name)] == "param")
    return LayerNodes(layers, module_of, classes, params, seq_forward)


def _reads_parameter(n: fx.Node, params: frozenset[fx.Node]) -> bool:
    """Whether an input of ``n`` is a parameter, possibly through views (``t``)."""
    for a in n.all_input_nodes:
        while a not in params and op_name(a) in _VIEWS and a.all_input_nodes:
            a = a.all_input_nodes[0]
        if a in params:
            return True
    return False


def _is_projection(n: fx.Node, params: frozenset[fx.Node]) -> bool:
    return op_name(n) in _MATMULS and _reads_parameter(n, params)


def _core_attention(nodes: list[fx.Node], params: frozenset[fx.Node]) -> set[fx.Node]:
    """The attention between projections of one layer (see the module docstring)."""
    inside = set(nodes)
    stop = {n for n in nodes if _is_projection(n, params)}

    def up(start: fx.Node, outside_ok: bool) -> set[fx.Node] | None:
        """``start`` and its ancestors in the layer back to projections. Reaching a
        value from outside the layer (a mask, or the residual stream) stops there
        when ``outside_ok``, else gives None."""
        out: set[fx.Node] = set()
        todo = [start]
        while todo:
            n = todo.pop()
            if n in out or n in stop or n.op in ("placeholder", "get_attr"):
                continue
            if n not in inside:
                if outside_ok:
                    continue
                return None
            out.add(n)
            todo.extend(n.all_input_nodes)
        return out

    def attends(n: fx.Node) -> bool:
        if op_name(n) in _ATTENTION:
            return True
        # softmax over the product of two activations (query x key), not a router
        if op_name(n) not in _SOFTMAX:
            return False
        region = up(n, True) or set()
        return any(op_name(m) in _MATMULS and not _reads_parameter(m, params)
                                           for m in region)

    region: set[fx.Node] = set()
    for anchor in (n for n in nodes if attends(n)):
        region |= up(anchor, True) or {anchor}
    changed = True
    while changed:  # downstream of the attention, up to the output projection
        changed = False
        for n in nodes:
            if n in region or n in stop or not any(a in region for a in n.all_input_nodes):
                continue
            extra = [up(a, False) for a in n.all_input_nodes if a not in region]
            if all(e is not None for e in extra):
                region |= {n}.union(*extra)
                changed = True
    return {n for n in region if n.op == "call_function"}


def _between(first: fx.Node, last: fx.Node, nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes on a path from ``first`` to ``last`` (both included)."""
    below = _reach(first, lambda n: n.users, set(nodes))
    return _reach(last, lambda n: n.all_input_nodes, below)


def _reach(start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]], within: set[fx.Node]) -> set[fx.Node]:
    """Nodes of ``within`` reachable from ``start`` by ``step(node) -> next nodes``."""
    seen: set[fx.Node] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in seen or n not in within:
            continue
        seen.add(n)
        todo.extend(step(n))
    return seen


def _mlp(ln: LayerNodes, nodes: list[fx.Node], attention: set[fx.Node]) -> set[fx.Node]:
    """An MLP child module, else two projections joined through an activation."""
    children = {ln.classes[n][0] for n in nodes if ln.classes[n]}
    named = {path for path, cls in children if "." not in path and _MLP_CLASS.search(cls)}
    if named:
        return {n for n in nodes if ln.module_of[n].split(".")[0] in named}
    next_to_attention = {a for n in attention for a in n.all_input_nodes} | {u for n in attention for u in n.users}
    projections = [n for n in nodes if _is_projection(n, ln.params) and n not in next_to_attention]
    out: set[fx.Node] = set()
    for p1 in projections:
        for p2 in projections:
            if p2 is p1:
                continue
            path = _between(p1, p2, nodes)
            if path and not (path - {p1, p2}) & set(projections) and any(
                    op_name(n) in _ACTIVATIONS or any(_ACT_CLASS.search(c) for _, c in ln.classes[n])
                    for n in path):
                modules = {ln.module_of[p1], ln.module_of[p2]} - {""}
                out |= path | {n for n in nodes if ln.module_of[n] in modules}
    return out


def _matches(path: str, patterns: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") or fnmatch.fnmatchcase(path, p) for p in patterns)


def module_kinds(joint: JointGraph, stack: LayerStack,
                 module_names: Mapping[str, Sequence[str]] | None = None) -> dict[str, dict[int, frozenset[str]]]:
    """The nodes of every module kind in every layer: ``{kind: {layer: node names}}``
    (kinds with no node in any layer are left out).

    Args:
        joint, stack: the traced step and its layer stack.
        module_names: ``{kind: module paths relative to a layer}`` (``fnmatch``
            patterns) for kinds that are not recognised.

    Raises:
        InvalidSchedule: ``module_names`` names a kind outside ``KINDS``, or a pattern
            that matches no module of any layer (the message lists the layer's modules).
    """
    module_names = dict(module_names or {})
    unknown = sorted(set(module_names) - set(KINDS))
    if unknown:
        raise InvalidSchedule(f"module kind(s) {unknown} are not among {', '.join(KINDS)}")
    ln = layer_nodes(joint, stack)
    out: dict[str, dict[int, frozenset[str]]] = {k: {} for k in KINDS}
    for layer, nodes in ln.layers.items():
        found: dict[str, set[fx.Node]] = {}
        core_modules = {path for n in nodes for path, cls in ln.classes[n] if _CORE_CLASS.search(cls)
                        or _CORE_CLASS.search(path.rsplit(".", 1)[-1])}
        found["core_attn"] = ({n for n in nodes if _matches(ln.module_of[n], core_modules)} if core_modules
                              else _core_attention(nodes, ln.params))
        found["mlp"] = _mlp(ln, nodes, found["core_attn"])
        found["layernorm"] = {n for n in nodes if ln.classes[n] and "." not in ln.classes[n][0][0]
                              and _NORM_CLASS.search(ln.classes[n][0][1])}
        owners = {ln.module_of[n].split(".experts.")[0] for n in nodes if ".experts." in "." + ln.module_of[n] + "."}
        owners = {"" if o.startswith("experts") else o for o in owners}
        found["moe"] = {n for n in nodes if any(o == "" or _matches(ln.module_of[n], [o]) for o in owners)}
        found["moe_act"] = {n for n in found["moe"] if "experts." in ln.module_of[n] + "." and (
            op_name(n) in _ACTIVATIONS or any(_ACT_CLASS.search(c) for _, c in ln.classes[n]))}
        found["shared_experts"] = {n for n in nodes if re.search(r"(^|\.)shared_experts?\b", ln.module_of[n])}
        for kind, patterns in module_names.items():
            found[kind] = {n for n in nodes if _matches(ln.module_of[n], patterns)}
        for kind, chosen in found.items():
            if chosen:
                out[kind][layer] = frozenset(n.name for n in chosen)
    _check_named_modules(module_names, ln, stack)
    return {k: v for k, v in out.items() if v}


def _check_named_modules(module_names: Mapping[str, Sequence[str]], ln: LayerNodes, stack: LayerStack) -> None:
    """Refuse a ``module_names`` pattern that matches no module of any layer (a typo, or
    a name from another model) instead of letting its kind go missing unexplained."""
    paths = sorted({ln.module_of[n] for nodes in ln.layers.values() for n in nodes if ln.module_of[n]})
    for kind, patterns in module_names.items():
        dead = [p for p in patterns if not any(_matches(path, [p]) for path in paths)]
        if dead:
            shown = ", ".join(paths[:24]) + (f", ... ({len(paths)} in all)" if len(paths) > 24 else "")
            raise InvalidSchedule(
                f"--module-kind {kind}={','.join(dead)} (module_names): {', '.join(map(repr, dead))} matches no "
                f"module inside the layers of {stack.path!r}; the modules of its layers are: {shown or 'none'}")


def _outside_readers(joint: JointGraph, stack: LayerStack, ln: LayerNodes, chosen: set[str]
                     ) -> dict[str, tuple[str, str]]:
    """Values of ``chosen`` that a backward node reads whose forward op is outside
    ``chosen`` (by autograd sequence number): they are saved."""
    forward = set(stack.forward_nodes)
    out: dict[str, tuple[str, str]] = {}
    for b in joint.gm.graph.nodes:
        if b.name in forward or b.op != "call_function":
            continue
        owners = ln.seq_forward.get(b.meta.get("seq_nr"), [])
        if owners and any(o.name in chosen for o in owners):
            continue
        for a in b.all_input_nodes:
            if a.name in chosen and a.name not in out:
                of = owners[0].name if owners else "an op"
                out[a.name] = ("read outside its module",
                               f"read by {b.name}, part of the backward of {of}, outside the recomputed modules")
    return out


def recompute_modules(joint: JointGraph, stack: LayerStack, kinds: Sequence[str],
                      module_names: Mapping[str, Sequence[str]] | None = None,
                      schedule: Schedule | None = None) -> Partition:
    """Megatron-Core's ``--recompute-modules`` (``["core_attn"]``: Megatron-LM's
    ``--recompute-granularity selective``) in the stored layers of ``schedule``.

    Args:
        joint, stack: the traced step and its layer stack.
        kinds: module kinds among ``KINDS``.
        module_names: names the modules of kinds that are not recognised (see
            ``module_kinds``).
        schedule: layer-level groups recomputed whole (uniform / block), or None.

    Returns:
        The Partition (``policy`` e.g. ``selective(core_attn)``).

    Raises:
        InvalidSchedule: a kind outside ``KINDS`` (the message lists them), no kind
            given, or a kind the model's layers do not have (the message lists the kinds
            found and how to name modules).
    """
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise InvalidSchedule(f"module kind(s) {bad or '(none)'} are not recompute modules; the kinds are "
                              f"{', '.join(KINDS)}")
    found = module_kinds(joint, stack, module_names)
    missing = [k for k in kinds if k not in found]
    if missing:
        raise InvalidSchedule(
            f"the layers of {stack.path!r} have no module of kind {', '.join(missing)}; kinds found: "
            f"{', '.join(found) or 'none'}. Name its modules (paths inside a layer), e.g. "
            f"module_names={{'{missing[0]}': ('path.in.layer',)}} or --module-kind {missing[0]}=path.in.layer")
    chosen = {name for k in kinds for names in found[k].values() for name in names}
    ln = layer_nodes(joint, stack)
    name = "selective(core_attn)" if list(kinds) == ["core_attn"] else f"recompute_modules({','.join(kinds)})"
    choice = OpLevelChoice(name, frozenset(chosen), _outside_readers(joint, stack, ln, chosen),
                           ("stored layer", "outside the recomputed modules"))
    return op_level_partition(joint, stack, choice, schedule)


def save_policy(joint: JointGraph, stack: LayerStack, policy: str, names: Sequence[str] = (),
                schedule: Schedule | None = None) -> Partition:
    """A JAX-style named save policy (``jax.checkpoint_policies``) in the stored layers.

    Args:
        joint, stack: the traced step and its layer stack.
        policy: one of ``POLICIES``.
        names: for ``save_only_these_names`` / ``save_anything_except_these_names``:
            joint node names, or module paths relative to a layer (that module's
            outputs in every layer).
        schedule: layer-level groups recomputed whole, or None.

    Raises:
        InvalidSchedule: an unknown policy (the message lists ``POLICIES``), names
            missing or given to a policy without names, or a name that is neither a
            node nor a module of a layer (the message lists the modules).
    """
    if policy not in POLICIES:
        raise InvalidSchedule(f"save policy {policy!r} does not exist; the policies are {', '.join(POLICIES)}")
    takes_names = policy in ("save_only_these_names", "save_anything_except_these_names")
    if takes_names != bool(names):
        raise InvalidSchedule(f"{policy} {'needs' if takes_names else 'takes no'} names"
                              + (" (node names or module paths inside a layer)" if takes_names else ""))
    ln = layer_nodes(joint, stack)
    layer_nodes_all = [n for nodes in ln.layers.values() for n in nodes]
    if policy == "everything_saveable":
        recomputable: set[fx.Node] = set()
    elif policy == "nothing_saveable":
        recomputable = set(layer_nodes_all)
    elif policy in ("dots_saveable", "checkpoint_dots"):
        recomputable = {n for n in layer_nodes_all if op_name(n) not in _MATMULS | _ATTENTION}
    elif policy == "dots_with_no_batch_dims_saveable":
        recomputable = {n for n in layer_nodes_all if op_name(n) not in _NO_BATCH_MATMULS}
    else:
        named = _named_values(ln, layer_nodes_all, names)
        recomputable = (set(layer_nodes_all) - named if policy == "save_only_these_names" else named)
    kept = ("user-saved", f"named in {policy}") if policy == "save_only_these_names" else ("saved by policy", policy)
    label = f"{policy}({','.join(names)})" if names else policy
    choice = OpLevelChoice(label, frozenset(n.name for n in recomputable), {}, kept)
    return op_level_partition(joint, stack, choice, schedule)


def _named_values(ln: LayerNodes, nodes: list[fx.Node], names: Sequence[str]) -> set[fx.Node]:
    """Nodes called ``name``, or the outputs of the modules at ``name`` in every layer
    (values of the module read by a node outside it)."""
    by_name = {n.name: n for n in nodes}
    out: set[fx.Node] = set()
    for name in names:
        if name in by_name:
            out.add(by_name[name])
            continue
        inside = {n for n in nodes if _matches(ln.module_of[n], [name])}
        outputs = {n for n in inside if any(u not in inside for u in n.users)}
        if not outputs:
            modules = sorted({ln.module_of[n] for n in ln.layers[min(ln.layers)]} - {""}) if ln.layers else []
            raise InvalidSchedule(f"{name!r} is neither a node of the stack's layers nor a module inside a layer; "
                                  f"the modules of a layer are {', '.join(modules) or 'none'}")
        out |= {n.args[0] if n.target is operator.getitem else n for n in outputs} | outputs
    return out
