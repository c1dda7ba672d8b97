"""Qwen3-Embedding-style last-token pooling: the engine formats queries with the instruction, appends the
model's end token (not the tokenizer's EOS) exactly once, and returns that token's final hidden state."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag import PoolingParams
from orthrus_rag.embedding_formats import QWEN3_EMBEDDING_END, e5_mistral_params, qwen3_embedding_params


def test_qwen3_query_and_document_format(engine, smol_tokenizer, hf_smol):
    # NOTE: SmolLM2's vocabulary has "<|endoftext|>" and an EOS that differs from it, as Qwen3's tokenizer does
    end = smol_tokenizer.convert_tokens_to_ids(QWEN3_EMBEDDING_END)
    assert end != smol_tokenizer.eos_token_id
    query, doc = qwen3_embedding_params(query=True, task="Find the film"), qwen3_embedding_params(query=False)
    q_out, d_out = engine.embed(["who directed Blue Lagoon"], query)[0], engine.embed(["A film."], doc)[0]
    want_q = smol_tokenizer("Instruct: Find the film\nQuery:who directed Blue Lagoon")["input_ids"] + [end]
    assert q_out.prompt_token_ids == want_q
    assert d_out.prompt_token_ids == smol_tokenizer("A film.")["input_ids"] + [end]
    with torch.inference_mode():
        hidden = hf_smol.model(torch.tensor([want_q])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(hidden, dim=-1)
    assert torch.nn.functional.cosine_similarity(q_out.embedding, want, dim=0) > 0.99999
    assert q_out.embedding.norm().item() == pytest.approx(1.0, abs=1e-5)


def test_end_token_not_doubled_and_checked(engine, smol_tokenizer):
    """Newer Qwen3-Embedding tokenizers append "<|endoftext|>" themselves: an input ending with it keeps one."""
    end = smol_tokenizer.convert_tokens_to_ids(QWEN3_EMBEDDING_END)
    ids = smol_tokenizer("A film.")["input_ids"] + [end]
    (out,) = engine.embed([ids], qwen3_embedding_params(query=False))
    assert out.prompt_token_ids == ids
    with pytest.raises(ValueError, match="not one token"):
        engine.embed(["A film."], PoolingParams(pooling="last", end_token="not a special token"))
    with pytest.raises(ValueError, match="needs append_eos"):
        PoolingParams(pooling="mean", end_token=QWEN3_EMBEDDING_END)


def test_e5_mistral_query_format(engine, smol_tokenizer):
    (out,) = engine.embed(["who directed Blue Lagoon"], e5_mistral_params(query=True, task="Find the film"))
    want = smol_tokenizer("Instruct: Find the film\nQuery: who directed Blue Lagoon")["input_ids"]
    assert out.prompt_token_ids == want + [smol_tokenizer.eos_token_id]
