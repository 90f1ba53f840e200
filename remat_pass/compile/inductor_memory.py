"""Inductor's buffers and their lifetimes, read from the code it generated for a graph:
the liveness of what runs under ``compiler="inductor"``.

Why the generated code: it is what runs. Inductor fuses the fx nodes into kernels, so
most intermediate values never exist; its scheduler orders the fused nodes
(``torch/_inductor/scheduler.py``: ``fuse_nodes``, ``memory.reorder_for_peak_memory``,
``compute_last_usage``) and its wrapper codegen (``codegen/wrapper.py``:
``AllocateLine``, ``FreeIfNotReusedLine``, ``ReuseLine``) turns the buffers into
``bufN = empty_strided_cpu(size, stride, dtype)``, ``del bufN`` at the last use, and
``bufA = bufB; del bufB  # reuse`` when a dead buffer of the same size, dtype and device
is taken over (``buffer_reuse_key``); saved tensors handed to the backward are reused in
place the same way (``torch._functorch.config.donated_buffer``). Fallback (extern)
kernels allocate their own outputs (``bufN = torch.ops.aten.X.default(...)``, sizes in
the ``assert_size_stride`` lines that follow).

The ``call(args)`` body is run symbolically: every name refers to storages; a storage is
freed when no name refers to it (``del``, or the function returning); the steps are
the lines that allocate or run a kernel. Two things the code does not show:

- outputs of a fallback kernel that the code never binds (the logsumexp of
  ``_scaled_dot_product_flash_attention_for_cpu`` when backward does not read it):
  live as long as the kernel's result tuple;
- scratch a kernel allocates and frees inside itself: the flash-attention CPU kernels
  (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``;
  ``graph.op_scratch.flash_attention_bytes``, the formula the op-scratch table uses).

``code_liveness`` turns a graph's forward and backward code into the
``step_flow.GraphLiveness`` the step composition reads.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import sympy
import torch

from ..graph.op_scratch import flash_attention_bytes
from ..liveness.intervals import Storage
from ..liveness.step_flow import GraphLiveness

DTYPE_BYTES = {
    "torch.float32": 4, "torch.float": 4, "torch.float64": 8, "torch.double": 8, "torch.float16": 2,
    "torch.half": 2, "torch.bfloat16": 2, "torch.int64": 8, "torch.long": 8, "torch.int32": 4,
    "torch.int": 4, "torch.int16": 2, "torch.int8": 1, "torch.uint8": 1, "torch.bool": 1,
}

_ALLOC = re.compile(r"^(\w+) = empty_strided_cpu\((\(.*?\)), (\(.*?\)), (torch\.\w+)\)$")
_REUSE = re.compile(r"^(\w+) = (?:reinterpret_tensor\()?(\w+)\b.*; del (\w+)\s+# reuse$")
_ALIAS = re.compile(r"^(\w+) = reinterpret_tensor\((\w+),")
_GETITEM = re.compile(r"^(\w+) = (\w+)((?:\[\d+\])+)$")
_FALLBACK = re.compile(r"^(\w+) = (torch\.ops\.[\w.]+|aten\.[\w.]+|extern_kernels\.[\w.]+)\(")
_ASSERT = re.compile(r"^assert_size_stride\((\w+), (.*)\)$")
_DEL = re.compile(r"^del (\w+(?:, \w+)*)$")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
_SDPA_FORWARD = "_scaled_dot_product_flash_attention_for_cpu.default"
_SDPA_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward.default"


def _call_body(code: str) -> list[str]:
    """The stripped lines of the ``call`` function of Inductor's wrapper code."""
    lines = code.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*def call\((self, )?args\):", line)), None)
    if start is None:
        raise ValueError("no 'def call(args)' in the code: not Inductor's Python wrapper code")
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and (len(line) - len(line.lstrip())) <= indent:
            break
        if line.strip() and not line.strip().startswith("#"):
            body.append(line.strip())
    return body


def _split_top(text: str) -> list[str]:
    """``text`` split at commas outside brackets."""
    depth, cur, items = 0, "", []
    for ch in text:
        depth += ch in "([" 
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur.strip())
    return items


@dataclasses.dataclass
class CodeRun:
    """The allocation trace of one ``call`` body.

    Attributes:
        steps: label of each step (a line that allocates or runs a kernel).
        storages: the storages it allocates (first / last: steps; ``kind``: "buffer",
            "fallback output", "hidden output", "scratch", or "input" for the inputs,
            whose ``first`` is -1 and ``last`` their last reference).
        inputs: the input names, in order, and the storage index of each.
        returns: per returned item, the storage index (an input's included; None: not a
            storage).
    """

    steps: list[str]
    storages: list[Storage]
    inputs: dict[str, int]
    returns: list[int | None]


class _Run:
    """Runs a ``call`` body symbolically (see ``run_code``)."""

    def __init__(self, body: list[str], input_dtypes: Mapping[str, torch.dtype], symbols: Mapping[str, Any],
                 threads: int):
        self.body, self.symbols, self.threads = body, dict(symbols), threads
        self.input_dtypes = input_dtypes
        self.steps: list[str] = []
        self.storages: list[Storage] = []
        self.dtypes: dict[int, str] = {}
        self.ref: dict[str, set[int]] = {}
        self.holders: dict[int, set[str]] = {}
        self.inputs: dict[str, int] = {}
        self.asserts: dict[str, tuple[Any, Any]] = {}
        self.children: dict[str, list[tuple[str, str]]] = {}  # tuple name -> [(child, index)]
        for line in body:
            m = _ASSERT.match(line)
            if m:  # (size), (stride)[, 'input']: tuples whose items may hold calls (max(1, s8))
                size, stride = _split_top(m.group(2))[:2]
                self.asserts[m.group(1)] = (self._tuple(size), self._tuple(stride))
            m = _GETITEM.match(line)
            if m:
                self.children.setdefault(m.group(2), []).append((m.group(1), m.group(3)))

    def _tuple(self, text: str) -> tuple[Any, ...]:
        items = _split_top(text.strip()[1:-1])
        return tuple(self._value(x) for x in items)

    def _value(self, text: str) -> Any:
        try:
            return int(text)
        except ValueError:
            return sympy.sympify(text, locals={"max": sympy.Max, "min": sympy.Min, **self.symbols})

    def nbytes(self, size: Sequence[Any], stride: Sequence[Any], dtype: str) -> Any:
        if any(s == 0 for s in size):
            return 0
        n = 1 + sum((s - 1) * st for s, st in zip(size, stride))
        return n * DTYPE_BYTES.get(dtype, 4)

    def new(self, nbytes: Any, name: str, kind: str, dtype: str = "") -> int:
        first = len(self.steps) - 1
        self.storages.append(Storage(nbytes, first, first, name, None, kind, False))
        sid = len(self.storages) - 1
        self.dtypes[sid] = dtype
        return sid

    def bind(self, name: str, sids: set[int]) -> None:
        self.unbind(name)
        self.ref[name] = set(sids)
        for s in sids:
            self.holders.setdefault(s, set()).add(name)

    def unbind(self, name: str) -> None:
        for s in self.ref.pop(name, set()):
            h = self.holders.get(s, set())
            h.discard(name)
            if not h:
                st = self.storages[s]
                st.last = max(st.last, st.first, len(self.steps) - 1)

    def touch(self, line: str) -> None:
        """Every storage a step's line names is live at that step."""
        at = len(self.steps) - 1
        for word in set(_NAME.findall(line)):
            for s in self.ref.get(word, ()):
                st = self.storages[s]
                st.last = max(st.last, at)

    def step(self, label: str, line: str) -> None:
        self.steps.append(label)
        self.touch(line)

    def dtype_of_first_arg(self, line: str) -> str:
        m = re.search(r"\((?:reinterpret_tensor\()?(\w+)", line[line.index("=") + 1:])
        for s in self.ref.get(m.group(1), ()) if m else ():
            if self.dtypes.get(s):
                return self.dtypes[s]
        return "torch.float32"

    def fallback(self, name: str, kernel: str, line: str) -> None:
        self.step(f"{name} = {kernel}", line)
        in_dtype = self.dtype_of_first_arg(line)
        kids = self.children.get(name) or [(name, "")]
        sids: set[int] = set()
        for child, index in kids:
            if child not in self.asserts:
                continue
            size, stride = self.asserts[child]
            dtype = in_dtype
            if "run_and_save_rng_state" in kernel and index == "[0]":
                dtype = "torch.uint8"  # the CPU generator's state
            elif kernel.endswith(_SDPA_FORWARD) and index.endswith("[1]"):
                dtype = "torch.float32"  # logsumexp: the accumulate type
            sid = self.new(self.nbytes(size, stride, dtype), child, "fallback output", dtype)
            sids.add(sid)
            if child != name:
                self.bind(child, {sid})
        hidden, scratch = self.fallback_extra(kernel, kids, DTYPE_BYTES.get(in_dtype, 4))
        if hidden:
            sids.add(self.new(hidden, f"{name} (unbound output)", "hidden output"))
        if scratch:
            self.new(scratch, f"{name} (scratch)", "scratch")
        self.bind(name, sids)

    def fallback_extra(self, kernel: str, kids: list[tuple[str, str]], element_bytes: int) -> tuple[Any, Any]:
        """(bytes of outputs the code never binds, scratch bytes) of a fallback kernel."""
        shapes = [self.asserts[c][0] for c, _ in kids if c in self.asserts]
        four = [s for s in shapes if len(s) == 4]
        if not four:
            return 0, 0
        b, h, length, e = four[0]
        if kernel.endswith(_SDPA_BACKWARD):
            return 0, flash_attention_bytes(length, length, e, element_bytes, self.threads, backward=True)
        if kernel.endswith(_SDPA_FORWARD):
            lse_bound = any(len(s) == 3 for s in shapes)
            hidden = 0 if lse_bound else b * h * length * 4
            return hidden, flash_attention_bytes(length, length, e, element_bytes, self.threads, backward=False)
        return 0, 0

    def line(self, line: str) -> None:
        if line.endswith("= args"):
            for name in (x.strip() for x in line[: -len("= args")].split(",") if x.strip()):
                dtype = str(self.input_dtypes.get(name, torch.float32))
                size = self.nbytes(*self.asserts[name], dtype) if name in self.asserts else 0
                self.inputs[name] = sid = len(self.storages)
                self.storages.append(Storage(size, -1, -1, name, None, "input", True))
                self.dtypes[sid] = dtype
                self.bind(name, {sid})
            return
        if line == "args.clear()" or line.startswith(("assert_", "return (")):
            return
        m = _ALLOC.match(line)
        if m:
            self.step(f"alloc {m.group(1)}", "")
            size, stride, dtype = self._tuple(m.group(2)), self._tuple(m.group(3)), m.group(4)
            self.bind(m.group(1), {self.new(self.nbytes(size, stride, dtype), m.group(1), "buffer", dtype)})
            return
        m = _REUSE.match(line)
        if m:
            self.bind(m.group(1), self.ref.get(m.group(2), set()))
            self.unbind(m.group(3))
            return
        m = _ALIAS.match(line) or _GETITEM.match(line)
        if m:
            if m.group(1) not in self.ref:
                self.bind(m.group(1), self.ref.get(m.group(2), set()))
            return
        m = _FALLBACK.match(line)
        if m and "out=" not in line:
            self.fallback(m.group(1), m.group(2), line)
            return
        m = _DEL.match(line)
        if m:
            for name in m.group(1).split(", "):
                self.unbind(name)
            return
        self.step(line.split("(", 1)[0], line)  # a kernel, or an extern kernel writing out=

    def finish(self) -> CodeRun:
        ret = next((x for x in self.body if x.startswith("return (")), "return ()")
        items = _split_top(ret[len("return ("):].rstrip()[:-1])
        returns = []
        for it in items:
            m = re.match(r"(?:reinterpret_tensor\()?(\w+)", it)
            sids = sorted(self.ref.get(m.group(1) if m else it, ()))
            returns.append(sids[0] if sids else None)
        end = len(self.steps) - 1
        kept = {s for s in returns if s is not None and not self.storages[s].static}
        for name in list(self.ref):  # locals die at return; returned storages live on
            for s in list(self.ref[name]):
                if s in kept:
                    self.storages[s].last = max(self.storages[s].last, end)
                    self.holders[s].discard(name)
                    self.ref[name].discard(s)
            self.unbind(name)
        return CodeRun(self.steps, self.storages, self.inputs, returns)


def run_code(code: str, input_dtypes: Mapping[str, torch.dtype] | None = None,
             symbols: Mapping[str, Any] | None = None, threads: int | None = None) -> CodeRun:
    """Run the ``call`` body of Inductor's wrapper code symbolically.

    Args:
        code: the wrapper code (``CompiledFxGraph.source_code``).
        input_dtypes: the dtype of each input by name (the code states sizes of inputs
            but not dtypes); float32 where not given.
        symbols: sympy symbols of the sizes in the code by name (dynamic shapes).
        threads: intra-op threads (the flash-attention scratch is per thread); default
            ``torch.get_num_threads()``.

    Raises:
        ValueError: ``code`` has no ``call`` function.
    """
    run = _Run(_call_body(code), input_dtypes or {}, symbols or {}, threads or torch.get_num_threads())
    for line in run.body:
        run.line(line)
    return run.finish()


def code_liveness(graph_id: str, forward_code: str, backward_code: str, num_fwd_outputs: int,
                  tangent_nbytes: Sequence[Any], input_dtypes: Mapping[str, torch.dtype] | None = None,
                  symbols: Mapping[str, Any] | None = None, num_primals: int | None = None) -> GraphLiveness:
    """The GraphLiveness of a graph compiled by Inductor, from its forward and backward
    wrapper code.

    The forward returns ``(*outputs, *saved tensors, *saved SymInts)`` and the backward
    takes ``(*saved SymInts, *saved tensors, *tangents)`` (AOTAutograd's convention,
    ``graph_transforms.aot_graphs``): a saved storage lives from its allocation in the
    forward to the point the backward drops the last name of it; a saved primal stays
    with its owner.

    Args:
        graph_id: the graph's id.
        forward_code, backward_code: the wrapper code of each.
        num_fwd_outputs: the forward's outputs before the saved values.
        tangent_nbytes: the size of each tangent (from the fx graph: the code does not
            state dtypes).
        input_dtypes, symbols: as ``run_code``.
        num_primals: the forward's inputs (default: those of its code).
    """
    fw = run_code(forward_code, input_dtypes, symbols)
    bw = run_code(backward_code, input_dtypes, symbols)
    nf = len(fw.steps)
    storages = [dataclasses.replace(s) for s in fw.storages]
    offset = len(storages)
    for s in bw.storages:
        storages.append(dataclasses.replace(s, first=s.first + nf if s.first >= 0 else -1, last=s.last + nf))
    fw_input_of = {sid: name for name, sid in fw.inputs.items()}
    bw_inputs = list(bw.inputs)
    tangents = [n for n in bw_inputs if n.startswith("tangents")]
    saved_inputs = bw_inputs[: len(bw_inputs) - len(tangents)]
    # SymInts: first in backward, last in forward (where the code returns them, as names
    # that are no storage: a saved tensor always is one)
    saved_returns = [sid for sid in fw.returns[num_fwd_outputs:] if sid is not None]
    n_sym = max(len(saved_inputs) - len(saved_returns), 0)
    primal_names = list(fw.inputs)[: num_primals] if num_primals is not None else list(fw.inputs)
    input_last = {n: fw.storages[sid].last for n, sid in fw.inputs.items()}
    as_forward: dict[int, int] = {}  # backward input storage -> the forward storage it is
    for j, name in enumerate(saved_inputs[n_sym:]):
        bw_sid = bw.inputs[name]
        last = bw.storages[bw_sid].last + nf if bw.storages[bw_sid].last >= 0 else -1
        src = saved_returns[j] if j < len(saved_returns) else None
        if src is None:
            continue
        if src in fw_input_of:  # a saved primal: its owner holds it; the graph reads it until here
            input_last[fw_input_of[src]] = max(input_last[fw_input_of[src]], last)
        else:
            fs = storages[src]
            fs.last, fs.kind = max(fs.last, last), "saved"
            as_forward[bw_sid] = src
    outputs = tuple(None if sid is None or sid in fw_input_of else sid for sid in fw.returns[:num_fwd_outputs])
    for sid in outputs:
        if sid is not None and storages[sid].kind != "saved":
            storages[sid].kind = "output"
    gradients = []
    for sid in bw.returns:  # a gradient may live in a donated saved buffer
        if sid is None or (bw.storages[sid].static and sid not in as_forward):
            gradients.append(None)
        else:
            gradients.append(as_forward.get(sid, sid + offset))
    for sid in gradients:
        if sid is not None:
            storages[sid].kind = "gradient"
    tangent_last = tuple((bw.storages[bw.inputs[t]].last + nf) if bw.storages[bw.inputs[t]].last >= 0 else -1
                         for t in tangents)
    return GraphLiveness(
        graph_id=graph_id,
        forward_steps=tuple(fw.steps),
        backward_steps=tuple(bw.steps),
        step_layers=tuple([None] * (nf + len(bw.steps))),
        storages=tuple(storages),
        output_sids=outputs,
        gradient_sids=tuple(gradients),
        input_last=tuple(input_last.get(n, -1) for n in primal_names),
        tangent_last=tangent_last,
        tangent_nbytes=tuple(tangent_nbytes),
    )
