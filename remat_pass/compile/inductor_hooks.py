"""Hooks the backend puts around Inductor's compile of each graph: keep the generated
code (what runs, for ``inductor_memory``) and keep Inductor from fusing kernels of
different layers.

Code: ``compile_fx(..., inner_compile=capture_inner_compile(on_code))`` calls Inductor's
own ``compile_fx_inner`` for the forward and, at the first backward, for the backward
graph, and hands ``on_code("forward" | "backward", source)`` the wrapper code of the
result (``CompiledFxGraph.source_code``, ``torch/_inductor/output_code.py``).

Fusion: Inductor's scheduler may fuse two kernels of different layers horizontally
(consumer/consumer, e.g. the recomputed softmax+dropout of layers 11 and 10 of GPT-2,
which share reads of the causal mask and of ``inductor_seeds``); to run the fused
kernel it schedules layer 10's recompute before layer 11's backward, and two groups'
recomputed activations are live at once, which the schedule promised not to do.
``no_cross_layer_fusion()`` (an ``InductorChoices``, ``torch/_inductor/choices.py``, asked
before every horizontal fusion) refuses a fusion of nodes of disjoint layers; the layer
of an Inductor node is that of the fx nodes it comes from (``node.get_origins()``,
tagged ``meta["remat_layer"]`` by the backend). It is installed only around this
backend's compiles (``V.set_choices_handler``, per thread).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


def _layers(snode: Any) -> set[int]:
    """The layers of the fx nodes an Inductor scheduler node comes from."""
    out: set[int] = set()
    for n in snode.get_nodes():
        ir = getattr(n, "node", None)
        if ir is None:
            continue
        for origin in ir.get_origins():
            layer = origin.meta.get("remat_layer")
            if layer is not None:
                out.add(layer)
    return out


def no_cross_layer_fusion() -> Any:
    """An ``InductorChoices`` that is Inductor's, except that two nodes of disjoint
    layers are never fused horizontally (its ``blocked`` counts the refusals).
    ``torch._inductor`` is imported here, when Inductor is used, not with remat_pass."""
    from torch._inductor.choices import InductorChoices

    class NoCrossLayerFusion(InductorChoices):
        blocked = 0

        @staticmethod
        def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            a, b = _layers(node1), _layers(node2)
            if a and b and a.isdisjoint(b):
                NoCrossLayerFusion.blocked += 1
                return False
            return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    return NoCrossLayerFusion()


def capture_inner_compile(on_code: Callable[[str, str], None]) -> Callable[..., Any]:
    """An ``inner_compile`` for ``compile_fx`` that compiles with ``compile_fx_inner``
    under ``no_cross_layer_fusion()`` and passes each graph's wrapper code to
    ``on_code``. ``torch._inductor`` is imported here, when Inductor is used."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    def inner(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        with V.set_choices_handler(no_cross_layer_fusion()):
            out = compile_fx_inner(gm, example_inputs, **kwargs)
        code = getattr(out, "source_code", None)
        if isinstance(code, str):
            on_code("backward" if kwargs.get("is_backward") else "forward", code)
        return out

    return inner
