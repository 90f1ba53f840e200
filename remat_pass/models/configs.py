"""Models from configuration files, and models without weights (meta device).

``--config PATH`` takes a ``transformers`` config JSON (``model_type`` plus fields, as
the ``config.json`` of any model repository) and builds the model with
``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` / ``AutoModelForSeq2SeqLM`` /
``AutoModel`` (the task: ``--task``, or read off the config's ``architectures``, or the
first of those the model type supports), in the dtype asked for, with random weights or
on the meta device (no memory: predicted only). Everything that can be wrong with the
input is checked here, before anything long starts: the file, ``model_type``, the shape
fields (present and consistent), the sequence against the model's positions, the task,
the dtype. Every error names the field and what is allowed.

The example batch of a config model is token ids ``[batch, seq]`` (int64) with
``labels = input_ids`` (the model computes its own loss: shifted next-token for causal
LMs, per-token for masked LMs, decoder cross entropy for seq2seq). The ``base`` task
(``AutoModel``) has no loss; the mean square of the last hidden state stands in for a
head (its memory differs from a real head's).

A factory (``--model module:factory``) runs under ``torch.device("meta")`` with
``meta=True``; a factory that reads tensor values while building fails with the op named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import RematError
from .shipped import build
from ..graph.layer_alike import first_unlike, module_evidence
from ..graph.regions import find_layer_stacks

TASKS = ("causal-lm", "masked-lm", "seq2seq-lm", "base")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the fields every config must give (names as transformers' attribute_map resolves them)
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_ARCHITECTURE_TASKS = (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                       ("ForConditionalGeneration", "seq2seq-lm"), ("Model", "base"))


class ConfigError(RematError, ValueError):
    """A config file, field, task, dtype or sequence length that cannot be used; the
    message names it and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to build a model and its batch (frozen).

    Attributes:
        task: one of ``TASKS``.
        dtype: parameter (and activation) dtype name, a key of ``DTYPES``.
        meta: build on the meta device (no weights, predicted only).
        batch, seq: the example batch shape.
        seed: seeds random weights and token ids.
        layers: override the config's number of layers (None: keep it).
    """

    task: str
    dtype: str = "float32"
    meta: bool = False
    batch: int = 1
    seq: int = 128
    seed: int = 0
    layers: int | None = None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16``, ``float16``).

    Raises:
        ConfigError: another name.
    """
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("--config needs transformers: pip install transformers") from e
    transformers.logging.set_verbosity_error()
    return transformers


def load_config(path: str | Path) -> Any:
    """Read and check a ``transformers`` config JSON.

    Returns:
        The ``PretrainedConfig`` (``AutoConfig.for_model(model_type, **fields)``).

    Raises:
        OSError: the file cannot be read.
        ConfigError: not JSON, not an object, no or an unknown ``model_type``, a shape
            field missing, not a positive integer, or inconsistent (heads not dividing
            the hidden size, key/value heads not dividing the heads).
    """
    transformers = _transformers()
    text = Path(path).read_text(encoding="utf-8")
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{path}: a config is a JSON object with model_type and fields, not {type(fields).__name__}")
    model_type = fields.pop("model_type", None)
    known = list(transformers.CONFIG_MAPPING.keys())
    if not isinstance(model_type, str):
        raise ConfigError(f"{path}: field model_type is missing; it names the architecture (llama, gpt2, bert, t5, ...)")
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (see transformers.CONFIG_MAPPING)"
        raise ConfigError(f"{path}: model_type {model_type!r} is not a transformers model type{hint}")
    config_class = transformers.CONFIG_MAPPING[model_type]
    aliases = dict(getattr(config_class, "attribute_map", {}))
    shape = {}
    for name in SHAPE_FIELDS:
        given = [n for n in (name, aliases.get(name)) if n and n in fields]
        if not given:
            alias = f" (or {aliases[name]})" if name in aliases else ""
            raise ConfigError(f"{path}: field {name}{alias} is missing; a {model_type} config must give "
                              f"{', '.join(SHAPE_FIELDS)}")
        value = fields[given[0]]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{path}: field {given[0]} is {value!r}; it must be a positive integer")
        shape[name] = value
    if "head_dim" not in fields and "d_kv" not in fields:
        # before transformers sees it: some versions refuse this in their own words, others not at all
        _check_heads(shape["hidden_size"], shape["num_attention_heads"], str(path))
    fields.pop("transformers_version", None)
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, _strict_validation_error()) as e:
        raise ConfigError(f"{path}: transformers rejects the config: {' '.join(str(e).split())}") from e
    check_config(config, str(path))
    return config


def _strict_validation_error() -> type[Exception]:
    """The error ``huggingface_hub``'s strict dataclasses raise when a transformers
    config fails its own validators (transformers 5); ValueError where it is absent."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ValueError
    return StrictDataclassError


def _check_heads(hidden: int, heads: int, where: str) -> None:
    if hidden % heads:
        raise ConfigError(f"{where}: num_attention_heads ({heads}) does not divide hidden_size ({hidden}); "
                          "give a hidden size that is a multiple of the heads, or an explicit head_dim")


def check_config(config: Any, where: str = "config") -> None:
    """The shape fields agree with each other.

    Raises:
        ConfigError: the heads do not divide the hidden size (when no explicit
            ``head_dim`` or ``d_kv`` is given), or the key/value heads do not divide the heads.
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    # T5 / mT5 / UMT5 give each head's size as d_kv: their heads need not divide d_model
    explicit_head_dim = ("head_dim" in config.to_diff_dict() and config.model_type != "t5") or hasattr(config, "d_kv")
    if not explicit_head_dim:
        _check_heads(hidden, heads, where)
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and (not isinstance(kv, int) or kv < 1 or heads % kv):
        raise ConfigError(f"{where}: num_key_value_heads ({kv}) must be a positive divisor of "
                          f"num_attention_heads ({heads})")


def tasks_of(config: Any) -> list[str]:
    """The tasks the model type supports, in the order they are preferred."""
    from transformers.models.auto import modeling_auto as auto

    mappings = (("causal-lm", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                ("seq2seq-lm", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                ("masked-lm", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES), ("base", auto.MODEL_MAPPING_NAMES))
    return [task for task, names in mappings if config.model_type in names]


def default_task(config: Any) -> str:
    """The config's task: from ``architectures`` (``LlamaForCausalLM`` -> causal-lm),
    else the first task the model type supports.

    Raises:
        ConfigError: the model type supports none of ``TASKS``.
    """
    supported = tasks_of(config)
    for arch in getattr(config, "architectures", None) or []:
        for suffix, task in _ARCHITECTURE_TASKS:
            if arch.endswith(suffix) and task in supported:
                return task
    if not supported:
        raise ConfigError(f"model_type {config.model_type!r} has no causal-lm, seq2seq-lm, masked-lm or base "
                          "model in transformers")
    return supported[0]


def check_spec(config: Any, spec: ModelSpec) -> None:
    """The spec fits the config (before anything is built).

    Raises:
        ConfigError: unknown task or one the model type lacks, unknown dtype, a
            sequence longer than ``max_position_embeddings`` (or its alias), a batch or
            sequence below 1, or ``layers`` below 1.
    """
    if spec.task not in TASKS:
        raise ConfigError(f"task {spec.task!r} is not one of {', '.join(TASKS)}")
    supported = tasks_of(config)
    if spec.task not in supported:
        raise ConfigError(f"model_type {config.model_type!r} has no {spec.task} model; it supports "
                          f"{', '.join(supported) or 'none of ' + ', '.join(TASKS)}")
    dtype_of(spec.dtype)
    if spec.batch < 1 or spec.seq < 1 or (spec.layers is not None and spec.layers < 1):
        raise ConfigError(f"batch ({spec.batch}), seq ({spec.seq}) and layers ({spec.layers}) must be 1 or more")
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and spec.seq > limit:
        name = dict(getattr(type(config), "attribute_map", {})).get("max_position_embeddings",
                                                                      "max_position_embeddings")
        raise ConfigError(f"seq {spec.seq} is longer than the model's positions: {name} = {limit}; "
                          f"use --seq {limit} or less, or a config with more positions")


def _auto_class(task: str) -> Any:
    transformers = _transformers()
    return {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM, "base": transformers.AutoModel}[task]


def parameter_bytes(config: Any, spec: ModelSpec) -> int:
    """Bytes of the model's parameters in ``spec.dtype`` (built on the meta device)."""
    model = _instantiate(config, dataclasses.replace(spec, meta=True))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _instantiate(config: Any, spec: ModelSpec) -> nn.Module:
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's stays as it was
    if spec.layers is not None:
        config.num_hidden_layers = spec.layers
        if getattr(config, "num_decoder_layers", None) is not None:
            config.num_decoder_layers = spec.layers
    context = torch.device("meta") if spec.meta else contextlib.nullcontext()
    torch.manual_seed(spec.seed)
    with context:
        return _auto_class(spec.task).from_config(config, dtype=dtype_of(spec.dtype)).train()


def example_batch(config: Any, spec: ModelSpec) -> tuple[dict[str, torch.Tensor], Callable[[Any], torch.Tensor] | None]:
    """``({"input_ids", "labels"}, loss_fn)`` for the task (meta tensors when
    ``spec.meta``: their values are never read)."""
    shape = (spec.batch, spec.seq)
    if spec.meta:
        ids = torch.empty(shape, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(spec.seed))
    if spec.task != "base":
        return {"input_ids": ids, "labels": ids}, None
    inputs = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs, lambda out: out.last_hidden_state.float().square().mean()


def build_from_config(config: Any, spec: ModelSpec) -> tuple[nn.Module, dict[str, torch.Tensor], Any]:
    """``(model, example_inputs, loss_fn)`` of ``config`` as ``spec`` says, in train mode.

    Raises:
        ConfigError: see ``check_spec``.
    """
    check_spec(config, spec)
    model = _instantiate(config, spec)
    inputs, loss_fn = example_batch(config, spec)
    return model, inputs, loss_fn


def build_factory(spec: str, meta: bool = False, dtype: str | None = None, **kwargs: Any) -> tuple[nn.Module, Any, Any]:
    """``models.build(spec, **kwargs)``, on the meta device when ``meta`` and converted
    to ``dtype`` (floating parameters, buffers and inputs) when given.

    Raises:
        ConfigError: the factory reads tensor values while building on the meta device
            (the op is named), or an unknown dtype.
        ValueError, ImportError: as ``models.build``.
    """
    target = dtype_of(dtype) if dtype else None
    if not meta:
        model, inputs, loss_fn = build(spec, **kwargs)
    else:
        try:
            with torch.device("meta"):
                model, inputs, loss_fn = build(spec, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            raise ConfigError(f"factory {spec} cannot build on the meta device (--meta): it reads tensor "
                              f"values while building ({type(e).__name__}: {str(e).splitlines()[0]}); build it "
                              "without --meta, or make the factory shape-only") from e
    if target is not None:
        model = model.to(target)
        inputs = _cast_floating(inputs, target)
    return model, inputs, loss_fn


def differing_layer(config: Any, spec: ModelSpec) -> str | None:
    """Why the layers of ``config``'s model are not all alike, or None when they are, by
    the one rule of ``graph.layer_alike.first_unlike`` (the attribute that numbers the
    layers left out): a per-layer list of the config (one entry a layer) whose entries
    differ, which the model's forward may read without any module showing it (Llama 4's
    ``layer_types`` picks each layer's mask); else the first layer whose modules
    (``layer_alike.module_evidence``, built on the meta device) differ from layer 0's in
    any stack of the model, and the first attribute that differs (classes first, then the
    outermost). A sliding-window pattern (Gemma 3's five sliding layers and one full one,
    Qwen2's ``max_window_layers``) or MoE layers every other layer show here.

    Raises:
        ConfigError: see ``check_spec``.
    """
    check_spec(config, spec)
    num_layers = config.num_hidden_layers
    per_layer = {key: value for key, value in sorted(config.to_dict().items())
                 if isinstance(value, (list, tuple)) and len(value) == num_layers > 1}
    unlike = first_unlike([{key: value[i] for key, value in per_layer.items()} for i in range(num_layers)])
    if unlike is not None:
        i, key = unlike
        value = per_layer[key]
        return f"layer {i} differs from layer 0 in the config ({key}[{i}] = {value[i]!r}, not {value[0]!r})"
    model = _instantiate(config, dataclasses.replace(spec, meta=True))
    modules = dict(model.named_modules())
    for path, kids in find_layer_stacks(model):
        sigs = [module_evidence(modules[f"{path}.{kid}"]) for kid in kids]
        unlike = first_unlike(sigs, order=lambda k: (not k.endswith(":class"), k.count("."), k))
        if unlike is not None:
            i, key = unlike
            return f"layer {i} of {path} differs from layer 0 ({key}: {sigs[i].get(key)!r}, not {sigs[0].get(key)!r})"
    return None


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _cast_floating(v, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    return x


def with_autocast(model: nn.Module, device_type: str, dtype: str) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(device_type, dtype)`` (mixed
    precision: parameters stay as they are, matmuls run in ``dtype``). The module keeps
    its paths (its ``forward`` is wrapped in place).

    Raises:
        ConfigError: ``dtype`` is not bfloat16 or float16.
    """
    if dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"--autocast {dtype!r}: autocast runs in bfloat16 or float16")
    inner = model.forward
    low = dtype_of(dtype)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=low):
            return inner(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    return model


def available_memory_bytes() -> int | None:
    """This machine's available memory in bytes (``/proc/meminfo`` MemAvailable), or
    None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fits_in_memory(nbytes: int, fraction: float = 0.5) -> bool:
    """Whether ``nbytes`` is under ``fraction`` of this machine's available memory
    (``available_memory_bytes``; True where it cannot be read)."""
    available = available_memory_bytes()
    return available is None or nbytes <= fraction * available


def describe(config: Any) -> str:
    """``llama: hidden 4096, 32 layers, 32 heads, vocab 32000``."""
    return (f"{config.model_type}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
            f"{config.num_attention_heads} heads, vocab {config.vocab_size}")


def gib(nbytes: int) -> str:
    """Bytes as GiB with two decimals."""
    return f"{nbytes / 2**30:.2f} GiB" if math.isfinite(nbytes) else str(nbytes)
