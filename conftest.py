"""Repository-wide pytest hooks (the package's doctests are collected from remat_pass/ and
solvers/, outside tests/, so their marks are set here).

A doctest that runs ``torch.compile`` takes Dynamo and AOTAutograd seconds to minutes: it
is marked ``slow`` and runs in ``.ci/run``'s second call, with the other slow tests."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if isinstance(item, pytest.DoctestItem) and any(
            "torch.compile(" in example.source for example in item.dtest.examples
        ):
            item.add_marker(pytest.mark.slow)
