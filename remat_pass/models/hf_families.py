"""Small Hugging Face ``transformers`` models of the common families, random weights.

Each factory builds one family from a small config (no download) in train mode, fp32
on CPU, with dropout 0 (so a sweep checks gradients bitwise), and returns ``(model,
example_inputs, loss_fn)`` like ``models.py``'s factories, so ``remat-pass sweep
--model remat_pass.models.hf_families:t5`` works. ``FAMILIES`` names them all.

Losses: the causal LMs and T5 return ``.loss`` (next-token / target cross entropy from
``labels``); BERT's masked-LM head and ViT's classifier likewise take ``labels``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

Built = tuple[nn.Module, Any, Any]


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _ids(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _causal_lm(config: Any, cls: Any, batch: int, seq: int, seed: int) -> Built:
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).train()
    ids = _ids(batch, seq, config.vocab_size, seed)
    return model, {"input_ids": ids, "labels": ids}, None


def _decoder_config(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, **kw: Any) -> Any:
    t = _transformers()
    return getattr(t, name)(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=max(seq, 16),
        attention_dropout=0.0, tie_word_embeddings=False, **kw,
    )


def llama(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
          vocab: int = 64, seed: int = 0) -> Built:
    """``LlamaForCausalLM`` (RMSNorm, rotary, grouped KV heads: 2 KV heads)."""
    t = _transformers()
    cfg = _decoder_config("LlamaConfig", layers, hidden, heads, vocab, seq, num_key_value_heads=2)
    return _causal_lm(cfg, t.LlamaForCausalLM, batch, seq, seed)


def mistral(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
            vocab: int = 64, seed: int = 0) -> Built:
    """``MistralForCausalLM`` (sliding window 8 < seq, 2 KV heads)."""
    t = _transformers()
    cfg = _decoder_config("MistralConfig", layers, hidden, heads, vocab, seq, num_key_value_heads=2,
                          sliding_window=8)
    return _causal_lm(cfg, t.MistralForCausalLM, batch, seq, seed)


def qwen2(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
          vocab: int = 64, seed: int = 0) -> Built:
    """``Qwen2ForCausalLM`` (biased q/k/v projections, 2 KV heads)."""
    t = _transformers()
    cfg = _decoder_config("Qwen2Config", layers, hidden, heads, vocab, seq, num_key_value_heads=2)
    return _causal_lm(cfg, t.Qwen2ForCausalLM, batch, seq, seed)


def phi3(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
         vocab: int = 64, seed: int = 0) -> Built:
    """``Phi3ForCausalLM`` (fused qkv and gate_up projections)."""
    t = _transformers()
    cfg = _decoder_config("Phi3Config", layers, hidden, heads, vocab, seq, num_key_value_heads=heads,
                          resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0)
    return _causal_lm(cfg, t.Phi3ForCausalLM, batch, seq, seed)


def gpt_neox(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
             vocab: int = 64, seed: int = 0) -> Built:
    """``GPTNeoXForCausalLM`` (parallel attention + MLP residual, partial rotary)."""
    t = _transformers()
    cfg = t.GPTNeoXConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=max(seq, 16),
        attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=False,
    )
    return _causal_lm(cfg, t.GPTNeoXForCausalLM, batch, seq, seed)


def mixtral(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
            vocab: int = 64, experts: int = 4, experts_implementation: str | None = "batched_mm",
            seed: int = 0) -> Built:
    """``MixtralForCausalLM``: sparse MoE layers of ``experts`` experts, top-2 routing.

    Args:
        experts_implementation: transformers' ``config._experts_implementation``
            (``"batched_mm"``, ``"grouped_mm"``, ``"eager"``); None keeps transformers'
            default (``grouped_mm``, which traces only in bf16 on CPU).
    """
    t = _transformers()
    cfg = _decoder_config("MixtralConfig", layers, hidden, heads, vocab, seq, num_key_value_heads=2,
                          num_local_experts=experts, num_experts_per_tok=2, router_aux_loss_coef=0.0)
    if experts_implementation is not None:
        cfg._experts_implementation = experts_implementation
    return _causal_lm(cfg, t.MixtralForCausalLM, batch, seq, seed)


def bert(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
         vocab: int = 64, seed: int = 0) -> Built:
    """``BertForMaskedLM`` (post-LayerNorm encoder, GELU); labels = the ids."""
    t = _transformers()
    cfg = t.BertConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=max(seq, 16),
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = t.BertForMaskedLM(cfg).train()
    ids = _ids(batch, seq, vocab, seed)
    return model, {"input_ids": ids, "labels": ids}, None


def t5(batch: int = 2, seq: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
       vocab: int = 64, decoder_layers: int | None = None, seed: int = 0) -> Built:
    """``T5ForConditionalGeneration``: two layer stacks, ``encoder.block`` (``layers``)
    and ``decoder.block`` (``decoder_layers``, default ``layers``); labels of length
    ``seq`` (the decoder input is the shifted labels)."""
    t = _transformers()
    cfg = t.T5Config(num_layers=layers, num_decoder_layers=decoder_layers, d_model=hidden, d_kv=hidden // heads,
                     d_ff=2 * hidden, num_heads=heads, vocab_size=vocab, dropout_rate=0.0,
                     decoder_start_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = t.T5ForConditionalGeneration(cfg).train()
    ids = _ids(batch, seq, vocab, seed)
    labels = _ids(batch, seq, vocab, seed + 1)
    return model, {"input_ids": ids, "labels": labels}, None


def vit(batch: int = 2, image: int = 16, layers: int = 3, hidden: int = 32, heads: int = 4,
        classes: int = 10, seed: int = 0) -> Built:
    """``ViTForImageClassification`` on ``image``x``image`` RGB images, patches of 4."""
    t = _transformers()
    cfg = t.ViTConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_attention_heads=heads, image_size=image, patch_size=4, num_labels=classes,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = t.ViTForImageClassification(cfg).train()
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, image, image, generator=g)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return model, {"pixel_values": pixels, "labels": labels}, None


FAMILIES: dict[str, Callable[..., Built]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "gpt_neox": gpt_neox, "phi3": phi3,
    "mixtral": mixtral, "bert": bert, "t5": t5, "vit": vit,
}
"""Family name -> factory, in the order of the issue's list."""
