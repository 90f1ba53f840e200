"""Every command line the README shows runs as written (issue 24): each ``remat-pass ...``
line of its code blocks (the first line's sweep included) is run from a fresh folder
that holds what the commands read (``examples/configs``, ``.ci/baseline``), and must
exit 0. The baseline-update command must write the committed baseline back unchanged
on the host the committed outputs were made on (``examples/reports/host.txt``).

Lines with placeholders (``[...]``, ``...``, ``DIR/NAME``) are synopses, not commands.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"\[|\.\.\.|\b[A-Z]{3,}(/[A-Z]+)?\b")


def readme_commands(text: str) -> list[str]:
    """The ``remat-pass`` command lines of the README's code blocks (continuations
    joined, trailing ``# comments`` dropped, the part after ``&&`` of install lines)."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.split(r"\s+#", line)[0].strip()
            line = line.split("&&")[-1].strip()
            if line.startswith("remat-pass ") and not PLACEHOLDER.search(line[len("remat-pass "):]):
                commands.append(line)
    return list(dict.fromkeys(commands))


COMMANDS = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_has_commands():
    """Negative control of the extraction: the README's main job and its per-rank lines."""
    assert "remat-pass sweep --json sweep.json" in COMMANDS
    assert any(c.startswith("remat-pass sweep --pp 4") for c in COMMANDS)
    assert not any("DIR/NAME" in c or "[" in c for c in COMMANDS)


def _host() -> str:
    import torch

    from remat_pass.graph.op_signature import host_identity

    return f"{host_identity('cpu')}|threads {torch.get_num_threads()}\n"


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command, tmp_path):
    shutil.copytree(ROOT / "examples" / "configs", tmp_path / "examples" / "configs")
    shutil.copytree(ROOT / ".ci" / "baseline", tmp_path / ".ci" / "baseline")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "remat_pass", *shlex.split(command)[1:]]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if ".ci/baseline/default_model.json" in command:
        written = (tmp_path / ".ci" / "baseline" / "default_model.json").read_bytes()
        committed = (ROOT / ".ci" / "baseline" / "default_model.json").read_bytes()
        host_file = ROOT / "examples" / "reports" / "host.txt"
        if host_file.is_file() and host_file.read_text() == _host():
            assert written == committed, "the README's baseline update changes the committed baseline"
