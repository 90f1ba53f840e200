"""Report JSON (schema-valid, versioned, deterministic), Markdown and PNG (remat_pass.report.schedule_report)."""

from __future__ import annotations

import json
import sys

import pytest

from remat_pass.recompute import schedule
from remat_pass.cli.main import main
from remat_pass.liveness.timeline import analyze
from remat_pass.formatting import fmt_bytes, mib, text_table
from remat_pass.report.plot import plot_timeline
from remat_pass.report.schedule_report import (
    SCHEMA_FILE,
    SCHEMA_VERSION,
    read_reports,
    report_json,
    report_markdown,
    reports_document,
    schema,
    write_json,
)
from remat_pass.evaluate.session import Session

jsonschema = pytest.importorskip("jsonschema")
CHAIN = ["--model", "remat_pass.models:linear_chain", "--layers", "3"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def validate(doc):
    jsonschema.Draft202012Validator(schema()).validate(doc)


@pytest.fixture(scope="module")
def chain_session() -> Session:
    from remat_pass.models import linear_chain

    return Session.create(*linear_chain(batch=64, width=128, layers=3))


def test_schema_is_a_valid_draft_2020_12_schema_shipped_as_package_data():
    import importlib.resources

    jsonschema.Draft202012Validator.check_schema(schema())
    assert importlib.resources.files("remat_pass.report").joinpath("report_schema.json").is_file()
    assert SCHEMA_FILE.name == "report_schema.json"


def test_report_json_is_valid_for_every_schedule(gpt2_session):
    from remat_pass.evaluate.session import megatron_schedules

    docs = []
    for sched in megatron_schedules(gpt2_session.stack.num_layers):
        step, report, _ = gpt2_session.prepare(sched)
        doc = report_json(report, step, timeline=True, meta={"model": "tiny gpt2"})
        validate(doc)
        assert doc["schema_version"] == SCHEMA_VERSION
        assert doc["peak_bytes"] == report.peak_bytes == max(doc["timeline"])
        assert doc["schedule"]["provenance"] == sched.provenance
        assert doc["schedule"]["groups"] == [list(g) for g in sched.groups]
        assert sum(doc["live_at_peak_by_layer"].values()) <= doc["peak_bytes"]
        docs.append(doc)
        bare = report_json(report)  # without the step: schedule details and segments are null
        validate(bare)
        assert bare["segments"] is None and bare["schedule"]["method"] is None
    validate(reports_document(docs, {"model": "tiny gpt2"}))


def test_schema_rejects_broken_documents(gpt2_session):
    step, report, _ = gpt2_session.prepare(schedule.none(gpt2_session.stack.num_layers))
    good = report_json(report, step)
    for broken in (
        {k: v for k, v in good.items() if k != "peak_bytes"},
        {**good, "schema_version": SCHEMA_VERSION + 1},
        {**good, "schedule": {**good["schedule"], "k": 3}},  # the version-1 name
        {**good, "peak_bytes": -1},
        {**good, "peak": {**good["peak"], "phase": "sideways"}},
        {**good, "live_at_peak_by_layer": {"layer 0": 3}},
        {**good, "unknown_field": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


def test_json_is_deterministic_across_traces(tmp_path):
    """Same model, traced twice: the same bytes on disk (the CI gate relies on it)."""
    from remat_pass.models import linear_chain

    texts = []
    for i in range(2):
        session = Session.create(*linear_chain(batch=32, width=64, layers=2))
        step, report, _ = session.prepare(schedule.uniform(1, 2))
        write_json(tmp_path / f"{i}.json", report_json(report, step, timeline=True))
        texts.append((tmp_path / f"{i}.json").read_bytes())
    assert texts[0] == texts[1]


def test_read_reports_round_trip_and_errors(chain_session, tmp_path):
    step, report, _ = chain_session.prepare(schedule.uniform(2, 3))
    one = report_json(report, step)
    write_json(tmp_path / "one.json", one)
    write_json(tmp_path / "many.json", reports_document([one, one]))
    assert read_reports(tmp_path / "one.json") == [one]
    assert read_reports(tmp_path / "many.json") == [one, one]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_reports(tmp_path / "bad.json")
    write_json(tmp_path / "other.json", {"kind": "sweep"})
    with pytest.raises(ValueError, match="not a remat-pass report"):
        read_reports(tmp_path / "other.json")
    write_json(tmp_path / "future.json", {**one, "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(ValueError, match="schema_version"):
        read_reports(tmp_path / "future.json")
    # schema_version 1 (schedule.k) is still read, as version 2
    sched = {("k" if k == "recompute_num_layers" else k): v for k, v in one["schedule"].items()}
    write_json(tmp_path / "v1.json", reports_document([{**one, "schema_version": 1, "schedule": sched}]) | {"schema_version": 1})
    assert read_reports(tmp_path / "v1.json") == [one]
    # a missing or mistyped field names the file and the field
    broken = {k: v for k, v in one.items() if k != "peak_bytes"}
    write_json(tmp_path / "missing.json", broken)
    with pytest.raises(ValueError, match="missing.json.*peak_bytes"):
        read_reports(tmp_path / "missing.json")
    write_json(tmp_path / "negative.json", {**one, "peak_bytes": -5})
    with pytest.raises(ValueError, match="field peak_bytes"):
        read_reports(tmp_path / "negative.json")


def test_markdown_names_peak_where_live_and_saved(gpt2_session):
    step, report, _ = gpt2_session.prepare(schedule.uniform(1, gpt2_session.stack.num_layers))
    md = report_markdown(report, step)
    assert md.startswith("### remat-pass: `uniform(K=1)`")
    assert f"**{mib(report.peak_bytes)} MiB**" in md and f"`{report.peak_node}`" in md
    assert "#### Live at the peak, by layer" in md
    biggest_live = report.live_at_peak[0]
    assert f"`{biggest_live.name}`" in md
    biggest_saved = max(report.saved, key=lambda t: (t.nbytes, t.name))
    assert f"`{biggest_saved.name}`" in md
    assert md.count("\n| ") >= len(step.segments)  # one segment row each
    step0, report0, _ = gpt2_session.prepare(schedule.none(gpt2_session.stack.num_layers))
    assert "Nothing is recomputed." in report_markdown(report0, step0)


def test_plot_timeline_writes_pngs(chain_session, tmp_path):
    from remat_pass.measure.run import measured_step_timeline
    from remat_pass.measure.run import measure_step

    step, report, _ = chain_session.prepare(schedule.uniform(1, 3))
    aligned = measured_step_timeline(step, chain_session.joint)
    raw = measure_step(step, chain_session.joint).timeline_bytes
    for name, kw in (("bare", {}), ("stacked", {"step": step}),
                     ("aligned", {"step": step, "measured_timeline": aligned}),
                     ("raw", {"step": step, "measured_timeline": raw})):
        path = plot_timeline(report, tmp_path / f"{name}.png", **kw)
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_timeline_without_matplotlib(chain_session, tmp_path, monkeypatch):
    step, report, _ = chain_session.prepare(schedule.none(3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'remat-pass\[plot\]'"):
        plot_timeline(report, tmp_path / "x.png")


def test_existing_table_helpers_keep_working():
    table = text_table(("a", "bb"), [["x", "1"], ["yy", "22"]])
    assert table.splitlines() == ["a   bb", "--  --", "x    1", "yy  22"]
    assert fmt_bytes(512) == "512 B" and fmt_bytes(2048) == "2.0 KiB" and fmt_bytes(3 * 2**20) == "3.00 MiB"


def test_cli_report_writes_valid_json_markdown_png(tmp_path, capsys):
    args = [*CHAIN, "--schedule", "uniform", "--recompute-num-layers", "1"]
    assert main(["report", *args, "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png"),
                 "--measure", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### remat-pass: `uniform(K=1)`") and "Measured (CPU profiler, per step)" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    validate(doc)
    assert doc["meta"]["model"] == "remat_pass.models:linear_chain" and "timeline" in doc
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["report", *CHAIN, "--all-schedules", "--json", str(tmp_path / "all.json"),
                 "--markdown", str(tmp_path / "all.md")]) == 0
    doc = json.loads((tmp_path / "all.json").read_text())
    validate(doc)
    assert [d["schedule"]["provenance"] for d in doc["reports"]][:2] == ["none", "uniform(K=1)"]
    assert len(doc["reports"]) == 1 + 3 + 4
    assert "<details><summary>uniform(K=3)</summary>" in (tmp_path / "all.md").read_text()
    assert main(["report", *CHAIN, "--all-schedules", "--png", str(tmp_path / "x.png")]) == 2
    assert "--png draws one schedule" in capsys.readouterr().err


def test_report_json_matches_analyze_for_cuda_allocator(chain_session):
    step, _, _ = chain_session.prepare(schedule.uniform(2, 3))
    report = analyze(step, "cuda")
    doc = report_json(report, step)
    validate(doc)
    assert doc["allocator"] == "cuda" and all(t["bytes"] % 512 == 0 for t in doc["live_at_peak"])


def test_committed_reports_are_valid():
    """The CI baseline and the example reports follow the schema this version writes."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    paths = [root / ".ci" / "baseline" / "default_model.json", *sorted((root / "examples" / "reports").glob("*.json"))]
    for path in paths:
        if path.exists():
            validate(json.loads(path.read_text()))
            assert read_reports(path)
