"""benchmarks/property_stats.py counts a long property run's log: a hand-made log with
one row of each kind, duplicates and a torn line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "property_stats.py"
_spec = importlib.util.spec_from_file_location("property_stats", _PATH)
property_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(property_stats)


def _run(spec, threads, schedule, predicted, measured, grads=True, budget=None):
    return {"spec": spec, "threads": threads, "schedule": schedule, "budget_bytes": budget,
            "grads_equal": grads, "predicted_bytes": predicted, "measured_bytes": measured,
            "peak_node": "add", "seconds": 0.1}


def test_counts_each_kind_once(tmp_path, capsys):
    rows = [
        _run("a", 1, "none", 100, 100),
        _run("a", 1, "none", 100, 100),  # a replayed example: counted once
        _run("a", 2, "none", 100, 104),  # 4 B under measured
        _run("b", 1, "uniform(K=1)", 80, 80, grads=False),
        _run("b", 1, "optimized(x)", 90, 95, budget=92),  # off and over budget
        {"spec": "c", "threads": 1, "choice": ["none"], "refused": "the traced step cannot run: n"},
        {"spec": "d", "threads": 1, "error": "RuntimeError: boom", "stage": "trace"},
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn', encoding="utf-8")
    s = property_stats.summarize(property_stats.read_rows([log]))
    assert s["stacks"] == 4 and s["runs"] == 4
    assert s["exact"] == 1 and len(s["off"]) == 2 and len(s["wrong_grads"]) == 1
    assert len(s["over_budget"]) == 1 and len(s["refused"]) == 1 and len(s["errors"]) == 1
    assert s["by_threads"] == {1: (1, 2), 2: (0, 1)}
    assert property_stats.main([str(log)]) == 1
    assert "predicted - measured where they differ (B): min -5" in capsys.readouterr().out


def test_a_clean_log_exits_0(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(_run("a", 1, "none", 100, 100)) + "\n", encoding="utf-8")
    assert property_stats.main([str(log)]) == 0
