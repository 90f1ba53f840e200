"""Calibration (remat_pass/memory/calibration.py) on its own: the cache file per host is
written once and read back (a second calibrator measures nothing new and gives the same
memory model), and a calibrator without a cache writes nothing."""

from __future__ import annotations

import json

import pytest

from remat_pass.graph.regions import assign_layers
from remat_pass.graph.trace import trace_joint
from remat_pass.liveness.timeline import analyze
from remat_pass.memory.calibration import CalibrationOptions, Calibrator, cache_path
from remat_pass.models import tiny_gpt
from remat_pass.recompute import schedule
from remat_pass.recompute.rewrite import rewrite

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


@pytest.fixture(scope="module")
def steps():
    model, inputs, loss_fn = tiny_gpt(batch=2, seq=16, layers=2, hidden=32, heads=2, vocab=64)
    joint = trace_joint(model, inputs, loss_fn)
    stack = assign_layers(joint)
    return [rewrite(joint, stack, s) for s in (schedule.none(2), schedule.uniform(1, 2))]


def test_the_cache_is_written_once_and_read_back(tmp_path, steps):
    first = Calibrator(CalibrationOptions(cache_dir=tmp_path, repeats=1, warmups=1))
    model_1 = first.memory_model(steps)
    assert first.calibrated_signatures > 0
    path = cache_path(tmp_path, first.host)
    assert first.path == path and path.is_file()
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) >= first.calibrated_signatures  # a header line, then one line per signature
    written = path.read_text()
    second = Calibrator(CalibrationOptions(cache_dir=tmp_path, repeats=1, warmups=1))
    model_2 = second.memory_model(steps)
    assert second.calibrated_signatures == 0  # every signature came from the file
    for step in steps:
        assert analyze(step, memory=model_2).peak_bytes == analyze(step, memory=model_1).peak_bytes
    assert path.read_text() == written  # nothing new to append


def test_without_a_cache_nothing_is_written(tmp_path, steps):
    c = Calibrator(CalibrationOptions(cache_dir=tmp_path, use_cache=False, repeats=1, warmups=1))
    c.memory_model(steps)
    assert c.path is None and c.calibrated_signatures > 0
    assert list(tmp_path.iterdir()) == []
