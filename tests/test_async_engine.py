"""The asyncio front end: many concurrent callers share one engine thread; results equal the sync engine's;
aborts, early stream exits, bad input, a full queue, step failures and shutdown leave no leaks."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from orthrus_rag import SamplingParams
from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.engine.clients.protocol import EngineQueueFull, EngineShutdown, RequestAborted

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)  # aborted long before it ends


async def wait_for(cond, timeout: float = 30.0) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout)


_ELSEWHERE: set[threading.Thread] = set()  # engine threads a test did not start (the session's test server's)


@pytest.fixture(autouse=True)
def _threads_of_others():
    _ELSEWHERE.clear()
    _ELSEWHERE.update(t for t in threading.enumerate() if t.name == "orthrus-async-engine")


def engine_threads() -> list[threading.Thread]:
    """The AsyncEngine threads this test started and that still run."""
    return [t for t in threading.enumerate() if t.name == "orthrus-async-engine" and t not in _ELSEWHERE]


def test_many_concurrent_callers_match_sync(engine):
    """200 callers (120 embeds + 80 generations) complete with the sync engine's results, in mixed steps."""
    texts = [f"document number {i} about topic {i % 7}" for i in range(120)]
    prompts = [f"Question {i}: name a colour." for i in range(80)]
    want_gen, want_emb = engine.run(prompts, SP, texts)

    async def main():
        async with AsyncEngine(engine) as aeng:
            first = engine.num_steps
            gens = asyncio.gather(*(aeng.generate(p, SP) for p in prompts))
            embs = aeng.embed_many(texts)
            got_gen, got_emb = await asyncio.gather(gens, embs)
            assert aeng.num_in_flight == 0
            return got_gen, got_emb, list(engine.step_stats)[-(engine.num_steps - first):]

    got_gen, got_emb, steps = asyncio.run(main())
    assert [o.token_ids for o in got_gen] == [o.token_ids for o in want_gen]
    assert [o.text for o in got_gen] == [o.text for o in want_gen]
    for got, want in zip(got_emb, want_emb):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert torch.allclose(got.embedding, want.embedding, atol=1e-5)
    assert any(s.is_mixed for s in steps)
    assert not engine_threads()


def test_stream_grows_to_generate_text(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main():
        async with AsyncEngine(engine) as aeng:
            snaps = [o async for o in aeng.generate_stream("The capital of France is", params)]
            return snaps, await aeng.generate("The capital of France is", params)

    snaps, full = asyncio.run(main())
    assert [len(s.token_ids) for s in snaps] == list(range(1, 9))
    assert [s.finished for s in snaps] == [False] * 7 + [True]
    assert all(b.text.startswith(a.text) for a, b in zip(snaps, snaps[1:]))
    assert snaps[-1].text == full.text and snaps[-1].token_ids == full.token_ids


def test_abort_in_flight_frees_blocks_and_spares_others(engine):
    others = ["Short prompt one", "Another short prompt"]
    want = [o.token_ids for o in engine.generate(others, SP)]

    async def main():
        async with AsyncEngine(engine) as aeng:
            victim = asyncio.create_task(aeng.generate("A long prompt " * 20, LONG, request_id="victim"))
            got = await asyncio.gather(*(aeng.generate(p, SP) for p in others), aeng.embed("an embedding"))
            assert [o.token_ids for o in got[:2]] == want
            await wait_for(lambda: len(engine.scheduler.requests["victim"].output_token_ids) > 0)
            assert engine.block_manager.num_used_blocks > 0
            assert await aeng.abort("victim")
            assert engine.block_manager.num_used_blocks == 0  # freed at once: the victim held all used blocks
            with pytest.raises(RequestAborted, match="victim"):
                await victim
            assert not await aeng.abort("victim")
            # a stream being aborted ends with a finished output whose finish_reason is "abort"
            outs = []
            async for out in aeng.generate_stream("Tell me a story", LONG, request_id="s"):
                outs.append(out)
                if len(outs) == 2:
                    assert await aeng.abort("s")
            assert outs[-1].finished and outs[-1].finish_reason == "abort"
            assert not any(o.finished for o in outs[:-1]) and outs[-1].token_ids[:2] == outs[1].token_ids
            assert aeng.num_in_flight == 0

    asyncio.run(main())


def test_leaving_a_stream_or_cancelling_aborts(engine):
    async def main():
        async with AsyncEngine(engine) as aeng:
            async for _ in aeng.generate_stream("Once upon a time", LONG):
                break
            left_at = engine.num_steps
            await wait_for(lambda: aeng.num_in_flight == 0 and not engine.has_unfinished())
            assert engine.num_steps - left_at < 50  # aborted: LONG needs 500 decode steps

            async def consume():
                async for _ in aeng.generate_stream("Once upon a time", LONG):
                    pass
            for coro in (consume(), aeng.generate("Once upon a time", LONG)):  # cancelled callers abort too
                task = asyncio.create_task(coro)
                await wait_for(lambda: engine.block_manager.num_used_blocks > 0)
                task.cancel()
                cancelled_at = engine.num_steps
                with pytest.raises(asyncio.CancelledError):
                    await task
                await wait_for(lambda: aeng.num_in_flight == 0 and not engine.has_unfinished())
                assert engine.block_manager.num_used_blocks == 0
                # the abort, not the request running out: LONG needs 500 decode steps
                assert engine.num_steps - cancelled_at < 50

    asyncio.run(main())


def test_bad_input_fails_only_its_caller(engine):
    async def main():
        async with AsyncEngine(engine) as aeng:
            return await asyncio.gather(
                aeng.generate("fine", SP), aeng.embed(""), aeng.generate([]), aeng.generate(123),
                aeng.embed("also fine"), aeng.generate("dup", SP, request_id="x"),
                aeng.generate("dup", SP, request_id="x"), return_exceptions=True)

    ok, empty, no_ids, bad_type, emb, dup1, dup2 = asyncio.run(main())
    assert len(ok.token_ids) == 4 and emb.embedding.ndim == 1 and len(dup1.token_ids) == 4
    assert isinstance(empty, ValueError) and "empty" in str(empty)
    assert isinstance(no_ids, ValueError) and isinstance(bad_type, TypeError)
    assert isinstance(dup2, ValueError) and "already in use" in str(dup2)


def test_queue_full(engine):
    async def main():
        async with AsyncEngine(engine, max_in_flight=3) as aeng:
            tasks = [asyncio.create_task(aeng.generate(f"prompt {i}", SP)) for i in range(3)]
            await asyncio.sleep(0)
            assert aeng.num_in_flight == 3
            with pytest.raises(EngineQueueFull, match="3 requests are pending; the limit is 3"):
                await aeng.embed("one too many")
            await asyncio.gather(*tasks)
            assert aeng.num_in_flight == 0
            await aeng.embed("room again")

    asyncio.run(main())


def test_step_failure_fails_callers_and_loop_survives(engine, monkeypatch):
    real_step = engine.step

    def boom():
        monkeypatch.setattr(engine, "step", real_step)
        raise RuntimeError("boom")

    async def main():
        async with AsyncEngine(engine) as aeng:
            monkeypatch.setattr(engine, "step", boom)
            got = await asyncio.gather(aeng.generate("a", SP), aeng.embed("b"), return_exceptions=True)
            assert all(isinstance(g, RuntimeError) and str(g) == "boom" for g in got)
            assert len((await aeng.generate("again", SP)).token_ids) == 4

    asyncio.run(main())


def test_shutdown_fails_pending_and_leaves_no_thread(engine):
    async def main():
        aeng = AsyncEngine(engine)
        gen = asyncio.create_task(aeng.generate("A long prompt " * 10, LONG))

        async def consume():
            return [o async for o in aeng.generate_stream("Another long one", LONG)]
        stream = asyncio.create_task(consume())
        await wait_for(lambda: len(engine.scheduler.requests) == 2 and engine.block_manager.num_used_blocks > 0)
        assert engine_threads()
        await aeng.shutdown()
        assert not engine_threads()
        for task in (gen, stream):
            with pytest.raises(EngineShutdown, match="shut down"):
                await task
        await aeng.shutdown()
        with pytest.raises(EngineShutdown):
            await aeng.embed("too late")
        assert aeng.num_in_flight == 0 and not await aeng.abort("anything")

    asyncio.run(main())


def test_the_engine_thread_runs_with_the_engines_thread_count_and_frees_the_callers_pool():
    """OpenMP's thread count is per thread: the engine thread takes the engine's (not the runtime's default), and
    the thread that built the engine gives up its OpenMP pool when the engine thread starts (machine.py: two pools
    on few cores throttle each other)."""
    from orthrus_rag.machine import release_openmp_pool
    from tests.fake_engine import FakeEngine

    torch.ones(1 << 16).add_(1)  # NOTE: a parallel op: this thread has a pool now
    assert release_openmp_pool() is True  # torch's OpenMP runtime is found and the call is taken
    seen = []
    aeng = AsyncEngine(FakeEngine(num_threads=1))
    aeng.observe_steps(lambda _: seen.append(torch.get_num_threads()))

    async def main():
        async with aeng:
            return await aeng.generate("Question: What is item 1?\n")

    before = torch.get_num_threads()
    assert asyncio.run(main()).finished
    assert seen and set(seen) == {1} and torch.get_num_threads() == before  # the caller's count is its own
