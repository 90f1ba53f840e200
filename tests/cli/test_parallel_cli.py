"""Bad parallel settings on the command line: a clear message naming the setting and
its legal values, exit 2, before anything is traced."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from remat_pass.cli.main import EXIT_USAGE, main


class NoStack(nn.Module):
    """Two different layers: nothing to wrap with fully_shard per layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def no_stack(batch: int = 4) -> tuple[nn.Module, tuple[torch.Tensor], None]:
    return NoStack(), (torch.randn(batch, 8),), None


TINY = ["--model", "remat_pass.models:tiny_llama", "--batch", "4", "--layers", "4"]


@pytest.mark.parametrize("argv,says", [
    (["--tp", "0"], ["--tp 0: must be 1 or more"]),
    (["--tp", "3"], ["--tp 3 does not divide", "heads = 4", "legal --tp values: [1, 2, 4]"]),
    (["--sp"], ["--sp", "--tp 2 or more"]),
    (["--pp", "8", "--microbatches", "8"], ["4 layers cannot be split evenly into 8 pipeline stages", "[1, 2, 4]"]),
    (["--pp", "2", "--microbatches", "3"], ["--microbatches 3 does not divide the global batch 4", "[1, 2, 4]"]),
    (["--pp", "4", "--microbatches", "2"], ["1f1b needs at least as many microbatches as pipeline stages", "m=2 < p=4"]),
    (["--pp", "2", "--vpp", "3", "--pipeline-schedule", "interleaved", "--microbatches", "2"],
     ["4 layers cannot be split evenly into 6 pipeline stages"]),
    (["--pp", "2", "--vpp", "2", "--microbatches", "2"], ["--vpp 2 needs --pipeline-schedule interleaved"]),
    (["--pp", "2", "--microbatches", "2", "--pipeline-schedule", "zero-bubble"], ["'zero-bubble' is not one of"]),
])
def test_bad_parallel_setting_exits_2_with_the_legal_values(argv, says, capsys):
    assert main(["sweep", *TINY, *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("remat-pass: error:") and "Traceback" not in err
    for text in says:
        assert text in err, err


def test_fsdp_on_a_model_without_per_layer_wrapping_exits_2(capsys):
    assert main(["sweep", "--model", "tests.cli.test_parallel_cli:no_stack", "--fsdp", "2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--fsdp wraps each layer with fully_shard" in err and "no layer stack" in err


def test_a_factory_with_a_loss_fn_is_refused_by_the_per_rank_commands(capsys):
    """The loss_fn closes over the whole batch's targets; the ranks split the batch."""
    assert main(["sweep", "--model", "remat_pass.models:tiny_gpt", "--layers", "2", "--pp", "2",
                 "--microbatches", "2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "must take the targets and return the loss" in err and "returns a loss_fn" in err


@pytest.mark.parametrize("extra,says", [
    (["--meta", "--tp", "2", "--measure"], "--measure with --config / --meta / --dtype"),
    (["--dtype", "bfloat16", "--fsdp", "2"], "--fsdp with --config / --meta / --dtype"),
])
def test_a_model_without_weights_is_predicted_per_rank_not_measured(extra, says, capsys):
    """``--meta`` / ``--config`` / ``--dtype`` build a model the ranks cannot run: the
    per-rank commands predict it, and refuse to measure it or to shard it with FSDP."""
    assert main(["sweep", *TINY, *extra]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("remat-pass: error:") and says in err and "Traceback" not in err


def test_meta_per_rank_rows_equal_those_of_the_model_with_weights(tmp_path, capsys):
    """``sweep --meta --tp 2 --pp 2``: the ranks are traced with fake tensors (one per
    tensor-parallel group) and give the same rows as the model with weights."""
    rows = {}
    for name, extra in (("real", []), ("meta", ["--meta"])):
        path = tmp_path / f"{name}.json"
        assert main(["sweep", *TINY[:2], "--batch", "4", "--layers", "2", "--tp", "2", "--pp", "2",
                     "--microbatches", "2", "--json", str(path), *extra]) == 0
        rows[name] = [{k: v for k, v in r.items() if k != "config"} for r in json.loads(path.read_text())["rows"]]
    assert "one per tensor-parallel group" in capsys.readouterr().err
    assert rows["meta"] == rows["real"] and len(rows["real"]) == 3 * 4


def test_plan_needs_a_device_memory_per_rank(capsys):
    assert main(["plan", *TINY, "--pp", "2", "--microbatches", "2"]) == EXIT_USAGE
    assert "--device-memory" in capsys.readouterr().err


def test_sweep_prints_one_row_per_rank_and_setting(tmp_path, capsys):
    """Two stages traced under the fake process group (~4 s), every setting of L_stage = 1."""
    path = tmp_path / "pp.json"
    assert main(["sweep", *TINY[:2], "--batch", "4", "--layers", "2", "--pp", "2", "--microbatches", "2",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    settings = ["none", "uniform(K=1)", "block(N=1)"]  # L_stage = 1
    assert [(r["schedule"], r["rank"]) for r in rows] == [(s, r) for s in settings for r in (0, 1)]
    assert [r["in_flight"] for r in rows if r["schedule"] == "none"] == [2, 1]  # 1F1B: stage i holds p - i
    assert all(r["predicted_peak_bytes"] > 0 and r["static_bytes"] > 0 for r in rows)
    assert len([line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]) == len(rows)


@pytest.mark.slow
def test_sweep_measure_is_exact_at_one_sample_per_microbatch(tmp_path, capsys):
    """`sweep --pp 2 --microbatches 4 --measure` at batch 4 (micro-batch 1) was 8,192 B
    over measured on every row: the CLI predicted CPU flash attention's per-thread
    scratch at this process's threads while the gloo ranks run with one
    (``launch.RANK_THREADS``). Every rank row is now predicted to the byte."""
    out = tmp_path / "pp.json"
    argv = ["sweep", *TINY, "--pp", "2", "--microbatches", "4", "--measure", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["grads_equal"] for r in rows)
    assert [r["predicted_peak_bytes"] for r in rows] == [r["measured_peak_bytes"] for r in rows]
    table = capsys.readouterr().out
    assert "error B" in table and "measured MiB" in table


@pytest.mark.slow
@pytest.mark.usefixtures("megatron_torn_down")
def test_a_megatron_command_sweeps_as_the_factory_does(tmp_path):
    """`remat-pass megatron -- <Megatron-LM arguments>` equals `sweep` of the same
    Megatron-Core factory: the same settings, predicted == measured, gradients equal."""
    pytest.importorskip("megatron.core")
    from remat_pass.cli.main import main as cli_main

    megatron = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--vocab-size", "100", "--micro-batch-size", "2", "--attention-dropout", "0.0",
                "--hidden-dropout", "0.0", "--seed", "0", "--recompute-granularity", "full",
                "--recompute-method", "uniform", "--recompute-num-layers", "1", "--lr", "1e-4"]
    assert cli_main(["megatron", "--json", str(tmp_path / "m.json"), "--", *megatron]) == 0
    doc = json.loads((tmp_path / "m.json").read_text())
    rows = doc["rows"]
    from remat_pass.models.megatron_args import read_megatron_command
    from remat_pass.models.megatron_formula import megatron_estimate

    # Megatron-LM's own estimate beside every row, the same at every setting
    assert doc["megatron_formula"] == megatron_estimate(read_megatron_command(megatron)).to_dict()
    assert {r["megatron_formula_bytes"] for r in rows} == {doc["megatron_formula"]["total_bytes"]}
    differ = [(r["provenance"], r["predicted_peak_bytes"], r["measured_peak_bytes"], r["grads_equal"]) for r in rows
              if r["predicted_peak_bytes"] != r["measured_peak_bytes"] or not r["grads_equal"]]
    assert not differ, differ  # (setting, predicted, measured, gradients equal) of each row that differs
    from remat_pass.evaluate.session import Session
    from remat_pass.models.megatron import megatron_gpt
    from remat_pass.recompute.schedule import megatron_schedules

    # the factory path: the padded vocabulary (100 -> 128), dropout 0, seed 0, the output layer tied to the
    # word embedding (pretrain_gpt.py's default)
    session = Session.create(*megatron_gpt(batch=2, seq=16, layers=2, hidden=32, heads=4, vocab=128, dropout=0.0,
                                           seed=0, tied_embeddings=True))
    assert [(r["provenance"], r["predicted_peak_bytes"]) for r in rows] == [
        (s.provenance, session.report(s).peak_bytes) for s in megatron_schedules(session.stack.layers_per_stack)]


@pytest.mark.usefixtures("megatron_torn_down")
def test_a_megatron_command_without_weights_predicts_what_it_measures_with_them(tmp_path):
    """`remat-pass megatron --meta`: Megatron-Core's RNG tracker compares two CPU RNG states
    (``CudaRNGStatesTracker.fork``), constants of the trace whose value the fake trace now
    keeps (``trace_context.constant_values_mode``), so it traces without weights (it was
    refused) and predicts every setting as the run with weights measures it (dropout 0.1)."""
    pytest.importorskip("megatron.core")
    from remat_pass.cli.main import main as cli_main

    megatron = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--vocab-size", "128", "--micro-batch-size", "2", "--attention-dropout", "0.1",
                "--hidden-dropout", "0.1"]
    rows = {}
    for flags in (["--meta"], []):
        assert cli_main(["megatron", *flags, "--json", str(tmp_path / "m.json"), "--", *megatron]) == 0
        rows[bool(flags)] = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert len(rows[True]) == len(rows[False]) >= 5
    assert all(r["measured_peak_bytes"] is None for r in rows[True])
    assert [(r["provenance"], r["predicted_peak_bytes"]) for r in rows[True]] == \
        [(r["provenance"], r["measured_peak_bytes"]) for r in rows[False]]
