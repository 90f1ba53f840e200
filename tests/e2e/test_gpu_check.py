"""benchmarks/gpu_check.py runs where CI runs (no GPU): the CPU target's predictions
against CPU measurements, gradients, and fake == real, at its quick sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--models", "gpt2,llama", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and len(doc["rows"]) == 2 * 2 * (5 + 3)  # the rewrite's rows, the eager program's
    for r in doc["rows"]:
        assert r["grads_equal"] and r["fake_equals_real"], r
        assert r["predicted_peak_bytes"] == r["measured_peak_bytes"], r
    assert "largest |predicted - measured|" in run.stdout
