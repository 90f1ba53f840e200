"""The committed example outputs are what the code prints (issue 24): ``python
examples/reports.py --out DIR`` regenerates every file of ``examples/reports/`` and
each text file (``.txt``, ``.md``, ``.json``) must equal the committed one.

Volatile fields, left out: the PNGs' pixels (matplotlib's version and fonts), and, on a
host other than the one named in ``examples/reports/host.txt`` (torch, CPU model, ISA,
threads), the figures themselves: op scratch is calibrated on the host, so another CPU
may count other bytes; there every number is masked and the rest (the commands, the
rows, their order, the names) must still be equal.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "examples" / "reports"
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?![\w])")


def _masked(text: str) -> str:
    """``text`` with every stand-alone number replaced by ``#`` (not the digits inside
    names such as ``_softmax_10``)."""
    return NUMBER.sub("#", text)


def test_masking_keeps_names_and_hides_figures():
    assert _masked("mm_12 4.00 MiB +1,024 B (layer 3)") == "mm_12 # MiB # B (layer #)"


@pytest.mark.slow
def test_committed_example_outputs_are_what_the_code_prints(tmp_path):
    proc = subprocess.run([sys.executable, "examples/reports.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in COMMITTED.iterdir())
    same_host = (tmp_path / "host.txt").read_text() == (COMMITTED / "host.txt").read_text()
    stale = []
    for new in sorted(tmp_path.iterdir()):
        if new.suffix not in (".txt", ".md", ".json") or new.name == "host.txt":
            continue
        old = (COMMITTED / new.name).read_text(encoding="utf-8")
        now = new.read_text(encoding="utf-8")
        if (old != now) if same_host else (_masked(old) != _masked(now)):
            stale.append(new.name)
    assert not stale, (f"committed outputs differ from what the code prints ({'exact' if same_host else 'numbers masked'}"
                       f"): {stale}; regenerate them with `python examples/reports.py`")
