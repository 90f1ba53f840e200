"""Flags that contradict each other or that the command would ignore are refused before
any model is built (exit 2, the flags named); the command line's conventions (--version,
python -m remat_pass, no prefix matching, the current folder on the import path)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import remat_pass
from remat_pass.cli import EXIT_USAGE, main
from remat_pass.cli.flags import check_flags
from remat_pass.cli.main import build_parser, check_paths_and_sizes
from remat_pass.formatting import parse_fraction

REFUSED = [
    (["inspect", "--schedule", "none", "--recompute-num-layers", "3"], "--schedule none recomputes nothing"),
    (["inspect", "--recompute-num-layers", "3"], "--schedule none recomputes nothing"),
    (["report", "--all-schedules", "--schedule", "uniform", "--recompute-num-layers", "2"], "--all-schedules"),
    (["check", "--report", "r.json", "--model", "remat_pass.models:tiny_gpt"], "--report checks a report file"),
    (["check", "--max-regression", "5%"], "give --baseline"),
    (["sweep", "--measure"], "a sweep on one device always measures"),
    (["sweep", "--task", "causal-lm"], "--task chooses the model class of a --config"),
    (["inspect", "--graph", "g.remat.json", "--model", "remat_pass.models:tiny_gpt"], "--graph reads a dump"),
    (["report", "--gpu", "h200"], "add --target cuda"),
    (["report", "--json", "-"], "standard output is not supported"),
    (["plan", "--budget", "0"], "more than 0 bytes"),
    (["check", "--budget", "0GiB"], "more than 0 bytes"),
    (["sweep", "--module-kind", "mlp=mlp"], "alone it changes nothing"),
    (["report", "--all-schedules", "--png", "p.png"], "--png draws one schedule"),
    (["report", "--measure", "--meta"], "--measure runs the step on this CPU"),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_contradictory_or_ignored_flags_exit_2(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


ACCEPTED = [
    ["inspect", "--schedule", "uniform", "--recompute-num-layers", "3"],
    ["report", "--all-schedules"],
    ["check", "--report", "r.json", "--budget", "1GiB"],
    ["check", "--baseline", "b.json", "--max-regression", "5%"],
    ["sweep", "--measure", "--pp", "2", "--microbatches", "2"],
    ["sweep", "--config", "c.json", "--task", "causal-lm"],
    ["inspect", "--graph", "g.remat.json"],
    ["report", "--target", "cuda", "--gpu", "h200"],
    ["sweep", "--recompute-modules", "mlp", "--module-kind", "mlp=mlp"],
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_the_combinations_that_apply_are_accepted(argv):
    """Negative control: the same flags where they apply pass the check."""
    check_flags(build_parser().parse_args(argv))


def test_a_calibration_cache_that_cannot_be_a_folder_is_refused_before_tracing(tmp_path, capsys):
    """A --calibration-cache under a file: refused up front (it used to warn and then claim the
    figures were cached); --no-calibrate needs no cache."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["report", "--calibration-cache", str(blocker / "cache")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--calibration-cache" in err and "is not a folder this user can write to" in err
    check_paths_and_sizes(build_parser().parse_args(["report", "--calibration-cache", str(tmp_path / "new" / "cache")]))
    check_paths_and_sizes(build_parser().parse_args(["report", "--calibration-cache", str(blocker / "cache"),
                                                     "--no-calibrate"]))


def test_a_bare_fraction_of_one_or_more_is_refused():
    """``--max-regression 5`` meant +500 %; now a percentage needs % and a bare number is
    a fraction below 1."""
    assert parse_fraction("5%") == 0.05 and parse_fraction("0.05") == 0.05 and parse_fraction("100%") == 1.0
    for text in ("5", 5, "1", 1.0):
        with pytest.raises(ValueError, match="ambiguous"):
            parse_fraction(text)


def test_no_prefix_matching(capsys):
    """``--lay 3`` is not ``--layers 3``: a typo must not pick a flag."""
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--lay", "3"])
    assert info.value.code == 2
    assert "unrecognized arguments: --lay 3" in capsys.readouterr().err


@pytest.mark.slow  # more than 4 s on 2 cores
def test_version_everywhere(capsys):
    """``remat-pass --version``, ``python -m remat_pass --version`` and ``__version__`` give
    pyproject.toml's version (read from the installed metadata)."""
    assert remat_pass.__version__ == "0.1.0"
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"remat-pass {remat_pass.__version__}"
    out = subprocess.run([sys.executable, "-m", "remat_pass", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"remat-pass {remat_pass.__version__}", out.stderr


def test_a_factory_in_the_current_folder_is_found(tmp_path, monkeypatch, capsys):
    """``--model mymod:make`` from the folder that holds ``mymod.py`` (the console script does
    not put the current folder on the import path by itself)."""
    (tmp_path / "mymod_flags_test.py").write_text(
        "from remat_pass.models import linear_chain\n"
        "def make(batch=4, layers=2):\n"
        "    return linear_chain(batch=batch, width=8, layers=layers)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["inspect", "--model", "mymod_flags_test:make", "--section", "summary", "--no-calibrate"]) == 0
    out = capsys.readouterr()
    assert "traced Sequential" in out.err + out.out and "with L=2" in out.err + out.out


def test_ctrl_c_keeps_the_finished_rows_and_exits_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C during a sweep: one line on stderr (no traceback), exit 130, and the rows
    already finished written to --json, marked partial."""
    from remat_pass.evaluate.workload import Workload

    real = Workload.result
    calls = []

    def result(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(Workload, "result", result)
    out = tmp_path / "sweep.json"
    rc = main(["sweep", "--model", "remat_pass.models:linear_chain", "--layers", "3", "--batch", "4",
               "--no-calibrate", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "remat-pass: interrupted"
    assert "interrupted after 2 of" in err
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and [r["schedule"] for r in doc["rows"]][:1] == ["none"] and len(doc["rows"]) == 2


def test_a_finished_sweep_is_not_marked_partial(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--model", "remat_pass.models:linear_chain", "--layers", "2", "--batch", "4",
                 "--no-calibrate", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "partial" not in doc and len(doc["rows"]) == 6  # none, uniform K=1..2, block N=0..2


@pytest.mark.slow  # a subprocess that imports torch and traces
def test_a_real_sigint_during_a_sweep(tmp_path):
    """SIGINT (Ctrl-C) sent to ``python -m remat_pass sweep`` once its first row is printed:
    exit 130, one line, the finished rows in --json marked partial."""
    import signal

    out = tmp_path / "sweep.json"
    # a run started in the background (`cmd &` in a script, as CI may be) inherits SIGINT
    # ignored, and Python then keeps it ignored: the child gets the default disposition,
    # as a program started from a terminal has
    proc = subprocess.Popen([sys.executable, "-m", "remat_pass", "sweep", "--model", "remat_pass.models:tiny_gpt",
                             "--layers", "4", "--no-calibrate", "--json", str(out)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("[ 1/"):
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, "".join(lines) + rest
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == "remat-pass: interrupted"
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and len(doc["rows"]) >= 1


def test_a_module_kind_pattern_that_matches_nothing_says_so(capsys):
    """`--module-kind mlp=ffn` on GPT-2 (no module `ffn`) said only "no module of kind
    mlp"; now it names the pattern and lists the layer's modules."""
    argv = ["sweep", "--layers", "2", "--recompute-modules", "mlp", "--module-kind", "mlp=ffn", "--no-calibrate"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "'ffn' matches no module inside the layers of 'transformer.h'" in err and "mlp.c_fc" in err, err


def test_an_output_in_a_missing_folder_is_refused_and_nothing_is_made(tmp_path, capsys):
    """`--json /nonexistent/dir/out.json` made the folders (as root, under /)."""
    target = tmp_path / "no" / "such" / "out.json"
    assert main(["sweep", "--json", str(target)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "does not exist; make it first" in err and not (tmp_path / "no").exists(), err


def test_png_without_matplotlib_is_refused_before_tracing(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["report", "--png", "t.png"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "pip install 'remat-pass[plot]'" in err and "tracing" not in err, err


def test_a_step_that_cannot_fit_this_machine_is_refused_before_it_runs(monkeypatch, capsys):
    """`--seq 100000` on a small model ran (and swapped) for minutes; the step's
    predicted bytes are now compared with the available memory before anything runs."""
    import remat_pass.evaluate.workload as workload

    monkeypatch.setattr(workload, "available_memory_bytes", lambda: 1 << 20)  # a 1 MiB machine
    argv = ["sweep", "--model", "remat_pass.models:linear_chain", "--layers", "2", "--no-calibrate"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "running this step needs about" in err and "1.00 MiB available" in err and "--meta" in err, err
    # the same step predicted with --meta runs nothing and is not refused
    assert main([*argv, "--meta"]) == 0


def test_decimal_and_bare_sizes_are_shown_as_read():
    """80GB is 10^9-based and a bare 80 is bytes; both now say what they were read as."""
    from remat_pass.cli.main import size_notes

    notes = size_notes(build_parser().parse_args(["plan", "--budget", "80", "--device-memory", "80GB"]))
    assert notes[0].startswith("--budget 80 read as 80 bytes (a bare number is bytes")
    assert notes[1].startswith("--device-memory 80GB read as 80,000,000,000 bytes = 74.51 GiB")
    assert size_notes(build_parser().parse_args(["plan", "--budget", "80GiB"])) == []
