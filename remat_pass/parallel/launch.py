"""Run a function on N local ranks with torch.distributed, and end every process.

``run_ranks(fn, world)`` starts ``world`` processes (``multiprocessing``, spawn by
default), each of which joins one process group (rendezvous through a ``file://``
store in a fresh temporary directory: no TCP port to pick, nothing to race for),
calls ``fn(rank, world, *args)`` and sends its result back. The parent watches them:

- a rank that raises sends its traceback and exits with an error; the parent then
  ends every other rank (SIGTERM, SIGKILL after a grace period) and raises
  ``RankFailed`` naming the rank and the reason (its exception, or the signal or exit
  code when it died without one);
- past ``deadline_s`` every rank still running is ended and reported as hung;
- a rank blocked on a peer that died ends by itself after the process group's
  ``timeout`` (``pg_timeout_s``; gloo: "Connection closed by peer" or a timeout).

Every child has ended when ``run_ranks`` returns or raises. Each rank calls
``torch.set_num_threads(1)`` (gloo adds two worker threads per process).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import InvalidOption, RematError

BACKENDS = ("gloo", "nccl")
START_METHODS = ("spawn", "forkserver")
GRACE_S = 5.0
# imported once by the fork server, so that forked ranks start without importing them
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd",
                      "remat_pass.parallel.distributed")


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return: ``reason`` is its exception (last line), the signal
    or exit code it ended with, or ``"hung: ..."`` past the deadline; ``detail`` the
    traceback when there is one."""

    rank: int
    reason: str
    detail: str = ""


class RankFailed(RematError):
    """A rank raised, died or hung; every rank has been ended. ``failures`` lists the
    ranks that failed, in the order they were reported: the first is the cause (a
    peer of a dead rank may report a broken connection after it)."""

    def __init__(self, failures: list[RankFailure]):
        self.failures = failures
        text = "; ".join(f"rank {f.rank}: {f.reason}" for f in failures)
        super().__init__(f"the distributed run failed ({text}); every other rank was ended")


RANK_THREADS = 1
"""Intra-op threads of every rank ``run_ranks`` starts (``torch.set_num_threads``): one
per process, as gloo adds two worker threads of its own. Op scratch that depends on the
thread count (CPU flash attention's per-thread buffers) is predicted at this count."""


def _entry(rank: int, world: int, init_file: str, backend: str, pg_timeout_s: float,
           fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    torch.set_num_threads(RANK_THREADS)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ok, result = False, None
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world, *args)
        ok = True
    except BaseException as e:  # report it first (peers may fail next), then exit with an error
        queue.put((rank, False, f"{type(e).__name__}: {e}".splitlines()[0][:500], traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
    queue.put((rank, True, result, ""))


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), deadline_s: float = 600,
              pg_timeout_s: float = 60, backend: str = "gloo", start_method: str = "spawn") -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return ``{rank: result}``.

    Args:
        fn: a picklable module-level function; its result must be picklable.
        world: number of ranks (processes).
        deadline_s: seconds after which ranks still running are ended (hung).
        pg_timeout_s: the process group's timeout for collectives and receives.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        start_method: ``"spawn"`` or ``"forkserver"`` (children forked from a server
            that imported torch once; faster for repeated launches).

    Raises:
        RankFailed: a rank raised, died or hung (module docstring).
        InvalidOption: bad ``world``, ``backend`` or ``start_method``.
    """
    if world < 1:
        raise InvalidOption(f"world size {world}: must be 1 or more")
    if backend not in BACKENDS:
        raise InvalidOption(f"backend {backend!r} is not one of {BACKENDS}")
    if start_method not in START_METHODS:
        raise InvalidOption(f"start method {start_method!r} is not one of {START_METHODS}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    tmp = tempfile.mkdtemp(prefix="remat_pass_ranks_")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), backend, pg_timeout_s,
                                              fn, args, queue), daemon=True) for r in range(world)]
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    try:
        for p in procs:
            p.start()
        t0 = time.monotonic()
        while True:
            _drain(queue, results, failures)
            if failures:
                break
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                time.sleep(0.2)  # its report may still be in the pipe
                _drain(queue, results, failures)
                for r, code in dead:
                    failures.setdefault(r, RankFailure(r, _exit_reason(code)))
                break
            if all(p.exitcode == 0 for p in procs):
                _drain(queue, results, failures)
                break
            if time.monotonic() - t0 > deadline_s:
                for r, p in enumerate(procs):
                    if p.exitcode is None and r not in results:
                        failures[r] = RankFailure(r, f"hung: still running after the {deadline_s:g} s deadline")
                break
            time.sleep(0.05)
    finally:
        _end_all(procs)
        _drain(queue, results, failures)
        queue.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        raise RankFailed(list(failures.values()))  # in the order they were reported
    missing = [r for r in range(world) if r not in results]
    if missing:
        raise RankFailed([RankFailure(r, "ended without a result") for r in missing])
    return results


def _drain(queue: Any, results: dict[int, Any], failures: dict[int, RankFailure]) -> None:
    while not queue.empty():
        rank, ok, payload, detail = queue.get()
        if ok:
            results[rank] = payload
        else:
            failures.setdefault(rank, RankFailure(rank, payload, detail))


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"died by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _end_all(procs: list[Any]) -> None:
    """SIGTERM every live process, SIGKILL what is left after ``GRACE_S``, reap all."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.terminate()
    t0 = time.monotonic()
    for p in started:
        p.join(max(0.0, GRACE_S - (time.monotonic() - t0)))
    for p in started:
        if p.is_alive():
            p.kill()
            p.join()
