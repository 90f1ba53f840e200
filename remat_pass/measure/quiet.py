"""The quiet, undisturbed window a CPU measurement runs in: file descriptor 2 silenced
(the profiler's log lines) and the cycle collector paused (no earlier tensor freed
inside the window)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null while active (C++ log lines included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Keep the cycle collector off while active: it must not free tensors allocated
    before the measured window inside it (their frees would lower the running sum below
    what the step itself allocates). Cyclic garbage from before stays uncollected until
    the window ends, so no full collection is needed first (it costs ~0.4 s with torch,
    sympy and transformers loaded)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
