"""Layer stacks in an ``nn.ModuleDict`` keyed by layer index (torchtitan's Llama 3,
issue 23: was "has no layer stack"): found by search and by ``--stack`` / ``layers=``;
every schedule sweeps exactly with gradients bitwise equal."""

from __future__ import annotations

import json

import pytest
import torch.nn as nn

from dict_models import dict_gpt
from remat_pass.cli.main import main
from remat_pass.errors import LayerStackNotFound
from remat_pass.evaluate.session import Session
from remat_pass.graph.regions import find_layer_stacks
from remat_pass.recompute import schedule as schedules

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_module_dict_keyed_by_layer_index_is_a_stack():
    model, _, _ = dict_gpt(layers=3)
    assert find_layer_stacks(model) == [("layers", ["0", "1", "2"])]
    assert find_layer_stacks(model, "layers") == [("layers", ["0", "1", "2"])]


def test_a_module_dict_with_names_is_no_stack():
    model = nn.Sequential(nn.ModuleDict({"q": nn.Linear(2, 2), "k": nn.Linear(2, 2)}), nn.ReLU())
    with pytest.raises(LayerStackNotFound, match="layer-index-keyed nn.ModuleDict"):
        find_layer_stacks(model)
    with pytest.raises(LayerStackNotFound, match="is not an nn.ModuleList, nn.Sequential or module keyed"):
        find_layer_stacks(model, "0")


@pytest.mark.parametrize("layers", [pytest.param(None, marks=pytest.mark.slow), "layers"])
def test_module_dict_gpt_sweeps_exactly(layers):
    model, inputs, loss_fn = dict_gpt(layers=3)
    session = Session.create(model, inputs, loss_fn, layers=layers)
    assert session.stack.path == "layers" and session.stack.num_layers == 3
    assert all(session.stack.nodes_of_layer(i) for i in range(3))
    for sch in schedules.distinct_megatron_schedules(3):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance


@pytest.mark.slow
def test_sweep_with_stack_naming_a_module_dict(tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--model", "dict_models:dict_gpt", "--stack", "layers", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8
    assert all(r["grads_equal"] and r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in rows)
