"""A mixture-of-experts step predicted for the worst routing under a capacity bound
(``graph/routing``, issue 23): the routing is valid, the figures are exact for it, the
gradients are those of eager PyTorch with the same routing, the notes say so, and its
peak is at least that of the batch's own routing and of other routings under the bound."""

from __future__ import annotations

import json
import random

import pytest
import torch

import scalar_models
from remat_pass.cli.main import main
from remat_pass.errors import RematError
from remat_pass.evaluate.session import Session
from remat_pass.graph.routing import bound_routing, force_routing, routing_indices, unbound_routing, worst_counts
from remat_pass.recompute import schedule as schedules

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS, TOP_K, EXPERTS = 16, 2, 4  # scalar_models.moe: batch 2 x seq 8, top-2 of 4


def test_worst_counts_reach_every_expert_and_fill_the_rest_to_the_bound():
    assert worst_counts(16, 2, 4, 12) == [12, 12, 7, 1]
    assert worst_counts(16, 2, 4, 8) == [8, 8, 8, 8]
    assert worst_counts(16, 2, 4, 100) == [16, 14, 1, 1]  # an expert gets a token at most once
    assert worst_counts(1, 1, 4, 1) == [1, 0, 0, 0]  # fewer token slots than experts
    with pytest.raises(RematError, match="capacity 7 is too small: 16 tokens x top-2 = 32 token slots"):
        worst_counts(16, 2, 4, 7)


@pytest.mark.parametrize("counts", [[12, 12, 7, 1], [16, 16, 0, 0], [8, 8, 8, 8], [0, 16, 3, 13]])
def test_routing_indices_give_each_expert_its_count_and_each_token_distinct_experts(counts):
    idx = routing_indices(counts, TOKENS, TOP_K)
    assert idx.shape == (TOKENS, TOP_K) and idx.dtype == torch.int64
    assert torch.bincount(idx.flatten(), minlength=EXPERTS).tolist() == counts
    assert all(len(set(row)) == TOP_K for row in idx.tolist())


def _peaks(model, inputs, loss_fn) -> tuple[Session, list[int]]:
    session = Session.create(model, inputs, loss_fn)
    peaks = []
    for sch in schedules.distinct_megatron_schedules(3):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
        assert r.max_grad_diff_vs_eager == 0.0, sch.provenance  # eager autograd takes the same routing
        peaks.append(r.measured_peak_bytes)
    return session, peaks


def test_bound_routing_is_exact_noted_and_no_other_routing_under_the_bound_costs_more():
    model, inputs, loss_fn = scalar_models.moe(layers=3)
    session, worst = _peaks(bound_routing(model, 12), inputs, loss_fn)
    assert session.joint.notes[0].startswith("the routing is bound, not this batch's") and \
        "at most 12 tokens per expert (tokens per expert 12, 12, 7, 1" in session.joint.notes[0]
    routed = [n for n in session.joint.notes if "slot, token = torch.where(mask[e])" in n]
    assert len(routed) == 1 and routed[0].startswith("the graph holds for the bound routing only")
    assert "12 calls giving 12, 12, 7, 1, 12, 12, 7, 1, 12, 12, 7, 1 rows" in routed[0]
    others = [None, [8, 8, 8, 8], [12, 12, 8, 0], [1, 11, 12, 8]]
    rng = random.Random(0)
    while len(others) < 7:
        c = [rng.randint(0, 12) for _ in range(EXPERTS - 1)]
        if 0 <= TOKENS * TOP_K - sum(c) <= 12:
            others.append(c + [TOKENS * TOP_K - sum(c)])
    for counts in others:
        model, inputs, loss_fn = scalar_models.moe(layers=3)
        _, peaks = _peaks(model if counts is None else force_routing(model, counts), inputs, loss_fn)
        assert all(p <= w for p, w in zip(peaks, worst)), (counts, peaks, worst)


def test_unbound_routing_restores_the_batch_routing():
    model, inputs, loss_fn = scalar_models.moe(layers=1)
    batch = Session.create(model, inputs, loss_fn).joint.notes
    unbound_routing(bound_routing(model, 16))
    assert Session.create(model, inputs, loss_fn).joint.notes == batch
    with pytest.raises(RematError, match="whole number of tokens >= 1"):
        bound_routing(model, 0)
    with pytest.raises(RematError, match=r"not a routing of 16 tokens to top-2 of 4 experts"):
        Session.create(force_routing(model, [16, 16, 1, 0]), inputs, loss_fn)


def test_sweep_routing_capacity(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    args = ["sweep", "--model", "scalar_models:moe", "--layers", "2"]
    assert main([*args, "--routing-capacity", "10", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["notes"][0].startswith("the routing is bound") and "10, 10, 10, 2" in data["notes"][0]
    assert all(r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in data["rows"])
    assert main([*args, "--routing-capacity", "3"]) == 2
    assert "capacity 3 is too small" in capsys.readouterr().err
    assert main([*args, "--routing-capacity", "10", "--meta"]) == 2
    assert "--routing-capacity traces the routing from a run" in capsys.readouterr().err
