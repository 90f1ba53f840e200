"""Models from config files: bad input is refused before any long work starts, with the
field or op named and exit status 2; a good config on the meta device is predicted
only (issue 11, items 2 and 7)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from remat_pass.cli.main import main
from remat_pass.models.configs import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA_7B = ROOT / "examples" / "configs" / "llama2-7b.json"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}


def _write(tmp_path: Path, fields: dict | str, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(fields if isinstance(fields, str) else json.dumps(fields))
    return str(path)


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


BAD_CONFIGS = [
    (dict(TINY_LLAMA, model_type="llamma"), ["model_type 'llamma' is not a transformers model type", "llama"]),
    (_without(TINY_LLAMA, "model_type"), ["field model_type is missing"]),
    (_without(TINY_LLAMA, "hidden_size"), ["field hidden_size", "is missing"]),
    (dict(TINY_LLAMA, num_hidden_layers=0), ["field num_hidden_layers is 0", "positive integer"]),
    (dict(TINY_LLAMA, vocab_size="64"), ["field vocab_size is '64'"]),
    (dict(TINY_LLAMA, num_attention_heads=5), ["num_attention_heads (5) does not divide hidden_size (32)"]),
    (dict(TINY_LLAMA, num_key_value_heads=3), ["num_key_value_heads (3)", "num_attention_heads (4)"]),
    ("{not json", ["not JSON"]),
    ("[1, 2]", ["a config is a JSON object"]),
]


@pytest.mark.parametrize("fields,words", BAD_CONFIGS, ids=[w[0][:40] for _, w in BAD_CONFIGS])
def test_a_bad_config_is_refused_naming_the_field(tmp_path, capsys, fields, words):
    path = _write(tmp_path, fields)
    with pytest.raises(ConfigError):
        load_config(path)
    assert main(["sweep", "--config", path, "--meta"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat-pass: error: ") and "Traceback" not in err, err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("args,words", [
    (["--seq", "128"], ["seq 128 is longer than the model's positions", "max_position_embeddings = 64"]),
    (["--task", "seq2seq-lm"], ["model_type 'llama' has no seq2seq-lm model"]),
    (["--batch", "1", "--model", "remat_pass.models:gpt2"], ["give --model or --config, not both"]),
])
def test_a_config_that_does_not_fit_the_run_is_refused(tmp_path, capsys, args, words):
    assert main(["sweep", "--config", _write(tmp_path, TINY_LLAMA), "--meta", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("flag,value", [("--dtype", "float8"), ("--target", "tpu"), ("--task", "vision")])
def test_an_unknown_choice_exits_2(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", _write(tmp_path, TINY_LLAMA), "--meta", flag, value])
    assert e.value.code == 2
    assert f"invalid choice: '{value}'" in capsys.readouterr().err


def test_meta_on_a_factory_that_reads_values_names_the_op(tmp_path, capsys, monkeypatch):
    (tmp_path / "reads_values.py").write_text(textwrap.dedent("""
        import torch
        def factory(batch=2, seq=4, layers=2):
            model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
            scale = model[0].weight.abs().max().item()   # reads a value while building
            return model, torch.randn(batch, 4) * scale, lambda y: y.sum()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "reads_values", raising=False)
    assert main(["sweep", "--model", "reads_values:factory", "--meta"]) == 2
    err = capsys.readouterr().err
    assert "Tensor.item()" in err and "meta" in err and "Traceback" not in err, err


def test_the_shipped_configs_load():
    for path in sorted((ROOT / "examples" / "configs").glob("*.json")):
        config = load_config(path)
        assert config.num_hidden_layers >= 32, path


def test_a_meta_config_sweep_is_predicted_only(tmp_path):
    out = tmp_path / "out.json"
    rc = main(["sweep", "--config", _write(tmp_path, TINY_LLAMA), "--meta", "--dtype", "bfloat16", "--target", "cuda",
               "--batch", "1", "--seq", "16", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["predicted_only"] is True
    assert doc["num_layers"] == 2 and len(doc["rows"]) == 1 + 2 + 3
    static = doc["static"]
    assert static["parameter_bytes"] > 0 and doc["static_bytes"] == static["total_bytes"]
    for row in doc["rows"]:
        assert row["measured_peak_bytes"] is None and row["predicted_only"] is True
        assert row["predicted_peak_bytes"] > 0


@pytest.mark.parametrize("device,words", [
    ("64KiB", ["does not hold the static memory alone", "no schedule fits", "0 of 6 schedules"]),
    ("1GiB", ["leaves", "for activations", "6 of 6 schedules"]),
])
def test_sweep_says_what_fits_the_device(tmp_path, capsys, device, words):
    path = _write(tmp_path, TINY_LLAMA)
    assert main(["sweep", "--config", path, "--meta", "--seq", "16",
                 "--device-memory", device]) == 0
    err = capsys.readouterr().err
    # the defaults that shaped the figures are said (issue 24: --config used seq 128, batch 1 silently)
    assert f"{path}: batch 1 (default; --batch), seq 16, dtype float32 (default; --dtype), target cpu" in err.splitlines()
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("argv,words", [
    (["sweep", "--json", "{tmp}"], ["--json", "is a folder"]),
    (["sweep", "--config", "{tmp}/missing.json"], ["--config", "no such file"]),
    (["plan", "--budget", "lots"], ["--budget", "'lots' is not a number of bytes"]),
    (["sweep", "--device-memory", "80GB!"], ["--device-memory"]),
    (["check", "--baseline", "{tmp}/none.json"], ["--baseline", "no such file"]),
])
def test_paths_and_sizes_are_checked_before_any_model_is_built(tmp_path, capsys, argv, words):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "tracing" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err


