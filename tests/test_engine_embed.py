"""Chunked embeddings through the shared backbone equal whole-sequence pooling, alone or mixed with
generation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams
from orthrus_rag.layers.pooler import pool_whole

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

POOLINGS = ["mean", "weighted_mean", "cls", "first", "last", "all"]


def _long_ids(tokenizer, n: int) -> list[int]:
    text = " ".join(f"Paragraph {i} talks about rivers, films and the people who made them." for i in range(200))
    ids = tokenizer(text)["input_ids"][:n]
    assert len(ids) == n
    return ids


@pytest.fixture(scope="module")
def reference(hf_smol, smol_tokenizer):
    """Final hidden states of the whole 1,024-token sequence from transformers (an independent forward)."""
    ids = _long_ids(smol_tokenizer, 1024)
    with torch.inference_mode():
        hidden = hf_smol.model(torch.tensor([ids])).last_hidden_state[0]
    return ids, hidden


def _compare(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() >= 0.99999, f"min cosine {cos.min():.7f}"
    assert (got - want).abs().max() <= 1e-4, f"max abs diff {(got - want).abs().max():.2e}"


# the small chunks on shorter prefixes (still dozens of chunks each, across KV blocks of 16: 7 straddles them, 16
# fills them), the large ones on the whole 1,024 tokens
@pytest.mark.parametrize("chunk,length", [(1, 100), (7, 300), (16, 300), (64, 1024), (256, 1024)])
def test_chunked_equals_whole_for_every_pooler(chunk, length, reference, smol_engine):
    ids, hidden = reference
    # the shared model, a fresh engine (own cache) whose chunks are `chunk` tokens
    config = replace(smol_engine.config, scheduler=replace(smol_engine.config.scheduler, max_chunk_tokens=chunk,
                                                           max_num_batched_tokens=512))
    engine = Engine(config, smol_engine.runner.model, smol_engine.tokenizer)
    params = {p: PoolingParams(pooling=p, append_eos=False) for p in POOLINGS}
    req_ids = {p: engine.add_embed(ids[:length], params[p]) for p in POOLINGS}
    results = engine.run_until_done()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for p in POOLINGS:
        want = pool_whole(hidden[:length], params[p])
        _compare(results[req_ids[p]].embedding, want)


def test_embeddings_in_mixed_steps_equal_solo(engine, smol_tokenizer):
    texts = [" ".join(["Rivers carry water to the sea."] * k) for k in (1, 5, 12, 30)]
    params = PoolingParams(pooling="mean")
    solo = [o.embedding for o in engine.embed(texts, params)]
    prompts = ["Write a haiku about rivers:", "The longest river in Africa is"]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    gen_solo = [o.token_ids for o in engine.generate(prompts, sp)]
    start = engine.num_steps
    gens, embs = engine.run(prompts=prompts, sampling_params=sp, texts=texts, pooling_params=params)
    mixed_steps = [s for s in list(engine.step_stats) if s.step >= start]
    assert any(s.num_embed_tokens and s.num_decode_tokens for s in mixed_steps), "no step mixed embed + decode"
    assert any(s.num_embed_tokens and s.num_prefill_tokens for s in mixed_steps), "no step mixed embed + prefill"
    for a, b in zip(solo, embs):
        _compare(b.embedding, a)
        assert torch.allclose(b.embedding, a, atol=1e-5)
    assert [g.token_ids for g in gens] == gen_solo


def test_single_chunk_embedding_needs_no_blocks(engine):
    rid = engine.add_embed("A short sentence.", PoolingParams())
    sched = engine.scheduler.schedule()
    assert [s.req.req_id for s in sched.scheduled] == [rid]
    assert sched.scheduled[0].req.block_table == []
    done = engine.scheduler.update_from_output(sched, engine.runner.execute(sched), 0.0)
    assert [r.req_id for r in done.finished] == [rid] and done.embeddings[rid].shape == (576,)
    assert rid not in engine.scheduler.requests  # the scheduler, the one registry, let it go


def test_instruction_prefix_and_eos(engine, smol_tokenizer):
    plain = engine.embed(["what is a river"], PoolingParams(pooling="last"))[0]
    assert plain.prompt_token_ids[-1] == smol_tokenizer.eos_token_id  # `last` appends EOS (e5-mistral style)
    inst = engine.embed(["what is a river"], PoolingParams(pooling="last", instruction="query: "))[0]
    assert inst.prompt_token_ids[: len(smol_tokenizer("query: ")["input_ids"]) - 1] != []
    assert len(inst.prompt_token_ids) > len(plain.prompt_token_ids)
    assert not torch.allclose(inst.embedding, plain.embedding)
