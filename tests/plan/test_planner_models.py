"""The planner on the models issue 25 named, at small configs: the least feasible peak
is at or below every Megatron setting's predicted peak, and plans at five budgets fit,
are measured exactly, never rise as the budget falls and never cost more than the best
named schedule that fits (``test_multi_stack.check_plans_against_named_schedules``), at
layer and op level.

- a ConvNeXt (torchvision's layout: three stages, three layer stacks): its least
  feasible peak was claimed as none's while uniform(K=1) measured lower;
- Whisper (an encoder and a decoder stack): the same;
- Gemma 2: at op level, a budget the layer level met was refused;
- TinyGPT: PyTorch's partitioner measured a step below the op level's least feasible.
"""

from __future__ import annotations

import pytest
import torch

from conv_models import convnext_like
from remat_pass.evaluate.session import Session
from remat_pass.models import tiny_gpt
from remat_pass.plan.op_planner import OpPlanner
from remat_pass.plan.planner import Planner
from tests.plan.test_multi_stack import check_plans_against_named_schedules

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _whisper():
    t = pytest.importorskip("transformers")
    cfg = t.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                          max_source_positions=8, max_target_positions=16, vocab_size=64, dropout=0.0,
                          attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                          decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = t.WhisperForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 8, 16, generator=g)
    labels = torch.randint(3, 64, (2, 6), generator=g)
    return model, {"input_features": features, "labels": labels}, None


def _gemma2():
    t = pytest.importorskip("transformers")
    cfg = t.Gemma2Config(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=32,
                         sliding_window=8, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = t.Gemma2ForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, None


def _tiny_gpt():
    return tiny_gpt(batch=2, seq=16, layers=3, hidden=32, heads=4, vocab=64, dropout=0.0)


MODELS = {"convnext_like": convnext_like, "whisper": _whisper, "gemma2": _gemma2, "tiny_gpt": _tiny_gpt}


@pytest.fixture(scope="module", params=sorted(MODELS))
def session(request, one_thread) -> Session:
    return Session.create(*MODELS[request.param]())


@pytest.mark.parametrize("level", ["layer", "op"])
def test_plans_against_every_named_schedule(session, level):
    planner = (Planner if level == "layer" else OpPlanner)(session.joint, session.stack, session.report)
    check_plans_against_named_schedules(session, planner, level)
