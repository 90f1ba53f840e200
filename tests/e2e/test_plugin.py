"""The pytest plugin, used from a small test project (pytester)."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

pytest_plugins = ["pytester"]

PROJECT_TEST = '''
import pytest
import torch
from remat_pass.models import linear_chain as plain_chain

BATCH = {batch}
GROW = {grow}


class GeluLinear(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.gelu(super().forward(x))


def linear_chain(batch, width, layers):
    """The shipped chain; with GROW a GELU after every Linear: the same parameters and
    inputs (the same model for the baseline), more activation memory."""
    model, inputs, loss_fn = plain_chain(batch=batch, width=width, layers=layers)
    if GROW:
        grown = torch.nn.Sequential(*[GeluLinear(width, width) for _ in range(layers)])
        grown.load_state_dict(model.state_dict())
        model = grown
    return model, inputs, loss_fn


def test_budget_passes(remat_peak):
    report = remat_peak.check(*linear_chain(batch=BATCH, width=64, layers=2), budget="1GiB")
    assert report["peak_bytes"] > 0


@pytest.mark.remat_budget("1KiB")
def test_marker_budget_fails(remat_peak):
    remat_peak.check(*linear_chain(batch=BATCH, width=64, layers=2), schedule="uniform", recompute_num_layers=1)


def test_baseline(remat_peak):
    remat_peak.check(*linear_chain(batch=BATCH, width=64, layers=2), schedule="uniform", recompute_num_layers=2,
                     baseline="baselines/chain.json")


def test_factory_spec(remat_peak):
    report = remat_peak.predict("remat_pass.models:linear_chain", layers=2, width=64, batch=BATCH)
    assert report["schedule"]["provenance"] == "none"
'''


@pytest.fixture(scope="module", autouse=True)
def _import_what_the_project_imports():
    """pytester runs the project in this process and afterwards drops the modules the run
    imported; torch cannot import some of them twice (TORCH_LIBRARY registrations), so
    import them here first, by doing once what the project's tests do."""
    from remat_pass.recompute import schedule
    from remat_pass.report.gate import run_gate
    from remat_pass.liveness.timeline import analyze
    from remat_pass.models import linear_chain
    from remat_pass.graph.regions import assign_layers
    from remat_pass.report.schedule_report import report_json
    from remat_pass.recompute.rewrite import rewrite
    from remat_pass.graph.trace import trace_joint

    joint = trace_joint(*linear_chain(batch=4, width=8, layers=2))
    stack = assign_layers(joint)
    step = rewrite(joint, stack, schedule.uniform(1, 2))
    run_gate([report_json(analyze(step), step)], budget_bytes=1)


def write_project(pytester, batch, grow=False):
    pytester.makepyfile(test_project=PROJECT_TEST.format(batch=batch, grow=grow))


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="pytest11")
    assert any(ep.value == "remat_pass.pytest_plugin" for ep in eps)


@pytest.mark.slow
def test_plugin_from_a_project(pytester):
    write_project(pytester, batch=256)
    # no baseline yet: the baseline test fails and says how to write one
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*EXCEEDS the budget 1.0 KiB*", "*--remat-update-baseline*"])
    # write it deliberately
    result = pytester.runpytest("-p", "no:cacheprovider", "--remat-update-baseline", "-k", "baseline")
    result.assert_outcomes(passed=1)
    baseline = pytester.path / "baselines" / "chain.json"
    doc = json.loads(baseline.read_text())
    assert doc["kind"] == "remat-pass-reports"
    assert [d["schedule"]["provenance"] for d in doc["reports"]] == ["uniform(K=2)"]
    # same model: passes against it
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "baseline")
    result.assert_outcomes(passed=1)
    # a larger batch is another model: refused, saying what differs
    write_project(pytester, batch=384)
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "baseline")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*baseline is of another model*"])
    # the same model with more activations: the peak grows, the test fails and names
    # the tensors that grew
    write_project(pytester, batch=256, grow=True)
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "baseline")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*uniform(K=2): predicted peak*REGRESSION*", "*new or larger*"])
    # ... unless the ini option allows the growth
    pytester.makeini("[pytest]\nremat_max_regression = 200%\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "baseline")
    result.assert_outcomes(passed=1)


def test_check_without_budget_or_baseline_fails(pytester):
    pytester.makepyfile(test_x='''
from remat_pass.models import linear_chain

def test_nothing(remat_peak):
    remat_peak.check(*linear_chain(batch=8, width=32, layers=2))
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*needs a budget*"])


def test_marker_is_registered(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["*remat_budget(size)*"])


def test_summary_names_the_failure_and_a_bad_marker_is_a_clear_failure(pytester):
    """pytest's short summary read "Failed: PASS none: ..." when the first finding
    passed (a budget that fits, a baseline that grew); a marker size that does not parse
    raised a raw ValueError from inside the gate."""
    pytester.makepyfile(test_x='''
import pytest
from remat_pass.models import linear_chain

@pytest.mark.remat_budget("1GiB")
def test_budget_fits_baseline_grew(remat_peak, tmp_path):
    import json
    report = remat_peak.predict(*linear_chain(batch=8, width=32, layers=2))
    report["peak_bytes"] = 1  # a baseline whose peak was smaller
    path = tmp_path / "base.json"
    path.write_text(json.dumps({"schema_version": 2, "kind": "remat-pass-reports", "reports": [report]}))
    remat_peak.check(*linear_chain(batch=8, width=32, layers=2), baseline=path)

@pytest.mark.remat_budget("12 parsecs")
def test_bad_marker(remat_peak):
    remat_peak.check(*linear_chain(batch=8, width=32, layers=2))
''')
    result = pytester.runpytest("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(failed=1, errors=1)  # the marker is read when the fixture is set up
    result.stdout.fnmatch_lines(["FAILED test_x.py::test_budget_fits_baseline_grew - Failed: remat-pass: none: *"])
    result.stdout.fnmatch_lines(["*@pytest.mark.remat_budget('12 parsecs'): size '12 parsecs' is not a number*"])
    assert "Failed: PASS" not in result.stdout.str() and "ValueError" not in result.stdout.str()
