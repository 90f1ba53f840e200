"""Buffer updates of a traced step: a step that writes a buffer or input in place
(BatchNorm's running statistics and ``num_batches_tracked`` in train mode, an
accumulator buffer) traced as a functional graph whose new values are forward outputs.

AOTAutograd (``aot_function``, ``keep_input_mutations=False``) functionalizes such a
write: the joint graph computes the new value and returns it as a forward output
*before* the user's outputs, described by an ``InputMutationAOTOutput`` in the output
node's ``meta["desc"]`` (``torch/_functorch/_aot_autograd/descriptors.py``); its
runtime wrapper then copies it into the input (``runtime_wrappers.py``,
``_apply_input_mutations``-style epilogue). Here the joint keeps the new values as
forward outputs *after* the user's outputs, so forward output 0 stays the loss (or a
stage's activation): every stage sees them as forward outputs (live to the end of the
step, their bytes counted), and the joint stays functional (every node, recomputed
ones included, reads the value a buffer had before the step).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from ..errors import UnsupportedGraph


def move_buffer_updates(
    joint: fx.GraphModule, num_fwd_outputs: int, primal_labels: Sequence[str],
    primal_kinds: Sequence[str], num_tangents: int,
) -> tuple[int, tuple[int, ...]]:
    """Put the new values of the step's in-place writes after its user outputs.

    Args:
        joint: AOTAutograd's joint graph (modified in place: its output list is
            reordered to ``[*user outputs, *new values, *gradients]``).
        num_fwd_outputs: AOTAutograd's number of forward outputs (new values first).
        primal_labels, primal_kinds: the label and kind of every primal (in order).
        num_tangents: the joint graph's number of tangent placeholders.

    Returns:
        ``(number of forward outputs, the primal index each new value is written to)``;
        ``(1, ())`` when nothing is written.

    Raises:
        UnsupportedGraph: a forward output other than one user output and the new
            values (an alias of an input), a write to a value that requires grad or
            changes a primal's shape / dtype / strides (a metadata mutation), or a
            write to a part of a flattened tensor subclass.
    """
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput, PlainAOTInput

    out = joint.graph.output_node()
    outs = list(out.args[0])
    descs = list(out.meta.get("desc") or [None] * len(outs))
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    updates = [d for d in descs[:num_fwd_outputs] if isinstance(d, InputMutationAOTOutput)]
    num_user = num_fwd_outputs - len(updates)
    if not updates and num_fwd_outputs != 1:
        raise UnsupportedGraph(
            f"the traced step has {num_fwd_outputs} forward outputs instead of the loss "
            "alone: it returns an alias of an input or several outputs. Return the loss "
            "(or one activation for a pipeline stage)."
        )
    if not updates:
        return num_fwd_outputs, ()
    written = [primal_labels[d.mutated_input.idx] if isinstance(d.mutated_input, PlainAOTInput)
               and d.mutated_input.idx < len(primal_labels) else str(d.mutated_input) for d in updates]
    if num_user != 1 or num_tangents != 1 or not all(isinstance(d, InputMutationAOTOutput) for d in descs[:len(updates)]):
        raise UnsupportedGraph(
            f"the traced step writes {', '.join(written)} in place and has {num_user} other forward "
            f"outputs and {num_tangents} tangents: a written value requires grad (a parameter or an "
            "input that requires grad), or the step returns an alias of an input. Only buffers and inputs "
            "that do not require grad may be written in place (an optimizer step belongs outside the "
            "traced step); remove that write or return a new tensor."
        )
    targets = []
    for d, value in zip(updates, outs[: len(updates)]):
        idx = d.mutated_input.idx if isinstance(d.mutated_input, PlainAOTInput) else None
        if idx is None or idx >= len(primals) or len(primals) != len(primal_labels):
            raise UnsupportedGraph(
                f"the traced step writes a part of a tensor subclass in place ({d.mutated_input}); only "
                "plain tensor buffers and inputs may be written in place")
        old, new = primals[idx].meta.get("val"), value.meta.get("val") if isinstance(value, fx.Node) else None
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and old.shape == new.shape and old.dtype == new.dtype):
            raise UnsupportedGraph(
                f"the traced step changes the shape or dtype of {primal_labels[idx]} in place (a "
                "metadata mutation such as resize_ or t_); only writes of its values can be traced")
        if primal_kinds[idx] == "param":
            raise UnsupportedGraph(
                f"the traced step writes the parameter {primal_labels[idx]} in place; only buffers and "
                "inputs that do not require grad may be written in place (an optimizer step belongs "
                "outside the traced step)")
        targets.append(idx)
    k = len(updates)
    out.args = ([*outs[k:num_fwd_outputs], *outs[:k], *outs[num_fwd_outputs:]],)
    out.meta["desc"] = [*descs[k:num_fwd_outputs], *descs[:k], *descs[num_fwd_outputs:]]
    joint.graph.lint()
    joint.recompile()
    return num_user + k, tuple(targets)


def updated_buffers(
    outputs: Sequence[torch.Tensor], num_user_outputs: int, buffer_updates: Sequence[int],
    primal_labels: Sequence[str],
) -> dict[str, torch.Tensor]:
    """``{primal label: its value after the step}`` from a step's forward outputs
    (``[*user outputs, *new values]``, as ``move_buffer_updates`` orders them)."""
    news = outputs[num_user_outputs:]
    return {primal_labels[i]: v for i, v in zip(buffer_updates, news)}
