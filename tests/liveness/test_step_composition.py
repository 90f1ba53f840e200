"""The step composition (composition, step_flow) on hand-counted graphs: each
rule of what crosses between graphs pins one lifetime; no torch.compile needed."""

from __future__ import annotations

import pytest

from remat_pass.liveness.intervals import Storage
from remat_pass.liveness.composition import Phase, Place, SpanTensor, compose_step, compose_timeline
from remat_pass.liveness.step_flow import GraphCall, GraphLiveness, step_flow
from solvers.poly import Poly, pareto_max


def _s(nbytes, first, last, name, kind="forward"):
    return Storage(nbytes, first, last, name, None, kind, False)


# graph A: forward 2 steps, backward 2; output 0 (x, 10 B) read by graph B; a saved
# activation (20 B) read at its backward step 0; the gradient of its parameter (40 B).
A = GraphLiveness(
    graph_id="A", forward_steps=("fa0", "fa1"), backward_steps=("ba0", "ba1"), step_layers=(None,) * 4,
    storages=(_s(10, 0, 1, "x", "output"), _s(20, 0, 2, "saved", "saved"), _s(40, 3, 3, "grad_w", "gradient")),
    output_sids=(0,), gradient_sids=(2,), input_last=(-1,), tangent_last=(2,), tangent_nbytes=(10,),
)
# graph B: reads x (primal 0, last at its backward step 0) and a parameter (primal 1);
# forward 1 step (the loss, 4 B), backward 2 steps: x's gradient (10 B), the parameter's (8 B).
B = GraphLiveness(
    graph_id="B", forward_steps=("fb0",), backward_steps=("bb0", "bb1"), step_layers=(None,) * 3,
    storages=(_s(4, 0, 0, "loss", "output"), _s(10, 1, 2, "grad_x", "gradient"), _s(8, 2, 2, "grad_v", "gradient")),
    output_sids=(0,), gradient_sids=(1, 2), input_last=(1, -1), tangent_last=(1,), tangent_nbytes=(4,),
)


def _calls(b_grad_kept=True, b=B):
    return [
        GraphCall(A, "A", (None,), (0,), (0,), (True,)),
        GraphCall(b, "B", ((0, 0), None), (0,), (0,), (None, b_grad_kept)),
    ]


def test_rules_by_hand():
    """Phases F_A F_B B_B B_A. x crosses (held until the last forward ends and B's
    backward reads it), B's gradient for x is A's tangent (until A reads it), the loss
    and its tangent live to the end, a kept parameter gradient lives to the end."""
    flow = step_flow(_calls(), backward_order=[1, 0])
    assert [(p.graph, p.kind) for p in flow.phases] == [("A", "forward"), ("B", "forward"),
                                                       ("B", "backward"), ("A", "backward")]
    step = compose_step(flow.phases, flow.tensors)
    spans = {(t.graph, t.name): (step.offsets[t.start.phase] + t.start.step, step.offsets[t.end.phase] + t.end.step, t.kind)
             for t in step.tensors}
    assert spans == {
        ("A", "x"): (0, 3, "crossing"),
        ("A", "saved"): (0, 5, "saved"),
        ("A", "grad_w"): (6, 6, "gradient"),
        ("B", "loss"): (2, 6, "loss"),
        ("B", "grad_x"): (3, 5, "passed gradient"),
        ("B", "grad_v"): (4, 6, "gradient"),
        ("B", "tangent 0"): (3, 6, "loss tangent"),
    }
    assert step.timeline == (30, 30, 34, 48, 46, 46, 56)
    assert (step.peak_bytes, step.peak_place.graph, step.peak_place.kind, step.peak_place.node) == (
        56, "A", "backward", "ba1")
    assert [t.name for t in step.live_at_peak()] == ["grad_w", "grad_v", "loss", "tangent 0"]
    assert step.phase_peaks() == [30, 34, 48, 56]
    assert step.live_bytes_by_kind(step.peak_place.index) == {"gradient": 48, "loss": 4, "loss tangent": 4}


def test_added_gradient_and_zero_tangent():
    """A parameter whose .grad exists gets its gradient added and freed when its backward
    returns; an output that gets no gradient from a later graph gets a tangent of zeros,
    made when its backward starts and dead at its last use."""
    no_grad_x = GraphLiveness(**{**B.__dict__, "gradient_sids": (None, 2)})
    flow = step_flow(_calls(b_grad_kept=False, b=no_grad_x), backward_order=[1, 0])
    step = compose_step(flow.phases, flow.tensors)
    kinds = {(t.graph, t.name): (step.offsets[t.start.phase] + t.start.step, step.offsets[t.end.phase] + t.end.step, t.kind)
             for t in step.tensors}
    assert kinds[("B", "grad_v")] == (4, 4, "added gradient")
    assert kinds[("A", "tangent 0")] == (5, 5, "zero tangent")


def test_symbolic_sizes_compose_to_polynomials():
    """Sizes that are polynomials in a shape symbol compose to one polynomial per step;
    evaluated, they are the concrete timeline."""
    p = Poly({(1,): 3})  # 3 * batch bytes
    f = Phase("g", "forward", ("a", "b"))
    tensors = [SpanTensor("t", "g", "forward", p, Place(0, 0), Place(0, 1)),
               SpanTensor("u", "g", "forward", p * 2, Place(0, 1), Place(0, 1))]
    timeline = compose_timeline([f], tensors, zero=Poly())
    assert [q.evaluate([5]) for q in timeline] == [15, 45]
    assert pareto_max(timeline) == [Poly({(1,): 9})]


def test_bad_places_are_refused():
    f = Phase("g", "forward", ("a",))
    with pytest.raises(ValueError, match="ends"):
        compose_step([f, Phase("g", "backward", ("b", "c"))],
                     [SpanTensor("t", "g", "saved", 1, Place(1, 1), Place(1, 0))])
    with pytest.raises(ValueError, match="outside"):
        compose_step([f], [SpanTensor("t", "g", "saved", 1, Place(0, 0), Place(2, 0))])
    with pytest.raises(ValueError, match="kind"):
        compose_step([Phase("g", "sideways", ())], [])
    with pytest.raises(ValueError, match="distinct"):
        step_flow(_calls(), backward_order=[1, 1])
