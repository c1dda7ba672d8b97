"""Configs a decoder does not implement are refused with a message, never run as something else."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3Config, Gemma3TextConfig, Qwen3Config

from orthrus_rag.models.gemma3 import Gemma3CausalLM
from orthrus_rag.models.llama import CausalLM
from orthrus_rag.models.loader import decoder_class

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=64)


def test_dispatch_by_model_type() -> None:
    assert decoder_class(Gemma3TextConfig(**_TINY)) is Gemma3CausalLM
    assert decoder_class(Qwen3Config(**_TINY)) is CausalLM
    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        decoder_class(Gemma3Config(text_config=_TINY))


@pytest.mark.parametrize("extra,match", [({"attn_logit_softcapping": 50.0}, "soft-capping"),
                                         ({"use_bidirectional_attention": True}, "bidirectional")])
def test_gemma3_features_not_implemented_are_refused(extra: dict, match: str) -> None:
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        Gemma3CausalLM(Gemma3TextConfig(**_TINY, **extra))
