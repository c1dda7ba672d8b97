"""Bad input raises a ValueError naming the problem, and requests already in flight finish unharmed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_bad_inputs_do_not_harm_requests_in_flight(engine):
    prompts = ["The first prompt in flight", "A second one, a little longer than the first"]
    texts = ["an embedding in flight " * 8]
    want_gen = [o.token_ids for o in engine.generate(prompts, SP)]
    want_emb = engine.embed(texts)[0].embedding

    ids = [engine.add_generate(p, SP) for p in prompts] + [engine.add_embed(texts[0])]
    results = {o.request_id: o for _ in range(2) for o in engine.step()}
    vocab = engine.runner.model.config.vocab_size
    cases = [
        (lambda: engine.add_embed(""), "embedding input is empty"),
        (lambda: engine.add_generate("   "), "prompt is empty"),
        (lambda: engine.add_generate([]), "prompt is empty"),
        (lambda: engine.add_generate([1, vocab + 5]), "outside the vocabulary"),
        (lambda: engine.add_embed([-1, 3]), "outside the vocabulary"),
        (lambda: engine.add_generate(list(range(100, 100 + 9000))), "more than the model's maximum"),
        (lambda: engine.add_embed("x", PoolingParams(pooling="max")), "unknown pooling type 'max'"),
        (lambda: engine.add_embed("x", PoolingParams(adapter="e5")), "unknown adapter 'e5'"),
        (lambda: engine.add_embed("a b c", PoolingParams(pooling="weighted_mean", weights=[1.0])), "weights"),
        (lambda: engine.add_generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: engine.add_generate("hi", SamplingParams(top_p=0.0)), "top_p"),
        (lambda: engine.add_generate(123), "must be a string or a list of token ids"),
        (lambda: engine.generate(["fine", ""], SP), "prompt is empty"),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    results.update(engine.run_until_done())
    assert [results[i].token_ids for i in ids[:2]] == want_gen
    assert torch.allclose(results[ids[2]].embedding, want_emb, atol=1e-5)


def test_too_long_for_kv_cache(engine):
    small = Engine(replace(engine.config, cache=replace(engine.config.cache, num_blocks=4)), engine.runner.model,
                   engine.tokenizer)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        small.add_generate(list(range(100, 200)))


def test_abort_frees_blocks(engine):
    rid = engine.add_generate("A long prompt " * 20, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(rid)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.abort(rid)


def test_preempted_request_gives_the_same_greedy_output(engine):
    prompts = [f"Story number {i}: once upon a time, in a land far away, there lived" for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompts, sp)]
    # 10 blocks of 16 tokens cannot hold four 20-token prompts growing by 24 tokens each: preemption
    small = Engine(replace(engine.config, cache=replace(engine.config.cache, num_blocks=10)), engine.runner.model,
                   engine.tokenizer)
    got = small.generate(prompts, sp)
    assert sum(s.num_preempted for s in small.step_stats) > 0
    assert [o.token_ids for o in got] == want
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_a_failing_pooling_head_fails_only_its_request(engine):
    def bad_head(hidden):
        raise ArithmeticError("head exploded")

    good = engine.add_embed("a fine request", PoolingParams(pooling="mean"))
    bad = engine.add_embed("a doomed request", PoolingParams(pooling="all", head=bad_head))
    gen = engine.add_generate("Hello", SP)
    results = engine.run_until_done()
    assert results[bad].finish_reason == "error" and "head exploded" in results[bad].error
    assert results[good].error is None and results[good].embedding.shape == (576,)
    assert len(results[gen].token_ids) == SP.max_tokens
    with pytest.raises(RuntimeError, match="head exploded"):
        engine.embed(["again"], PoolingParams(pooling="all", head=bad_head))


def test_generation_stops_at_the_kv_cache_limit(engine):
    small = Engine(replace(engine.config, cache=replace(engine.config.cache, num_blocks=3)), engine.runner.model,
                   engine.tokenizer)
    out = small.generate([list(range(100, 140))], SamplingParams(max_tokens=100, temperature=0.0,
                                                                 ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 48  # 3 blocks of 16 tokens
    assert small.block_manager.num_free_blocks == 3
