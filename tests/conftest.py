"""Shared fixtures: small traced models, reused across tests of a module; the hypothesis
profiles; a per-session calibration cache. The helpers the tests import (small models,
the zoo, generated stacks, the chain oracle) live in ``tests/helpers/`` (on the path:
``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from remat_pass.memory.calibration import CACHE_ENV
# helpers/ holds modules the tests import, not tests (and no doctests)
collect_ignore = ["helpers"]

from small_models import small_gpt2, small_tiny_gpt  # noqa: F401 - the fixtures below build them
from remat_pass.evaluate.session import Session

# Hypothesis profiles of the property tests (tests/test_properties.py). "default" (the
# README's test command): a few dozen examples, derandomized (the same examples on
# every run and machine), no example database. "long" (--hypothesis-profile=long):
# thousands of examples, for the figures the issue asks for; not part of CI; a failing
# example is reported as drawn (shrinking it takes longer than the run). It is not
# derandomized: each run draws new examples (a restart used to replay the same first
# ones), and --hypothesis-seed=N makes a run reproducible.
_PROFILE = dict(
    deadline=None,
    database=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture],
)
settings.register_profile("default", max_examples=20, **_PROFILE)
settings.register_profile("long", max_examples=2000, phases=[Phase.explicit, Phase.generate],
                          **{**_PROFILE, "derandomize": False})
settings.load_profile("default")


@pytest.fixture(autouse=True)
def _no_eager_mode_left():
    """A torch.compile backend leaves its step-recording dispatch mode pushed when a
    test ends before the step it waits for (``compile.eager_recorder``): popped after
    every test, so no test runs under another's mode."""
    yield
    from remat_pass.compile.eager_recorder import release_modes

    release_modes()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): tiny models run faster without OpenMP
    spin-waits on a shared machine, and the module's measurements do not depend on the
    machine's core count; the thread count is restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def megatron_torn_down():
    """After the test: Megatron's CPU setup (``models.megatron.setup_megatron_cpu``, which a
    ``megatron_gpt`` model starts and keeps for the process) ended, its gloo group with it,
    so that a later test in the same worker starts without a process group."""
    yield
    from remat_pass.models.megatron import teardown_megatron_cpu

    teardown_megatron_cpu()


@pytest.fixture(scope="module")
def gpt2_session() -> Session:
    model, inputs, loss_fn = small_gpt2(layers=3, dropout=0.1)
    return Session.create(model, inputs, loss_fn)


@pytest.fixture(scope="module")
def tiny_gpt_session() -> Session:
    model, inputs, loss_fn = small_tiny_gpt(layers=5)
    return Session.create(model, inputs, loss_fn)


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    """Op calibration figures go to one folder per test session, not the user's cache:
    every test calibrates on this machine, and a signature once per session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("op-memory")))
        yield


@pytest.fixture(autouse=True)
def _restore_rng():
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
