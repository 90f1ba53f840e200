"""Calibrate op memory: run each distinct op signature alone under the allocator profiler.

For one op signature (``op_signature``) the calibration builds real inputs with the
same shapes, strides, storage offsets, dtypes and storage sharing as the values of the
step's real run (the traced FakeTensors', or the real layout the reference run recorded
where an op's meta function and kernel disagree: ``op_signature.REAL_LAYOUT``) (floating values normal, integer and bool values zero: a valid index,
target, mask for every op seen; the recorded values where an op's allocations depend on
them, ``op_signature.VALUE_ARGUMENTS``, and such an op is not calibrated at all when
none were recorded), runs the op twice to warm up (oneDNN and MKL build
their state on the first calls), then ``repeats`` times inside
``record_function`` windows of one profiler session (``measure.profile_memory_events``,
the measuring path of the step itself, collector paused). In each window the
allocator events, in time order, give a running sum from 0:

- ``transient_bytes = max(running) - running at the end`` (the op's scratch);
- ``output_storage_bytes``: each output's real ``untyped_storage().nbytes()`` (0 for
  one that aliases an input or an earlier output), read from the first run's outputs,
  kept alive until the session ends;
- ``retained_bytes = running at the end - sum(output_storage_bytes)``.

Since the executor frees values only between nodes, a step then peaks at (live before)
+ (real outputs) + (transient), whatever order the op allocates in: the liveness model
with these figures is the measured one, byte for byte (``tests/memory/test_memory_model.py``
checks it at every step).

All new signatures of a batch share one profiler session (~1-3 ms per tiny signature,
~0.1 s for GPT-2-sized ones, on 2 loaded cores). The figures are kept in a cache file
per host (``op_signature.host_identity``: torch version, CPU model and ISA), JSON Lines
appended to, in ``$REMAT_PASS_CACHE_DIR`` or ``~/.cache/remat-pass``
(``$XDG_CACHE_HOME``), so a machine calibrates a signature once. The calibration runs on
the CPU only; CUDA targets use the table (``memory_model``).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from ..measure.allocator_events import profile_memory_events, step_allocator_events
from .memory_model import MemoryModel, OpMemory
from ..graph.op_signature import host_identity, layout_of, op_call, recorded_values, signature_of, value_arguments
from ..recompute.rewrite import RewrittenStep

CACHE_ENV = "REMAT_PASS_CACHE_DIR"
CACHE_FORMAT = "remat-pass-op-memory"
CACHE_VERSION = 1
WINDOW_PREFIX = "remat-calibrate::"


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """How to calibrate.

    Attributes:
        cache_dir: folder of the cache file; None: ``$REMAT_PASS_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/remat-pass``, else ``~/.cache/remat-pass``.
        use_cache: read and write the cache file (False: keep figures in memory only).
        repeats: measured runs per signature (the largest figures are kept when they
            differ).
        warmups: unmeasured runs first.
    """

    cache_dir: Path | str | None = None
    use_cache: bool = True
    repeats: int = 3
    warmups: int = 2


def default_cache_dir() -> Path:
    """``$REMAT_PASS_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat-pass``, else ``~/.cache/remat-pass``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "remat-pass"


def cache_path(cache_dir: Path | str, host: str) -> Path:
    """The cache file of ``host`` in ``cache_dir`` (one file per host identity)."""
    digest = hashlib.sha256(host.encode("utf-8")).hexdigest()[:16]
    return Path(cache_dir) / f"op-memory-{digest}.jsonl"


def step_nodes(steps: Iterable[RewrittenStep]) -> list[fx.Node]:
    """The nodes of the forward then backward graph of every step, in graph order."""
    return [n for s in steps for g in (s.forward, s.backward) for n in g.graph.nodes
            if n.op == "call_function"]


class Calibrator:
    """Calibrates op signatures on this machine's CPU, keeping the figures (and a cache
    file per host); ``memory_model`` gives the MemoryModel of some steps.

    Attributes:
        options: the CalibrationOptions.
        host: the host identity the figures are valid for.
        path: the cache file (None without a cache).
        calibrated_signatures: signatures calibrated by this object (not read from the cache).
        calibrate_s: seconds spent calibrating them.
    """

    def __init__(self, options: CalibrationOptions = CalibrationOptions()):
        self.options = options
        self.host = host_identity("cpu")
        self.path = (cache_path(options.cache_dir or default_cache_dir(), self.host)
                     if options.use_cache else None)
        self._foreign = False  # the cache file is not ours to append to
        self._entries: dict[str, OpMemory] = self._load()
        self._failed: dict[str, str] = {}
        self.calibrated_signatures = 0
        self.calibrate_s = 0.0

    def memory_model(self, steps: Iterable[RewrittenStep], allocator: str = "cpu",
                     threads: int | None = None) -> MemoryModel:
        """The MemoryModel of ``steps`` run with ``threads`` intra-op threads (default:
        ``torch.get_num_threads()``): every op signature of their CPU ops calibrated
        (run now unless known), the table for what could not be.

        A ``"cuda"`` allocator gets the table-only model: calibration runs on the CPU.
        """
        return self.memory_model_of(step_nodes(steps), allocator, threads)

    def memory_model_of(self, nodes: Iterable[fx.Node], allocator: str = "cpu",
                        threads: int | None = None) -> MemoryModel:
        """As ``memory_model``, for the op nodes of any fx graph (an eager step's
        recording, ``graph/eager_trace``)."""
        threads = threads or torch.get_num_threads()
        base = MemoryModel.table_only(allocator, threads)
        if allocator != "cpu":
            return base
        keys = self.calibrate(nodes, threads)
        return base.with_calibration({k: self._entries[k] for k in keys if k in self._entries},
                                     {k: self._failed[k] for k in keys if k in self._failed})

    def calibrate(self, nodes: Iterable[fx.Node], threads: int) -> list[str]:
        """Calibrate every signature of ``nodes`` (at ``threads``) not known yet, in one
        profiler session; save the cache. Returns the signature keys of ``nodes``."""
        keys: list[str] = []
        todo: dict[str, fx.Node] = {}
        for n in nodes:
            sig = signature_of(n, threads)
            if sig is None:
                continue
            keys.append(sig.key)
            unknown = [v for v in value_arguments(op_call(n)) if recorded_values(v) is None]  # type: ignore[arg-type]
            if unknown:
                # before the cache: an older cache holds this key calibrated with zeros
                self._entries.pop(sig.key, None)
                self._failed[sig.key] = (f"its allocations depend on the values of {unknown[0].name} (how a router "
                                         "splits the tokens among experts, how many elements a boolean mask "
                                         "selects), which only a run of the step has")
                continue
            if sig.key in self._entries or sig.key in self._failed or sig.key in todo:
                continue
            if any(t.device != "cpu" for t in sig.tensors):
                self._failed[sig.key] = "calibration runs on the CPU only"
                continue
            todo[sig.key] = n
        if todo:
            t0 = time.perf_counter()
            measured, failed = _calibrate_batch(todo, threads, self.options)
            self.calibrate_s += time.perf_counter() - t0
            self.calibrated_signatures += len(measured)
            self._entries.update(measured)
            self._failed.update(failed)
            if measured:
                self._save(measured)
        return keys

    def _load(self) -> dict[str, OpMemory]:
        """The figures in the cache file: a JSON Lines file whose first line names the
        format, its version and the host, each later line one signature (a later line
        wins). A file of another format, version or host is ignored; a line that is not
        an entry (a torn write) is skipped."""
        if self.path is None or not self.path.exists():
            return {}
        entries: dict[str, OpMemory] = {}
        try:
            with open(self.path, encoding="utf-8") as f:
                header = json.loads(f.readline() or "{}")
                if header != self._header():
                    self._foreign = True
                    return {}
                for line in f:
                    try:
                        d = json.loads(line)
                        entries[d["key"]] = OpMemory.from_json(d["op_memory"])
                    except (ValueError, KeyError, TypeError):
                        continue
        except (OSError, ValueError, UnicodeDecodeError) as e:
            warnings.warn(f"remat-pass: ignoring the unreadable calibration cache {self.path} ({e}); "
                          "its op signatures are calibrated again", stacklevel=3)
            self._foreign = True
        return entries

    def _header(self) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, "version": CACHE_VERSION, "host": self.host}

    def _save(self, new: Mapping[str, OpMemory]) -> None:
        """Append ``new`` to the cache file, one line each in a single write (a file of
        another format or host, or an unreadable one, is replaced first)."""
        if self.path is None:
            return
        lines = "".join(json.dumps({"key": k, "op_memory": m.to_json()}, separators=(",", ":")) + "\n"
                        for k, m in new.items())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._foreign or not self.path.exists():
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self._header()) + "\n" + lines, encoding="utf-8")
                os.replace(tmp, self.path)
                self._foreign = False
            else:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(lines)
        except OSError as e:
            warnings.warn(f"remat-pass: cannot write the calibration cache {self.path} ({e}); "
                          f"set {CACHE_ENV} to a writable folder", stacklevel=3)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def _fill(storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
    """Normal values for floating / complex dtypes, zeros otherwise (a valid index,
    target and mask for every op)."""
    n = storage.nbytes() // dtype.itemsize
    if n == 0:
        return
    t = torch.empty(0, dtype=dtype).set_(storage, 0, (n,), (1,))
    if dtype.is_floating_point or dtype.is_complex:
        t.normal_()
    else:
        t.zero_()


def _materialize(node: fx.Node) -> tuple[Any, tuple, dict]:
    """``(op, args, kwargs)`` of ``node``'s op with real CPU tensors laid out as the
    step's real run lays them out (``op_signature.layout_of``: the recorded real layout,
    else the FakeTensor's): same shapes, strides, offsets, dtypes, and one real storage
    (the largest size seen) for the arguments that share a fake storage; the values the
    reference run recorded where the op's allocations depend on them
    (``op_signature.VALUE_ARGUMENTS``), else ``_fill``'s."""
    call = op_call(node)
    assert call is not None
    sizes: dict[int, int] = {}

    def size(a: fx.Node) -> fx.Node:
        layout = layout_of(a)
        if layout is not None:
            key = a.meta["val"].untyped_storage()._cdata
            sizes[key] = max(sizes.get(key, 0), layout[2])
        return a

    fx.node.map_arg((call.args, call.kwargs), size)
    storages: dict[int, torch.UntypedStorage] = {}

    def real(a: fx.Node) -> Any:
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return val
        key = val.untyped_storage()._cdata
        if key not in storages:
            storage = torch.empty(sizes[key], dtype=torch.uint8).untyped_storage()
            _fill(storage, val.dtype)
            storages[key] = storage
        stride, offset, _ = layout_of(a)  # type: ignore[misc]
        t = torch.empty(0, dtype=val.dtype)
        t.set_(storages[key], offset, tuple(int(s) for s in val.shape), stride)
        values = recorded_values(a)
        if values is not None:  # an argument whose values decide the op's allocations
            t.copy_(torch.tensor(values, dtype=val.dtype).view(t.shape))
        return t

    args = fx.node.map_arg(call.args, real)
    kwargs = fx.node.map_arg(call.kwargs, real)
    return call.op, tuple(args), dict(kwargs)


def _output_storage_bytes(out: Any, inputs: Any) -> tuple[int, ...]:
    """Real storage bytes of each tensor output (pytree order), 0 for one that aliases
    an input or an earlier output."""
    seen = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()}
    sizes = []
    for t in pytree.tree_leaves(out):
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            sizes.append(0)
        else:
            seen.add(storage.data_ptr())
            sizes.append(storage.nbytes())
    return tuple(sizes)


def _peak_and_end(events: list[int]) -> tuple[int, int]:
    running = peak = 0
    for nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak, running


def _calibrate_batch(todo: Mapping[str, fx.Node], threads: int,
                     options: CalibrationOptions) -> tuple[dict[str, OpMemory], dict[str, str]]:
    """Calibrate the signatures ``todo`` (key -> a node with that signature) in one
    profiler session: ``(figures, failures)`` by key."""
    failed: dict[str, str] = {}
    calls: list[tuple[str, Any, tuple, dict]] = []
    kept: dict[int, Any] = {}
    with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(devices=[]), _threads(threads):
        for key, node in todo.items():
            try:
                op, args, kwargs = _materialize(node)
                for _ in range(options.warmups):
                    op(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any op error: no figure, the table is used
                failed[key] = f"calibration failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                continue
            calls.append((key, op, args, kwargs))

        def run() -> None:
            for i, (_, op, args, kwargs) in enumerate(calls):
                for r in range(options.repeats):
                    with torch.profiler.record_function(f"{WINDOW_PREFIX}{i}::{r}"):
                        out = op(*args, **kwargs)
                    if r == 0:
                        kept[i] = out  # alive until the session ends: its storages are read
                    del out

        events = profile_memory_events(run) if calls else []
    windows = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns())
               for e in events if e.name().startswith(WINDOW_PREFIX)}
    memory = step_allocator_events(events)
    times = [t for t, _ in memory]
    measured: dict[str, OpMemory] = {}
    for i, (key, _, args, kwargs) in enumerate(calls):
        runs = []
        for r in range(options.repeats):
            start, stop = windows[f"{WINDOW_PREFIX}{i}::{r}"]
            lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, stop)
            runs.append([nbytes for _, nbytes in memory[lo:hi]])
        figures = [_peak_and_end(ev) for ev in runs]
        outputs = _output_storage_bytes(kept[i], (args, kwargs))
        transient = max(peak - end for peak, end in figures)
        retained = max(end for _, end in figures) - sum(outputs)
        measured[key] = OpMemory(transient, outputs, retained, all(ev == runs[0] for ev in runs))
    kept.clear()
    return measured, failed
