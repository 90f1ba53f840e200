"""Trace a model that has no weights (meta device, FakeTensorMode, built from a config)
into the same joint graph a real trace gives.

Why not ``trace_joint`` on a meta model: AOTAutograd fakes each primal with
``FakeTensorMode.from_tensor``, which keeps the source's device, so a meta parameter
becomes a FakeTensor *on device meta*. Under the Python dispatcher, ops that are
``CompositeImplicitAutograd`` and also have a Python ``Meta`` kernel
(``torch/_meta_registrations.py``: ``aten::nll_loss``, ``dropout``, ``var_mean``, ...;
109 ops in torch 2.13) resolve ``AutogradMeta`` to that kernel
(``torch._ops.resolve_key``), skip their decomposition and fall to autograd's
not-implemented fallback: the loss loses its path to the parameters and the joint graph
comes out with an empty backward. On device meta SDPA also takes the math path, since
its backend choice has no meta kernel.

The fix is the device of the fakes. Every parameter, buffer and input tensor becomes a
FakeTensor *on the target device* of one ``FakeTensorMode``
(``FakeTensorConverter.from_meta_and_device``), with tensors that share a storage (tied
weights, views) sharing one fake storage, and AOTAutograd traces those as the primals.
The joint graph is then node for node the real one (op, shape, dtype, stride, storage
aliasing), so every prediction made from it equals the real trace's to the byte
(``tests/graph/test_fake_trace.py``). The graph can be rewritten and analysed but not run:
``JointGraph.fake`` is set and its figures are predicted only.

Limits: a fake CUDA trace is refused in a build without CUDA (autograd through a fake
CUDA leaf aborts the process); trace on ``"cpu"`` under ``cuda_target.CudaKernels``
instead. Tensors the model or loss close over are constants of the graph and must be
real (on the target device) or inputs. Code that reads tensor values (``.item()``, a
Python branch on a tensor) fails as it does in a real trace, with the op named.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._mode_utils import no_dispatch

from ..errors import RematError, UnsupportedGraph
from .flat_step import LossFn, flatten_step
from .shape_symbols import dynamic_dims, symbolic_context
from .trace import JointGraph, capture_joint, joint_graph, trace_joint
from .trace_context import constant_values_mode


class FakeConverter:
    """Real, meta or fake tensors -> FakeTensors on ``device`` of ``mode``.

    Tensors that share a storage (tied weights, views) become fakes that share one fake
    storage, so storage identity (what liveness groups by) is that of the real tensors;
    give ``convert`` every tensor at once so the groups are known.

    Args:
        mode: the FakeTensorMode the trace runs in.
        device: the device the fakes report (``"cpu"``, ``"cuda"``).
    """

    def __init__(self, mode: FakeTensorMode, device: str | torch.device):
        self.mode = mode
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self._memo: dict[int, FakeTensor] = {}
        self._sources: list[torch.Tensor] = []  # keeps the ids in _memo unique

    def convert(self, tensors: Sequence[torch.Tensor]) -> list[FakeTensor]:
        """The fakes of ``tensors``, in order (the same tensor twice: the same fake). A
        DTensor (a tensor-parallel parameter) becomes a DTensor of the same mesh and
        placements over the fake of its local shard."""
        from torch.distributed.tensor import DTensor

        subclass = [t for t in tensors if isinstance(t, DTensor)]
        if subclass:
            locals_ = self.convert([t._local_tensor for t in subclass])
            for t, fake_local in zip(subclass, locals_):
                if id(t) not in self._memo:
                    self._memo[id(t)] = DTensor(fake_local.detach(), t._spec, requires_grad=t.requires_grad)
                    self._sources.append(t)
            tensors_plain = [t for t in tensors if not isinstance(t, DTensor)]
            self.convert(tensors_plain)
            return [self._memo[id(t)] for t in tensors]
        groups: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            group = groups.setdefault(t.untyped_storage()._cdata, [])
            if id(t) not in self._memo and all(t is not u for u in group):
                group.append(t)
        for members in groups.values():
            if members:  # tensors seen in an earlier call keep their fakes
                self._convert_group(members)
        return [self._memo[id(t)] for t in tensors]

    def _convert_group(self, members: list[torch.Tensor]) -> None:
        nbytes = int(members[0].untyped_storage().nbytes())
        base = None
        for t in members:
            owns_storage = (len(members) == 1 and t.storage_offset() == 0 and t.is_contiguous()
                            and t.numel() * t.element_size() == nbytes)
            with torch.no_grad():
                if owns_storage:
                    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                else:  # a view of one meta byte buffer shared by the group
                    if base is None:
                        base = torch.empty(nbytes, dtype=torch.uint8, device="meta")
                    meta = base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            fake = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, self.device)
            if t.requires_grad:
                fake.requires_grad_(True)
            self._memo[id(t)] = fake
            self._sources.append(t)


def check_trace_device(device: str | torch.device) -> torch.device:
    """The device to trace fakes on; refuses CUDA in a build that cannot use it.

    Raises:
        RematError: ``device`` is CUDA and this PyTorch has no usable CUDA (autograd
            through a fake CUDA tensor would abort the process).
        ValueError: not a device name.
    """
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{device!r} is not a device (use cpu or cuda)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RematError(
            "this PyTorch cannot trace fake CUDA tensors (no usable CUDA: autograd through a "
            "fake CUDA tensor aborts the process); trace on cpu with the CUDA kernels modelled "
            "(cuda_target.CudaKernels, the command line's --target cuda)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {dev.type!r} is not supported for fake tracing (cpu or cuda)")
    return dev


def _fake_symbolic(mode: FakeTensorMode, value: torch.Tensor, device: torch.device,
                   dims: set[int]) -> FakeTensor:
    """A FakeTensor on ``device`` whose dimensions ``dims`` are fresh symbols (the meta
    converter with a callback that sets the fake device; ``from_tensor`` keeps meta)."""

    def make_fake(make_meta: Any, device: Any = None) -> FakeTensor:
        with no_dispatch():
            return FakeTensor(mode, make_meta(), dev)

    dev = device
    fake = mode.fake_tensor_converter.meta_converter(
        value, shape_env=mode.shape_env, callback=make_fake, symbolic_context=symbolic_context(value, dims))
    if value.requires_grad and not fake.requires_grad:
        fake.requires_grad_(True)
    return fake


def trace_joint_fake(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    symbols: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    output: str = "loss",
) -> JointGraph:
    """``trace_joint`` for a model without weights, traced as if it lived on ``device``.

    Parameters, buffers and input tensors may be meta, fake or real; each becomes a
    FakeTensor on ``device`` (storage sharing kept). Nothing is allocated at full size.

    Args:
        model, example_inputs, loss_fn, symbols: as ``trace.trace_joint``; meta tensors
            of the right shape and dtype do as inputs (token ids are never read).
        device: the device the fakes report; it decides the kernels (CPU: the CPU's
            SDPA flash kernel). Use ``"cpu"`` with ``cuda_target.CudaKernels`` active
            to model a GPU.
        output: ``"loss"`` or ``"activation"`` (a pipeline stage), as ``trace_joint``.

    Returns:
        The JointGraph, ``fake=True``: ``primal_values`` and ``tangent_values`` are
        FakeTensors (rewrite and analyse it; it cannot be run or measured).

    Raises:
        UnsupportedGraph: as ``trace_joint`` (reading tensor values names the op; a
            joint graph without any gradient is refused, never returned).
        RematError: ``device`` is CUDA in a build that cannot trace it.
        ValueError: a ``symbols`` entry names no input dimension; an unknown device.

    Example:
        >>> with torch.device("meta"):
        ...     m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> j = trace_joint_fake(m, (torch.empty(3, 4, device="meta"),), lambda y: y.sum())
        >>> j.fake, j.primal_values[0].device, len(j.gm.graph.nodes)
        (True, device(type='cpu'), 27)
        >>> from remat_pass.graph.trace import trace_joint
        >>> real = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> r = trace_joint(real, (torch.randn(3, 4),), lambda y: y.sum())
        >>> [n.target for n in r.gm.graph.nodes] == [n.target for n in j.gm.graph.nodes]
        True
    """
    dev = check_trace_device(device)
    flat = flatten_step(model, example_inputs, loss_fn, output)
    shape_env = ShapeEnv() if symbols else None
    mode = constant_values_mode(shape_env)  # closed-over constants' values known, as in a concrete trace
    converter = FakeConverter(mode, dev)
    dims_of_symbol: dict[str, list[tuple[int, int]]] = {}
    if symbols:
        dynamic, dims_of_symbol = dynamic_dims(symbols, flat)
        static = [v for i, v in enumerate(flat.primal_values) if i not in dynamic]
        converter.convert(static)
        memo: dict[int, Any] = {}
        fakes = []
        for i, v in enumerate(flat.primal_values):
            if i in dynamic:
                memo.setdefault(id(v), _fake_symbolic(mode, v, dev, dynamic[i]))
                fakes.append(memo[id(v)])
            else:
                fakes.append(converter.convert([v])[0])
    else:
        fakes = converter.convert(flat.primal_values)
    try:
        joint, num_fwd_outputs = capture_joint(flat.fn, fakes, dynamic=bool(symbols), fake_mode=mode)
    except UnsupportedGraph as e:
        if type(e.__cause__).__name__ == "FakeTensorDeviceMismatchError" and "meta" in str(e.__cause__):
            raise UnsupportedGraph(
                "a tensor the model or the loss function closes over (a loss target, a mask) is on the meta "
                "device; only parameters, buffers and inputs may be meta: pass it as an input, or create it "
                f"with real values ({e.__cause__})") from e
        raise
    return joint_graph(flat, joint, num_fwd_outputs, model, fakes, dims_of_symbol, shape_env,
                       primal_values=fakes, fake=True, output=output)


def has_no_data(model: torch.nn.Module, example_inputs: Any = ()) -> bool:
    """Whether a parameter, buffer or input tensor of the step is meta or fake, so it
    must be traced with ``trace_joint_fake`` (and can only be predicted)."""
    args: list[Any]
    if isinstance(example_inputs, torch.Tensor):
        args = [example_inputs]
    elif isinstance(example_inputs, dict):
        args = list(example_inputs.values())
    elif isinstance(example_inputs, (tuple, list)):
        args = list(example_inputs)
    else:
        args = []
    tensors = [*model.parameters(), *model.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def trace_model(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    fake: bool = False,
    kernels: Callable[[], ContextManager[Any]] | None = None,
    output: str = "loss",
) -> JointGraph:
    """The one choice between a real and a fake trace of a step.

    A model whose parameters, buffers or inputs are meta or fake tensors
    (``has_no_data``), or any model when ``fake``, is traced by ``trace_joint_fake``
    (on the CPU, under ``kernels``: ``cuda_target.CudaKernels`` models a GPU); any
    other by ``trace.trace_joint`` (``kernels`` unused).

    Args:
        model, example_inputs, loss_fn: as ``trace.trace_joint``.
        fake: trace with fake tensors even if the model has weights.
        kernels: a context manager factory active while a fake step is traced.
        output: ``"loss"`` or ``"activation"`` (a pipeline stage, ``trace.trace_joint``).

    Raises:
        UnsupportedGraph, RematError, ValueError: as ``trace_joint`` and
            ``trace_joint_fake``.
    """
    if fake or has_no_data(model, example_inputs):
        with (kernels or contextlib.nullcontext)():
            return trace_joint_fake(model, example_inputs, loss_fn, output=output)
    return trace_joint(model, example_inputs, loss_fn, output=output)
