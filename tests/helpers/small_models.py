"""Small models the tests build: a tiny transformers GPT-2, a tiny hand-written GPT, and
the heterogeneous stack of ``benchmarks/hetero.py``."""

from __future__ import annotations

import pytest

from remat_pass.models import gpt2, tiny_gpt


def small_gpt2(layers: int = 3, dropout: float = 0.0, **kw):
    """A tiny transformers GPT-2 (hidden 64, seq 32, vocab 256)."""
    pytest.importorskip("transformers")
    return gpt2(batch=2, seq=32, layers=layers, hidden=64, heads=4, vocab=256, dropout=dropout, **kw)


def small_tiny_gpt(layers: int = 4, **kw):
    """A tiny hand-written GPT (hidden 64, seq 32, vocab 128)."""
    return tiny_gpt(batch=2, seq=32, layers=layers, hidden=64, heads=4, vocab=128, **kw)


def load_hetero():
    """The heterogeneous stack of ``benchmarks/hetero.py`` (blocks of one class whose
    widths and kinds differ), loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hetero.py"
    spec = importlib.util.spec_from_file_location("remat_hetero", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
