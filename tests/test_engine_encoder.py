"""all-MiniLM-L6-v2 as a separate encoder in the same step loop equals sentence-transformers."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams
from tests.conftest import MINILM, SMOL, engine_overrides

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

TEXTS = ["The cat sits outside.", "A man is playing guitar.",
         " ".join(["Retrieval-augmented generation answers questions from documents."] * 10), "ok"]


@pytest.fixture(scope="module")
def encoder_engine():
    return Engine.from_pretrained(SMOL, embedding_model=MINILM, **engine_overrides())


def test_minilm_equals_sentence_transformers(encoder_engine):
    from sentence_transformers import SentenceTransformer

    from orthrus_rag.models.registry import resolve_model_path

    st = SentenceTransformer(str(resolve_model_path(MINILM)), device="cpu")
    want = torch.tensor(st.encode(TEXTS))
    outs = encoder_engine.embed(TEXTS)
    got = torch.stack([o.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() >= 0.99999, cos


def test_encoder_shares_steps_with_generation(encoder_engine):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    solo = encoder_engine.embed(TEXTS)
    start = encoder_engine.num_steps
    gens, embs = encoder_engine.run(prompts=["Tell me about cats:"] * 2, sampling_params=sp, texts=TEXTS * 4)
    steps = [s for s in encoder_engine.step_stats if s.step >= start]
    assert any(s.num_encoder_tokens and (s.num_decode_tokens or s.num_prefill_tokens) for s in steps)
    for a, b in zip(solo, embs):
        assert torch.allclose(a.embedding, b.embedding, atol=1e-5)
    assert all(len(g.token_ids) == 8 for g in gens)


def test_encoder_rejects_too_long_input(encoder_engine):
    with pytest.raises(ValueError, match="more than the embedding model's maximum"):
        encoder_engine.add_embed("word " * 600)


def test_backbone_embedding_still_available_by_adapter_name(encoder_engine):
    with pytest.raises(ValueError, match="unknown adapter"):
        encoder_engine.add_embed("x", PoolingParams(adapter="missing"))


def test_truncate_cuts_long_inputs_like_sentence_transformers(encoder_engine):
    from sentence_transformers import SentenceTransformer

    from orthrus_rag.models.registry import resolve_model_path

    text = " ".join(f"word{i}" for i in range(400))
    st = SentenceTransformer(str(resolve_model_path(MINILM)), device="cpu")
    want = torch.tensor(st.encode([text]))[0]
    out = encoder_engine.embed([text], PoolingParams(pooling="mean", normalize=True, truncate=True))[0]
    assert len(out.prompt_token_ids) == 256
    assert torch.nn.functional.cosine_similarity(out.embedding, want, dim=0) >= 0.99999
