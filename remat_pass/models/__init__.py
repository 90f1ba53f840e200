"""The models the project ships: factories (``shipped``: GPT-2, TinyGPT, a Linear chain,
TinyLlama with its TP plan and pipeline layout), small ``transformers`` families
(``hf_families``) and models from ``transformers`` config files (``configs``).

``remat_pass.models:gpt2`` is the default model spec of the command line and of every
report, so the shipped factories are re-exported here."""

from .shipped import (
    DEFAULT_BATCH,
    DEFAULT_LAYERS,
    DEFAULT_SEQ,
    Attention,
    Block,
    FeedForward,
    PipelineLayout,
    TinyGPT,
    TransformerBlock,
    TransformerLM,
    build,
    gpt2,
    linear_chain,
    load_factory,
    tiny_gpt,
    tiny_llama,
)

__all__ = [
    "DEFAULT_BATCH", "DEFAULT_LAYERS", "DEFAULT_SEQ", "Attention", "Block", "FeedForward",
    "PipelineLayout", "TinyGPT", "TransformerBlock", "TransformerLM", "build", "gpt2",
    "linear_chain", "load_factory", "tiny_gpt", "tiny_llama",
]
