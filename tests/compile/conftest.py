"""Every test of the torch.compile backend starts and ends with Dynamo's caches reset:
every test compiles new models, and Dynamo's per-code recompile limit would otherwise send
later models to eager without a word."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
