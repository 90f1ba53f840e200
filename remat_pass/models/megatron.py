"""Megatron-Core models on the CPU: Megatron-Core's own ``GPTModel`` (local layer spec)
built and run unmodified on one gloo process (optional extra ``megatron``:
``pip install remat-pass[megatron]``, megatron-core 0.16.1).

Megatron-Core needs three things that a CPU-only machine does not give it; this module is
the one place of the product that provides them (``setup_megatron_cpu``), and undoes them
(``teardown_megatron_cpu``):

1. **Process groups.** ``parallel_state.initialize_model_parallel(t, 1)``. At
   tensor-parallel size t = 1 over a gloo default group of world size 1 (a ``file://``
   rendezvous in a temporary folder), so every Megatron group exists and every
   collective runs (the ``all_reduce`` calls of ``tensor_parallel/cross_entropy.py`` run
   even at TP = 1). At t > 1, either over the default group the caller made (world size
   t: one process per rank, ``parallel.launch.run_ranks`` over gloo), or, when there is
   none, over a fake default group of world size t in which this process is TP rank 0
   (``torch.testing._internal.distributed.fake_pg``: collectives return without moving
   data, so one process builds and runs one rank's shards; every TP rank of a
   Megatron-Core GPT holds the same shapes, so rank 0 stands for each). Megatron's extra
   gloo groups (``create_gloo_process_groups``) are not made over a fake group: the
   fake backend cannot make them, and the model's step never uses them.
2. **The RNG tracker** (``tensor_parallel/random.py``). Megatron keeps named states of
   "the CUDA generator" (``CudaRNGStatesTracker``) and reads and writes that generator
   through two module functions, ``_get_cuda_rng_state`` and ``_set_cuda_rng_state``
   (``torch.cuda.get_rng_state`` fails on a CPU build). Here those two functions read and
   write the CPU default generator (``torch.get_rng_state`` / ``torch.set_rng_state``),
   the generator CPU dropout draws from; nothing else of the tracker changes. So
   ``fork()`` switches the CPU generator to the named state around attention dropout and
   back, as it switches the CUDA generator on a GPU, and ``CheckpointFunction`` saves and
   restores the same states (its "CPU" and "CUDA" states are then the same generator,
   restored to the same value): the semantics of Megatron's checkpointing are unchanged.
   The tracker's states are seeded as ``model_parallel_cuda_manual_seed(seed)`` seeds
   them (data-parallel ``seed``, tensor-parallel ``seed + 2718 + tp_rank``, expert
   ``seed + 1024 + 100 * ep_rank + etp_rank``), from CPU generators.
   ``fork()`` logs "CPU RNG state changed within GPU RNG context" whenever dropout drew
   inside it, because the CPU and "CUDA" generators are one here; that one record is
   filtered while the setup is active (a GPU never logs it: its generators are two).
3. **The global memory buffer** (``parallel_state.get_global_memory_buffer()``, the
   preallocated ``baddbmm`` input of ``DotProductAttention`` and the all-gather buffers),
   which Megatron allocates on ``torch.cuda.current_device()``: a ``GlobalMemoryBuffer``
   whose ``get_tensor`` allocates on the CPU, with the same reuse rule.

Tracing the unmodified model needs no help from here: the ``.item()`` in
``CudaRNGStatesTracker.fork`` compares two values known when tracing
(``graph/trace_context.constant_values_mode``), and the ``torch.distributed`` collectives
are traced as functional collectives (``graph/trace_context.functional_collectives``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator

import torch

from ..errors import RematError

_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


@dataclasses.dataclass
class _Setup:
    """What ``setup_megatron_cpu`` started and replaced, to undo it."""

    folder: str | None
    owns_default_group: bool
    tensor_parallel: int
    excepthook: Callable[..., Any]
    groups: list[Any]
    rng_functions: tuple[Callable[..., Any], Callable[..., Any]]
    log_filter: logging.Filter


_SETUP: _Setup | None = None


class _ForkWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _FORK_WARNING


def _cpu_rng_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    return get_state, set_state


def _cpu_memory_buffer() -> Any:
    from megatron.core.utils import GlobalMemoryBuffer
    from torch.utils._python_dispatch import _disable_current_modes

    class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
        """``GlobalMemoryBuffer`` (megatron/core/utils.py) allocating on the CPU, a real
        tensor even when first asked for while tracing (a persistent buffer: the traced
        graph reads it as a constant)."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ANN001
            required = 1
            for d in tensor_shape:
                required *= d
            key = (name, dtype)
            if self.buffer.get(key) is None or self.buffer[key].numel() < required:
                with (mem_alloc_context or contextlib.nullcontext)(), _disable_current_modes():
                    self.buffer[key] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
            return self.buffer[key][0:required].view(*tensor_shape)

    return CPUGlobalMemoryBuffer()


def _seed_tracker(seed: int) -> None:
    """Seed the tracker's three states as ``model_parallel_cuda_manual_seed`` does
    (this process's tensor-parallel rank; expert ranks 0), from CPU generators."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    states = {
        mrandom._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + 2718 + parallel_state.get_tensor_model_parallel_rank(),
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed + 1024,
    }
    tracker.set_states({name: torch.Generator().manual_seed(s).get_state() for name, s in states.items()})
    tracker.seeds_.update(states.values())
    torch.manual_seed(seed)


def setup_megatron_cpu(seed: int = 0, tensor_parallel: int = 1) -> None:
    """Set Megatron-Core up on the CPU (see the module docstring): ``parallel_state``
    with tensor-parallel size ``tensor_parallel`` (over gloo with world size 1 at 1; over
    the caller's default group of that world size, or a fake one in which this process
    is rank 0), the RNG tracker on the CPU generator and seeded, the global memory
    buffer on the CPU. When already set up with the same size, only the seed is reset
    (the tracker and ``torch.manual_seed``); with another size it is torn down first.

    Args:
        seed: Megatron's ``--seed`` (``model_parallel_cuda_manual_seed(seed)``).
        tensor_parallel: Megatron's ``--tensor-model-parallel-size`` t (>= 1).

    Raises:
        ImportError: megatron-core is not installed (``pip install remat-pass[megatron]``).
        RematError: ``tensor_parallel`` < 1, ``torch.distributed`` is already
            initialized with a world size other than ``tensor_parallel``, or Megatron's
            ``parallel_state`` is already initialized by someone else.
    """
    global _SETUP
    import sys

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if tensor_parallel < 1:
        raise RematError(f"setup_megatron_cpu: tensor_parallel must be >= 1, got {tensor_parallel}")
    if _SETUP is not None and _SETUP.tensor_parallel != tensor_parallel:
        teardown_megatron_cpu()
    if _SETUP is not None:
        _seed_tracker(seed)
        return
    if parallel_state.model_parallel_is_initialized():
        raise RematError("Megatron's parallel_state is already initialized; call setup_megatron_cpu before it")
    folder, owns, excepthook = None, not dist.is_initialized(), sys.excepthook
    if owns and tensor_parallel == 1:
        folder = tempfile.mkdtemp(prefix="remat-megatron-")
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}",
                                rank=0, world_size=1)
    elif owns:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tensor_parallel)
    elif dist.get_world_size() != tensor_parallel:
        raise RematError(f"setup_megatron_cpu: tensor-parallel size {tensor_parallel} needs a world of "
                         f"{tensor_parallel} processes; torch.distributed has world size {dist.get_world_size()}")
    before = set(dist.distributed_c10d._world.pg_names)
    parallel_state.initialize_model_parallel(
        tensor_parallel, 1, create_gloo_process_groups=dist.get_backend() != "fake")
    groups = [g for g in dist.distributed_c10d._world.pg_names if g not in before]
    parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer()
    saved = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = _cpu_rng_functions()
    log_filter = _ForkWarningFilter()
    logging.getLogger(mrandom.__name__).addFilter(log_filter)
    _SETUP = _Setup(folder, owns, tensor_parallel, excepthook, groups, saved, log_filter)
    _seed_tracker(seed)


def teardown_megatron_cpu() -> None:
    """Undo ``setup_megatron_cpu``: Megatron's groups and globals destroyed, every
    process group the setup started ended (the default group too when it started it),
    the RNG functions and the log restored, the rendezvous folder removed. Does nothing
    when not set up."""
    global _SETUP
    if _SETUP is None:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    setup, _SETUP = _SETUP, None
    parallel_state.destroy_model_parallel()
    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = setup.rng_functions
    mrandom.initialize_rng_tracker(force_reset=True)
    logging.getLogger(mrandom.__name__).removeFilter(setup.log_filter)
    if setup.owns_default_group:
        dist.destroy_process_group()
        import sys

        sys.excepthook = setup.excepthook  # init_process_group wrapped it to prefix "[rank0]: "
    else:
        for group in setup.groups:
            if group in dist.distributed_c10d._world.pg_names:  # not destroyed by destroy_model_parallel
                dist.destroy_process_group(group)
    if setup.folder is not None:
        shutil.rmtree(setup.folder, ignore_errors=True)


@contextlib.contextmanager
def megatron_cpu(seed: int = 0, tensor_parallel: int = 1) -> Iterator[None]:
    """``setup_megatron_cpu(seed, tensor_parallel)`` for the block, then
    ``teardown_megatron_cpu()``.

    Example:
        >>> import pytest; _ = pytest.importorskip("megatron.core")
        >>> from megatron.core import parallel_state
        >>> with megatron_cpu():
        ...     parallel_state.get_tensor_model_parallel_world_size()
        1
        >>> parallel_state.model_parallel_is_initialized()
        False
    """
    setup_megatron_cpu(seed, tensor_parallel)
    try:
        yield
    finally:
        teardown_megatron_cpu()


def mean_loss(per_token_loss: torch.Tensor) -> torch.Tensor:
    """The scalar loss of ``GPTModel(..., labels=...)``'s per-token losses ``[b, s]``
    (fp32): their mean (Megatron's ``loss_func`` with an all-ones loss mask)."""
    return per_token_loss.float().mean()


def megatron_gpt(
    batch: int = 2,
    seq: int = 32,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 128,
    ffn_hidden: int | None = None,
    dropout: float = 0.1,
    seed: int = 0,
    max_positions: int | None = None,
    tied_embeddings: bool = False,
    tensor_parallel: int = 1,
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """Megatron-Core's ``GPTModel`` with the local layer spec
    (``gpt_layer_specs.get_gpt_layer_local_spec()``: Megatron's own attention, MLP and
    norms, no Transformer Engine), random weights, fp32, train mode, on the CPU, set up by
    ``setup_megatron_cpu(seed)`` (kept until ``teardown_megatron_cpu`` or the end of the
    process).

    Args:
        batch, seq: ``--micro-batch-size``, ``--seq-length`` (token ids ``[batch, seq]``,
            int64; also ``--max-position-embeddings``).
        layers, hidden, heads, vocab: ``--num-layers``, ``--hidden-size``,
            ``--num-attention-heads``, the (padded) vocabulary size.
        ffn_hidden: ``--ffn-hidden-size`` (default ``4 * hidden``).
        dropout: ``--attention-dropout`` and ``--hidden-dropout``.
        seed: ``--seed``: the weights, the token ids and the RNG tracker.
        max_positions: ``--max-position-embeddings`` (default ``seq``; at least ``seq``).
        tied_embeddings: the output layer uses the word embedding's weight
            (``GPTModel(share_embeddings_and_output_weights=True)``, what Megatron-LM's
            ``pretrain_gpt.py`` builds unless ``--untie-embeddings-and-output-weights``);
            default False, ``GPTModel``'s own default.

    Returns:
        ``(model, inputs, mean_loss)``: ``inputs`` holds ``input_ids``,
        ``position_ids`` (``arange(seq)`` per row), ``attention_mask`` (``[1, 1, s, s]``
        bool, True above the diagonal: masked, as Megatron's causal mask) and ``labels``
        (the ids); the model returns per-token losses ``[batch, seq]``, which
        ``mean_loss`` averages.

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: a size is not positive, ``hidden`` is not a multiple of ``heads``, or
            ``tensor_parallel`` does not divide ``heads``, the FFN size or ``vocab``.

    Example:
        >>> import pytest; _ = pytest.importorskip("megatron.core")
        >>> with megatron_cpu():
        ...     model, inputs, loss_fn = megatron_gpt(layers=1, dropout=0.0)
        ...     loss_fn(model(**inputs)).shape, len(model.decoder.layers)
        (torch.Size([]), 1)
    """
    max_positions = _checked_sizes(batch, seq, layers, hidden, heads, vocab, max_positions)
    _check_tensor_parallel(tensor_parallel, heads, ffn_hidden or 4 * hidden, vocab)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if _SETUP is None:
        atexit.register(teardown_megatron_cpu)
    setup_megatron_cpu(seed, tensor_parallel)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn_hidden,
        attention_dropout=dropout, hidden_dropout=dropout, use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=tensor_parallel,
    )
    torch.manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=max_positions,
                     share_embeddings_and_output_weights=tied_embeddings).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    inputs = {
        "input_ids": ids,
        "position_ids": torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous(),
        "attention_mask": torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1),
        "labels": ids.clone(),
    }
    return model, inputs, mean_loss


def _checked_sizes(batch: int, seq: int, layers: int, hidden: int, heads: int, vocab: int,
                   max_positions: int | None) -> int:
    """``max_positions`` (default ``seq``) after checking ``megatron_gpt``'s sizes.

    Raises:
        ValueError: a size is not positive, ``hidden`` is not a multiple of ``heads``, or
            ``max_positions`` is below ``seq``.
    """
    for name, v in (("batch", batch), ("seq", seq), ("layers", layers), ("hidden", hidden),
                    ("heads", heads), ("vocab", vocab)):
        if v < 1:
            raise ValueError(f"megatron_gpt: {name} must be >= 1, got {v}")
    if hidden % heads:
        raise ValueError(f"megatron_gpt: hidden ({hidden}) must be a multiple of heads ({heads})")
    max_positions = seq if max_positions is None else max_positions
    if max_positions < seq:
        raise ValueError(f"megatron_gpt: max_positions ({max_positions}) must be at least seq ({seq})")
    return max_positions


def _check_tensor_parallel(tp: int, heads: int, ffn_hidden: int, vocab: int) -> None:
    """Raise ValueError naming the size when tensor-parallel size ``tp`` is not one
    Megatron-Core can shard ``heads`` attention heads, the FFN and the vocabulary by."""
    if tp < 1:
        raise ValueError(f"megatron_gpt: tensor_parallel must be >= 1, got {tp}")
    for name, v in (("heads (--num-attention-heads)", heads), ("the FFN size (--ffn-hidden-size)", ffn_hidden),
                    ("the padded vocabulary", vocab)):
        if v % tp:
            legal = [d for d in range(1, v + 1) if v % d == 0 and d <= 64]
            raise ValueError(f"megatron_gpt: --tensor-model-parallel-size {tp} does not divide {name} = {v}; "
                             f"legal sizes: {legal}")


def is_megatron_core(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` holds a Megatron-Core ``TransformerBlock`` (its recompute runs
    ``TransformerBlock._checkpointed_forward``)."""
    return model is not None and any(
        type(m).__name__ == "TransformerBlock" and type(m).__module__.startswith("megatron.core")
        for m in model.modules())


def megatron_crashes_on(schedules: Any) -> list[Any]:
    """The ``uniform`` schedules Megatron-Core 0.16.1 itself cannot run: K does not
    divide the layers of a stack (``--num-layers`` per pipeline stage).
    ``TransformerBlock._checkpointed_forward`` (``transformer/transformer_block.py``)
    checkpoints ``custom(i, i + K)`` for ``i = 0, K, 2K, ...`` while ``i < L``, and the last
    chunk asks for layer ``L`` (``custom(6, 9)`` at L = 8: ``IndexError``).

    Args:
        schedules: ``recompute.schedule.Schedule`` values (other values are skipped).

    Example:
        >>> from remat_pass.recompute.schedule import megatron_schedules
        >>> [s.provenance for s in megatron_crashes_on(megatron_schedules(4))]
        ['uniform(K=3)']
    """
    out = []
    for s in schedules:
        if getattr(s, "method", None) != "uniform":
            continue
        sizes = tuple(s.stack_sizes) or (s.num_layers,)
        if any(size % s.recompute_num_layers for size in sizes):
            out.append(s)
    return out


def megatron_note(model: torch.nn.Module | None, schedules: Any) -> str | None:
    """The sweep's note on a Megatron-Core model: the uniform K that Megatron-Core itself
    crashes on (``megatron_crashes_on``); None for another model or when there are none."""
    if not is_megatron_core(model):
        return None
    crashes = megatron_crashes_on(schedules)
    if not crashes:
        return None
    names = ", ".join(s.provenance for s in crashes)
    return (f"note: Megatron-Core itself cannot run {names}: --recompute-method uniform with a "
            "--recompute-num-layers that does not divide the layers per stage raises IndexError in "
            "TransformerBlock._checkpointed_forward (its last chunk goes past the last layer); those rows "
            "are this pass's rewrite only, not a Megatron setting")
