"""HiGHS's own output kept off the user's stdout: HiGHS prints from C (past Python's
``sys.stdout``), so file descriptor 1 is sent to a temporary file while a solve runs and
what it caught goes to the logger of ``solvers.oplevel`` at DEBUG level."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import tempfile
import threading
from typing import Iterator

_log = logging.getLogger("solvers.oplevel")


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """File descriptor 1 sent to a temporary file while the block runs (HiGHS prints
    from C, past Python's ``sys.stdout``, e.g. ``HighsMipSolverData::transformNewIntegerFeasibleSolution``
    lines); what it caught goes to this module's logger at DEBUG level. C's buffers are
    flushed before fd 1 is restored, so nothing reaches the user's stdout later. Blocks
    may overlap in several threads (``front_pool``): the first to enter redirects, the
    last to leave restores."""
    with _quiet_lock:
        if _quiet["depth"] == 0 and not _redirect():
            _quiet["depth"] = -1  # no fd 1 at all: nothing can reach a stdout
        if _quiet["depth"] >= 0:
            _quiet["depth"] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            if _quiet["depth"] > 0:
                _quiet["depth"] -= 1
                if _quiet["depth"] == 0:
                    _restore()
            elif _quiet["depth"] == -1:
                _quiet["depth"] = 0


_quiet_lock = threading.Lock()
_quiet: dict = {"depth": 0, "sink": None, "saved": None}


def _flush() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()
    libc = _libc()
    if libc is not None:
        libc.fflush(None)


def _redirect() -> bool:
    """fd 1 to a new temporary file (False: there is no fd 1)."""
    _flush()
    try:
        saved = os.dup(1)
    except OSError:
        return False
    sink = tempfile.TemporaryFile()
    os.dup2(sink.fileno(), 1)
    _quiet.update(sink=sink, saved=saved)
    return True


def _restore() -> None:
    """fd 1 back; what the temporary file caught to the logger."""
    _flush()
    sink, saved = _quiet["sink"], _quiet["saved"]
    os.dup2(saved, 1)
    os.close(saved)
    sink.seek(0)
    caught = sink.read().decode(errors="replace")
    sink.close()
    _quiet.update(sink=None, saved=None)
    if caught:
        _log.debug("HiGHS printed: %s", caught.rstrip())


def _libc() -> ctypes.CDLL | None:
    """The C library (its ``fflush``), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
