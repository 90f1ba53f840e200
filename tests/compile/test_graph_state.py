"""The backend's state machine: every training graph's state is a frozen value, moved by
the transitions of ``graph_state`` / ``graph_compile``, and the step records by those of
``steps``; the backend holds the current ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat_pass
from remat_pass.compile.graph_compile import compile_graph
from remat_pass.compile.graph_schedule import GraphScheduler
from remat_pass.compile.graph_state import Captured, Compiled, Recorded, record, replan
from remat_pass.compile.steps import StepLogEntry, StepRecords
from remat_pass.models import TinyGPT
from remat_pass.recompute import schedule as schedules

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def test_a_step_records_the_graph_and_replan_compiles_a_new_state():
    """After one step the graph is Recorded (its fx liveness read); ``replan`` gives a
    Captured graph with the schedule forced, which compiles to a new Compiled state
    with that schedule, leaving the backend's state as it was."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, hidden=32, heads=2, layers=4, seq=16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    b = remat_pass.backend("uniform", 2)
    torch.compile(model, backend=b)(ids).sum().backward()
    (state,) = b.graph_states.values()
    assert isinstance(state, Recorded) and isinstance(state.compiled, Compiled)
    assert set(state.liveness) == {"fx"} and state.planned.report is b.reports[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.liveness = {}
    k1 = schedules.uniform(1, 4)
    captured = replan(state, k1)
    assert isinstance(captured, Captured) and captured.forced == k1
    assert state.planned.captured.forced is None and captured.gm is state.planned.captured.gm
    scheduler = GraphScheduler(b.options)
    result = compile_graph(captured, scheduler, tuple(b.reports))
    new = result.state
    assert isinstance(new, Compiled) and new.run is not state.run
    assert [r.schedule for r in result.reports] == ["uniform(K=1)"] and new.planned.report is result.reports[0]
    assert [s.layers for s in new.planned.step.segments] == [(3,), (2,), (1,), (0,)]
    assert (new.output_joint, new.output_tangent) == (state.compiled.output_joint, state.compiled.output_tangent)
    again = record(new, scheduler)
    assert isinstance(again, Recorded) and record(again, scheduler) is again
    assert b.graph_states[state.graph_id] is state and len(b.reports) == 1


def test_step_records_find_a_step_by_its_input_shape():
    """``StepRecords.step_report``: the latest step, or the latest of a shape; a shape
    no step ran with is a KeyError naming the shapes seen."""
    records = StepRecords(
        log=(StepLogEntry(0, ((2, 32),), 10), StepLogEntry(1, ((4, 32),), 20), StepLogEntry(2, ((2, 32),), 10)),
        signatures=(("a",), ("b",), ("c",)), composed={("a",): "A", ("b",): "B"})
    assert StepRecords().step_report() is None
    assert records.step_report() is None  # the latest step, not composed (any more)
    assert records.step_report((4, 32)) == "B"
    with pytest.raises(KeyError, match=r"shapes seen: \[\[2, 32\], \[4, 32\]\]"):
        records.step_report((3, 32))
