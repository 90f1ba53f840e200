"""The CPU allocator's events of one profiled run (``torch.profiler`` with
``profile_memory=True``) and the running sum of what the run itself allocates: the
measurement DESIGN.md's Measurement section describes, shared by the rewritten step
(``measure.run``), the eager program, the op calibration and the per-rank runs."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from .quiet import collector_paused as _collector_paused, quiet_stderr as _quiet_stderr


@dataclasses.dataclass(frozen=True)
class AllocatorEvent:
    """One CPU allocator event of a profiler session: ``nbytes`` > 0 an allocation of a
    block at address ``ptr``, < 0 its free; read like a kineto ``[memory]`` event
    (``name()``, ``start_ns()``, ``nbytes()``)."""

    time_ns: int
    bytes: int
    ptr: int

    def name(self) -> str:
        """``"[memory]"``, as kineto names allocator events."""
        return "[memory]"

    def start_ns(self) -> int:
        """When the allocator call was made (ns, the profiler's clock)."""
        return self.time_ns

    def nbytes(self) -> int:
        """Bytes allocated (> 0) or freed (< 0)."""
        return self.bytes


def _allocator_events(results: Any) -> list[AllocatorEvent]:
    from torch._C._profiler import _EventType

    found, stack = [], list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            found.append(AllocatorEvent(e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
    return found


def profile_memory_events(fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` once under ``torch.profiler.profile(profile_memory=True)`` (CPU) with
    the collector paused; return every profiler event, unsorted: the kineto events
    (``record_function`` ranges, ops) and, in place of kineto's ``[memory]`` events, the
    same allocator events with their block address (``AllocatorEvent``, read from the
    profiler's event tree).
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _collector_paused():
        with _quiet_stderr():  # the CPU build's profiler logs start/stop lines on fd 2
            prof.start()
        try:
            fn()
        finally:
            with _quiet_stderr():
                prof.stop()
    results = prof.profiler.kineto_results
    return [e for e in results.events() if e.name() != "[memory]"] + _allocator_events(results)


def step_allocator_events(events: Sequence[Any]) -> list[tuple[int, int]]:
    """``(time ns, bytes)`` of the allocator events of ``profile_memory_events``, in time
    order, that the window's own allocations make: the free of a block allocated before
    the window is left out, and so is a block's reported size when it was not allocated
    inside it.

    Why: c10's ``ProfiledCPUMemoryReporter`` remembers each block's size while memory
    profiling is on and forgets it only when the block is freed with profiling on, on the
    thread that profiles. A block freed with it off (between two measurements, or by
    gloo's worker thread) leaves its entry behind; when malloc hands the same address to a
    later block, that block's free inside a window is reported with the old block's size
    (measured: 5,056 B, 8,192 B, 49,152 B too low, now and then, when other tests had run
    in the process). A block allocated inside the window whose address is allocated again
    before its free is seen was freed where the profiler does not record it: its bytes are
    subtracted at the new allocation, the latest the free can have been."""
    live: dict[int, int] = {}
    out: list[tuple[int, int]] = []
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        t, nbytes, ptr = e.start_ns(), e.nbytes(), getattr(e, "ptr", None)
        if ptr is None:  # a kineto event without its address: as reported
            out.append((t, nbytes))
        elif nbytes > 0:
            if ptr in live:
                out.append((t, -live.pop(ptr)))
            live[ptr] = nbytes
            out.append((t, nbytes))
        elif ptr in live:
            out.append((t, -live.pop(ptr)))
    return out


def running_bytes(events: Sequence[Any]) -> tuple[list[int], list[int]]:
    """``(times_ns, running sum of allocated bytes after each allocator event)``, in time
    order, from the events of ``profile_memory_events`` (``step_allocator_events``)."""
    total, times, running = 0, [], []
    for t, nbytes in step_allocator_events(events):
        total += nbytes
        times.append(t)
        running.append(total)
    return times, running


def profiled_peak_cpu(fn: Callable[[], Any]) -> tuple[int, list[int]]:
    """``(peak bytes, running sum after each allocator event)`` of one run of ``fn`` on
    CPU, above what was allocated before it (the collector paused; warm ``fn`` up first)."""
    _, running = running_bytes(profile_memory_events(fn))
    return max([0, *running]), running
