"""Pipeline schedules and the per-rank composition, without processes."""

from __future__ import annotations

import pytest
import torch

from remat_pass.errors import InvalidOption, RematError
from remat_pass.models import tiny_llama
from remat_pass.parallel.ranks import ParallelConfig, fake_process_group, predict_rank, trace_rank
from remat_pass.liveness.composition import compose_step
from remat_pass.parallel.pipeline import StageProfile, compose, rank_composition
from remat_pass.parallel.pipeline_schedule import Action, rank_actions, send_releases, simulate, stage_layers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    return [rank_actions(schedule, r, p, m, v) for r in range(p)]


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 4, 1),
                                            ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 4, 3)])
def test_every_rank_runs_each_forward_then_its_backward_once_without_deadlock(schedule, p, m, v):
    acts = orders(schedule, p, m, v)
    for r, a in enumerate(acts):
        stages = {c * p + r for c in range(v)}
        assert sorted((x.stage, x.kind, x.microbatch) for x in a) == sorted(
            (s, k, j) for s in stages for k in "FB" for j in range(m))
        for x in a:
            if x.kind == "B":
                assert a.index(Action(x.stage, "F", x.microbatch)) < a.index(x)
    simulate(acts, p * v, send_releases(acts, p * v))


def test_1f1b_warm_up_is_megatrons_and_gpipe_runs_all_forwards_first():
    for r in range(4):
        a = rank_actions("1f1b", r, 4, 8)
        assert [x.kind for x in a[: 4 - r]] == ["F"] * (4 - r) and a[4 - r].kind == "B"
    assert [x.kind for x in rank_actions("gpipe", 1, 4, 8)] == ["F"] * 8 + ["B"] * 8


def test_interleaved_warm_up_is_megatrons():
    """(p - rank - 1) * 2 + (v - 1) * p forwards before the first backward."""
    for r in range(4):
        a = rank_actions("interleaved", r, 4, 8, 2)
        first_b = next(i for i, x in enumerate(a) if x.kind == "B")
        assert first_b == (4 - r - 1) * 2 + 4 + 1


def test_waiting_each_send_at_the_next_action_deadlocks_interleaved_so_releases_move():
    acts = orders("interleaved", 2, 4, 2)
    with pytest.raises(RematError, match="deadlock"):
        simulate(acts, 4, [[k + 1 for k in range(len(a))] for a in acts])
    assert send_releases(orders("1f1b", 4, 8), 4) == [[k + 1 for k in range(16)]] * 4


def _profile(stage: int, saved: int, first: bool = False, last: bool = False) -> StageProfile:
    """One unit = 1 MiB: forward grows to the saved values, backward holds them and its
    working set of 2 units, then the gradients (1 unit)."""
    u = 1 << 20
    return StageProfile(stage, "none", (saved * u // 2, saved * u), (saved * u + 2 * u, 1 * u), ("f0", "f1"),
                        ("b0", "b1"), saved * u, 0 if first else u, 1, 0 if last else u, 0 if last else u, 0,
                        0 if first else u, u, 0)


def test_compose_1f1b_holds_p_minus_i_microbatches_and_gpipe_all_m():
    p, m = 4, 8
    profiles = {s: _profile(s, 4, s == 0, s == p - 1) for s in range(p)}
    for r in range(p):
        one = compose({r: profiles[r]}, rank_actions("1f1b", r, p, m))
        assert one.in_flight == p - r
        gpipe = compose({r: profiles[r]}, rank_actions("gpipe", r, p, m))
        assert gpipe.in_flight == m and gpipe.held_bytes == (m - 1) * 4 * (1 << 20)


def test_compose_by_hand_1f1b_two_stages():
    """p = 2, m = 3, saved 4 units (module docstring of pipeline). Stage 0, ``static``:
    at B0's first step it holds F1's saved values (4), its own working set (6) and the
    received output gradient (1); F1's send was waited at B0's receive. ``in_step``
    adds B0's parameter gradients (1) at B1, which holds F2 (4): 12. Stage 1 (last)
    holds no microbatch across actions (F then B at once): its working set, plus the
    accumulator."""
    u = 1 << 20
    profiles = {s: _profile(s, 4, s == 0, s == 1) for s in range(2)}
    peaks = {(r, acc): compose({r: profiles[r]}, rank_actions("1f1b", r, 2, 3), grad_accumulator=acc)
             for r in range(2) for acc in ("static", "in_step")}
    fields = {k: (p.peak_bytes // u, p.action, p.node, p.held_bytes // u, p.accumulator_bytes // u,
                  p.buffer_bytes // u, p.microbatch_bytes // u, p.in_flight) for k, p in peaks.items()}
    assert fields == {
        (0, "static"): (11, "B0", "b0", 4, 0, 1, 6, 2),
        (0, "in_step"): (12, "B1", "b0", 4, 1, 1, 6, 2),
        (1, "static"): (6, "B0@s1", "b0", 0, 0, 0, 6, 1),
        (1, "in_step"): (7, "B1@s1", "b0", 0, 1, 0, 6, 1),
    }


def test_compose_is_the_composition_of_the_ranks_phases_and_tensors():
    """The rank's peak is ``compose_step``'s over ``rank_composition``: a phase per
    action (its receive first), and the peak's split sums the live tensors by kind."""
    profiles = {s: _profile(s, 4, s == 0, s == 3) for s in range(4)}
    actions = rank_actions("1f1b", 1, 4, 8)
    phases, tensors, in_flight = rank_composition({1: profiles[1]}, actions)
    assert [p.graph for p in phases] == [str(a) for a in actions] and all(p.steps[0] == "recv" for p in phases)
    assert {t.kind for t in tensors} == {"microbatch", "held", "received", "sent", "accumulator"}
    step = compose_step(phases, tensors)
    peak = compose({1: profiles[1]}, actions)
    assert (peak.peak_bytes, peak.action, peak.node, peak.in_flight) == (
        step.peak_bytes, step.peak_place.graph, step.peak_place.node, in_flight)
    assert peak.held_bytes + peak.accumulator_bytes + peak.buffer_bytes + peak.microbatch_bytes == peak.peak_bytes
    with pytest.raises(RematError, match="forward has not run"):
        compose({1: profiles[1]}, [Action(1, "B", 0)])
    with pytest.raises(RematError, match="no profile for stage 2"):
        compose({1: profiles[1]}, [Action(2, "F", 0)])


@pytest.mark.slow
def test_stage_peaks_of_1f1b_fall_with_the_stage_index_and_gpipe_holds_every_microbatch():
    """Traced with the fake process group (p = 4, m = 8, one layer per stage): under
    1F1B stage i holds p - i microbatches and its peak falls with i among the stages
    without the head; under GPipe every stage holds all m. Measured in
    benchmarks/distributed.py."""
    model, inputs, _ = tiny_llama(batch=8, seq=16, layers=4, hidden=32, ffn=64, vocab=64)
    f1b, gpipe = ParallelConfig(pp=4, microbatches=8), ParallelConfig(pp=4, microbatches=8, pipeline_schedule="gpipe")
    one, gp = [], []
    for rank in range(4):
        with fake_process_group(rank, 4):
            graphs = trace_rank(model, inputs, f1b, rank)
        one.append(predict_rank(graphs, f1b, rank, "none"))
        gp.append(predict_rank(graphs, gpipe, rank, "none"))
    assert [p.peak.in_flight for p in one] == [4, 3, 2, 1]
    assert one[0].peak_bytes > one[1].peak_bytes > one[2].peak_bytes
    held = [p.peak.held_bytes for p in one]
    assert held[0] > held[1] > held[2] and held[3] == 0
    assert [p.peak.in_flight for p in gp] == [8] * 4
    assert all(g.peak_bytes > o.peak_bytes for g, o in zip(gp, one))


def test_stage_split_refuses_uneven_layers():
    assert stage_layers(8, 4)[1] == range(2, 4)
    with pytest.raises(InvalidOption, match="legal values: \\[1, 2, 3, 6\\]"):
        stage_layers(6, 4)


@pytest.mark.slow
def test_tp_x_pp_ranks_traced_one_after_another_in_one_process():
    """Every rank of t = 2 x p = 2 traced in turn under the fake process group: the
    process groups of ranks 2 and 3 are named differently from those of ranks 0 and 1,
    so DTensor's caches must not carry the earlier ranks' meshes over (they did:
    "Could not resolve the process group registered under the name 3")."""
    from remat_pass.parallel.plan import predict_config

    model, inputs, _ = tiny_llama(batch=4, seq=16, layers=2, hidden=32, ffn=64, vocab=64)
    preds = predict_config(model, inputs, ParallelConfig(tp=2, sp=True, pp=2, microbatches=2), [("none", None)])
    assert [rp[0].stages for rp in preds] == [(0,), (0,), (1,), (1,)]
    assert preds[0][0].peak_bytes == preds[1][0].peak_bytes and preds[2][0].peak_bytes == preds[3][0].peak_bytes
