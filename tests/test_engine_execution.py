"""What the runner actually executes, and embeddings interrupted mid-chunk.

The scheduler's intent (what `Engine.step` plans, `planned_stats`) is not enough: these tests count the decoder forwards and
the rows each one carried, and check that an embedding preempted or aborted between its chunks gives the same
vector or frees every block, in the sync engine and behind the async one.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams
from orthrus_rag.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

LONG_TEXT = " ".join(f"Paragraph {i} describes a river, a mill and a town on the coast." for i in range(8))
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_each_step_runs_one_decoder_forward_carrying_both_kinds(engine):
    forwards: list[int] = []  # rows of each decoder forward
    executed = []
    hook = engine.runner.model.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape[0]))
    execute = engine.runner.execute

    def spy(sched):
        result = execute(sched)
        executed.append((sched, result, len(forwards)))
        return result

    engine.runner.execute = spy
    try:
        engine.run(prompts=["The river runs", "Once upon a time"], sampling_params=SP,
                   texts=[LONG_TEXT, "a short passage", "another passage about mills"],
                   pooling_params=PoolingParams())
    finally:
        hook.remove()
        del engine.runner.execute
    assert executed and forwards
    seen = 0
    for sched, result, num_forwards in executed:
        assert result.num_decoder_forwards == 1 == num_forwards - seen  # one forward per step, no more
        assert forwards[num_forwards - 1] == result.num_embed_rows + result.num_generate_rows
        assert forwards[num_forwards - 1] == sum(s.num_new_tokens for s in sched.scheduled)
        seen = num_forwards
    both = [r for _, r, _ in executed if r.num_embed_rows and r.num_generate_rows]
    assert both, "no executed forward carried embedding and generation rows together"


def _small(engine: Engine, num_blocks: int) -> Engine:
    return Engine(replace(engine.config, cache=replace(engine.config.cache, num_blocks=num_blocks)),
                  engine.runner.model, engine.tokenizer)


def test_embedding_preempted_between_chunks_gives_the_same_vector(engine):
    params = PoolingParams(pooling="mean")
    want = engine.embed([LONG_TEXT], params)[0].embedding
    small = _small(engine, 9)  # 144 KV slots: two growing generations and a chunked embedding do not all fit
    gens = [small.add_generate(f"Story {i}: in a land far away there lived a", SamplingParams(
        max_tokens=48, temperature=0.0, ignore_eos=True)) for i in range(2)]
    small.step()  # the generations run first, so the embedding is the newest request: the one preempted
    rid = small.add_embed(LONG_TEXT, params)
    req = small.scheduler.requests[rid]
    assert req.num_tokens > 2 * small.config.scheduler.max_chunk_tokens  # several chunks, KV between them
    results = small.run_until_done()
    assert req.num_preemptions > 0, "the embedding was never preempted: the test lost its point"
    torch.testing.assert_close(results[rid].embedding, want, atol=1e-5, rtol=1e-5)
    assert all(len(results[g].token_ids) == 48 for g in gens)
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_embedding_aborted_between_chunks_frees_its_blocks(engine):
    rid = engine.add_embed(LONG_TEXT, PoolingParams())
    gen = engine.add_generate("The capital of France is", SP)
    engine.step()
    req = engine.scheduler.requests[rid]
    assert 0 < req.num_computed_tokens < req.num_tokens and req.block_table  # mid-way, holding KV
    assert engine.abort(rid)
    assert req.block_table == [] and rid not in engine.scheduler.requests
    out = engine.run_until_done()
    assert len(out[gen].token_ids) == SP.max_tokens and rid not in out


def test_cancelled_embed_many_aborts_every_sibling_mid_chunk(engine):
    async def main() -> None:
        async with AsyncEngine(engine) as aeng:
            task = asyncio.ensure_future(aeng.embed_many([LONG_TEXT, LONG_TEXT + " again", "short"]))
            deadline = asyncio.get_running_loop().time() + 30
            while not any(0 < r.num_computed_tokens < r.num_tokens for r in list(engine.scheduler.requests.values())):
                assert asyncio.get_running_loop().time() < deadline, "no embedding went mid-chunk"
                await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while aeng.num_in_flight or engine.has_unfinished():
                assert asyncio.get_running_loop().time() < deadline, "aborted siblings still pending"
                await asyncio.sleep(0.005)
            assert engine.block_manager.num_used_blocks == 0
            # the engine still serves: the same text embeds to the same vector afterwards
            again = await aeng.embed(LONG_TEXT, PoolingParams())
            want = engine_embed_reference
            torch.testing.assert_close(again.embedding, want, atol=1e-5, rtol=1e-5)

    engine_embed_reference = engine.embed([LONG_TEXT], PoolingParams())[0].embedding
    asyncio.run(main())
