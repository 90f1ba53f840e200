"""Inspection tables, graph dumps, per-step measured timeline (remat_pass.report.inspection), and
the per-step storage figures they print (remat_pass.liveness.step_storages)."""

from __future__ import annotations

import json

import pytest
import torch

from remat_pass.recompute import schedule
from remat_pass.cli.main import main
from remat_pass.report.inspection import (
    DUMP_SUFFIX,
    describe_step,
    dump_step,
    load_dump,
    node_table,
    render,
)
from remat_pass.liveness.step_storages import (
    live_bytes_by_layer,
    report_memory,
    saved_storages,
    sized_intervals,
    step_storages,
    storage_intervals,
)
from remat_pass.liveness.timeline import analyze
from remat_pass.measure.run import measure_step, measured_step_timeline
from remat_pass.evaluate.session import Session

CHAIN = ["--model", "remat_pass.models:linear_chain", "--layers", "3"]


def schedules_of(num_layers):
    return [schedule.none(num_layers), schedule.uniform(1, num_layers), schedule.uniform(2, num_layers),
            schedule.block(1, num_layers)]


@pytest.fixture(scope="module")
def chain_session() -> Session:
    from remat_pass.models import linear_chain

    return Session.create(*linear_chain(batch=64, width=128, layers=3))


@pytest.mark.parametrize("allocator", ["cpu", "cuda"])
def test_intervals_sum_to_the_liveness_timeline(gpt2_session, allocator):
    """Summing storage_intervals (and the by-layer split) gives analyze()'s timeline exactly."""
    for sched in schedules_of(gpt2_session.stack.num_layers):
        step, _, _ = gpt2_session.prepare(sched)
        report = analyze(step, allocator)
        n = len(report.timeline)
        live = [0] * n
        for iv in storage_intervals(step, allocator):
            for i in range(iv.first, iv.last + 1):
                live[i] += iv.nbytes
        assert live == [t.live_bytes for t in report.timeline], sched.provenance
        labels, rows = live_bytes_by_layer(step, allocator)
        assert [sum(col) for col in zip(*rows)] == live
        assert labels[0] == "outer" and len(labels) == gpt2_session.stack.num_layers + 1


def test_node_rows_are_consistent_with_the_step(gpt2_session):
    step, report, _ = gpt2_session.prepare(schedule.uniform(2, gpt2_session.stack.num_layers))
    desc = describe_step(step, report)
    nodes = desc["nodes"]
    assert len(nodes) == len(report.timeline)
    # saved marks are exactly the forward values the step saves
    assert {r["name"] for r in nodes if r["saved"]} == set(step.saved) & {r["name"] for r in nodes}
    # recomputed rows: every node of every segment, in run order
    rec = [r for r in nodes if r["kind"] == "recompute"]
    assert len(rec) == sum(len(s.nodes) for s in step.segments)
    assert [s["first_step"] for s in desc["segments"]] == sorted(s["first_step"] for s in desc["segments"])
    assert [s["insert_before"] for s in desc["segments"]] == [s.insert_before for s in step.segments]
    # live bytes move by what a step allocates and what the step before freed
    for prev, row in zip(nodes, nodes[1:]):
        assert row["live_bytes"] == (prev["live_bytes"] - prev["freed_bytes"] - prev["scratch_bytes"]
                                     + row["alloc_bytes"] + row["scratch_bytes"]), row
    # every byte allocated is freed by the last step
    assert sum(r["alloc_bytes"] for r in nodes) == sum(r["freed_bytes"] for r in nodes)
    # saved table: sizes sum to the report's saved activation bytes
    assert sum(s["bytes"] for s in desc["saved"] if not s["static"]) == report.saved_activation_bytes
    assert any("RNG state" in s["why"] for s in desc["saved"])  # dropout 0.1 in a recomputed group
    json.dumps(desc)  # JSON-ready


def test_tables_render(gpt2_session):
    step, report, _ = gpt2_session.prepare(schedule.uniform(1, gpt2_session.stack.num_layers))
    desc = describe_step(step, report)
    text = render(desc)
    for title in ("== forward graph ==", "== backward graph ==", "== saved activations ==",
                  "== recompute segments, in run order =="):
        assert title in text
    assert "recomputed" in text and report.peak_node in text
    only = node_table(desc, "backward", layer="1")
    lines = only.splitlines()[2:]
    assert lines and all(line.split()[3] == "1" for line in lines)
    with pytest.raises(ValueError):
        node_table(desc, "sideways")
    with pytest.raises(ValueError):
        render(desc, ["nope"])


def test_dump_round_trip(gpt2_session, tmp_path):
    step, report, _ = gpt2_session.prepare(schedule.block(2, gpt2_session.stack.num_layers))
    path = dump_step(step, report, tmp_path / "dumps", "graph 0/fw", meta={"model": "tiny"})
    assert path.name == "graph_0_fw" + DUMP_SUFFIX and path.parent.is_dir()
    sections = ["summary", "forward", "backward", "saved", "segments", "code"]
    assert render(load_dump(path), sections) == render(describe_step(step, report, {"model": "tiny"}), sections)


def test_load_dump_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_dump(bad)
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a remat-pass graph dump"):
        load_dump(bad)
    bad.write_text(json.dumps({"format": "remat-pass-graph", "format_version": 99}))
    with pytest.raises(ValueError, match="upgrade"):
        load_dump(bad)


def test_measured_timeline_is_aligned_with_the_prediction(chain_session):
    """Per-step measured bytes: one per step, same peak as measure_step; on a Linear chain
    every step equals the prediction except the backward mm's that read the stride-0
    ``expand`` of the loss gradient (or its transpose): ATen copies it to a contiguous [batch, width] buffer
    inside the op (unmodelled scratch, +batch*width*4 bytes during that step only)."""
    batch, width = 64, 128
    for sched in schedules_of(3):
        step, report, _ = chain_session.prepare(sched)
        measured = measured_step_timeline(step, chain_session.joint, seed=0)
        assert len(measured) == len(report.timeline)
        assert max(measured) == measure_step(step, chain_session.joint).peak_bytes
        desc = describe_step(step, report)
        readers = {  # ops reading a stride-0 (expanded) tensor
            n.name for n in step.backward.graph.nodes
            if any(isinstance(a.meta.get("val"), torch.Tensor) and 0 in a.meta["val"].stride()
                   for a in n.all_input_nodes)
        }
        for row, m in zip(desc["nodes"], measured):
            if row["name"] in readers and row["op"] == "aten.mm":
                assert m - row["live_bytes"] in (0, batch * width * 4), row
            else:
                assert m == row["live_bytes"], (sched.provenance, row)


def test_measured_timeline_on_gpt2_matches_the_peak(gpt2_session):
    step, report, _ = gpt2_session.prepare(schedule.uniform(1, gpt2_session.stack.num_layers))
    measured = measured_step_timeline(step, gpt2_session.joint, seed=gpt2_session.seed)
    assert max(measured) == measure_step(step, gpt2_session.joint, seed=gpt2_session.seed).peak_bytes
    assert max(measured) == report.peak_bytes
    # a step's measured value is never below the prediction (scratch only adds)
    assert all(m >= p.live_bytes for m, p in zip(measured, report.timeline))


def test_cli_inspect_model_and_graph(tmp_path, capsys):
    assert main(["inspect", *CHAIN, "--schedule", "uniform", "--recompute-num-layers", "2", "--dump", str(tmp_path)]) == 0
    live = capsys.readouterr().out
    assert "== recompute segments, in run order ==" in live and "recomputed" in live
    (path,) = tmp_path.glob("*" + DUMP_SUFFIX)
    assert main(["inspect", "--graph", str(path)]) == 0
    assert capsys.readouterr().out == live


def test_cli_inspect_errors(tmp_path, capsys):
    assert main(["inspect", *CHAIN, "--schedule", "uniform"]) == 2
    assert "--recompute-num-layers" in capsys.readouterr().err
    assert main(["inspect", *CHAIN, "--schedule", "uniform", "--num-layers", "9"]) == 2
    (tmp_path / "x.json").write_text("[]")
    assert main(["inspect", "--graph", str(tmp_path / "x.json")]) == 2
    assert "not a remat-pass graph dump" in capsys.readouterr().err


def test_storage_intervals_fields(chain_session):
    step, report, _ = chain_session.prepare(schedule.none(3))
    ivs = storage_intervals(step)
    assert all(iv.first <= iv.last for iv in ivs)
    kinds = {iv.kind for iv in ivs}
    assert {"saved", "gradient", "output"} <= kinds
    grads = [iv for iv in ivs if iv.kind == "gradient"]
    assert all(iv.last == len(report.timeline) - 1 for iv in grads)
    assert torch.is_tensor(chain_session.joint.primal_values[0])


def test_step_storages_move_the_timeline(chain_session):
    """What a step allocates and holds as scratch, and what the step before freed, move
    the live bytes from step to step exactly as analyze() counts them; saved values sum
    to the saved activation bytes."""
    for sched in (schedule.none(3), schedule.uniform(1, 3)):
        step, report, _ = chain_session.prepare(sched)
        iv = sized_intervals(step, report_memory(report))
        live, prev = 0, None
        for here, t in zip(step_storages(iv), report.timeline, strict=True):
            if prev is not None:
                live -= prev.freed_bytes + prev.scratch_bytes
            live += here.alloc_bytes + here.scratch_bytes
            assert live == t.live_bytes, sched.provenance
            prev = here
        assert sum(s.nbytes for s in saved_storages(step, iv)) == report.saved_activation_bytes


def test_inspect_a_dump_written_by_the_torch_compile_backend(tmp_path, capsys):
    """What a user does after a training job compiled with the remat backend."""
    backend_module = pytest.importorskip("remat_pass.compile.backend")
    from remat_pass.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, hidden=32, heads=2, layers=4, seq=16)
    b = backend_module.backend(schedule="uniform", recompute_num_layers=2, report_dir=tmp_path)
    torch.compile(model, backend=b)(torch.randint(0, 64, (2, 16))).sum().backward()
    dumps = sorted(tmp_path.glob("*" + DUMP_SUFFIX))
    assert dumps
    desc = load_dump(dumps[0])
    assert desc["report"]["schedule"]["provenance"] == "uniform(K=2)"
    assert [s["layers"] for s in desc["segments"]] == [[2, 3], [0, 1]]
    assert main(["inspect", "--graph", str(dumps[0]), "--section", "segments"]) == 0
    assert "== recompute segments, in run order ==" in capsys.readouterr().out
