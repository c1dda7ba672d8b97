"""Block manager contracts: blocks cover exactly the KV tokens, embeddings' last chunks write no KV, no block
is ever owned twice, and after every request finishes or aborts every block is free (DESIGN.md, "KV cache").

No model: the scheduler runs against fake runner outputs (tests/fake_steps.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.block_manager import BlockManager
from orthrus_rag.engine.core.request import RequestStatus
from tests.fake_steps import FakeEngine, blocks_for, check_ownership, make_request, max_blocks_needed


# ---- the block manager alone ----------------------------------------------------------------------------
def test_generate_blocks_cover_computed_plus_new_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("g", "generate", 10, max_tokens=4)
    assert bm.num_blocks_needed(req, 10) == 3
    bm.allocate(req, 10)
    assert len(req.block_table) == 3 and bm.num_free_blocks == 5
    req.num_computed_tokens = 10
    req.output_token_ids.append(1)
    assert bm.num_blocks_needed(req, 1) == 0  # token 11 fits in block 3
    req.num_computed_tokens = 12
    req.output_token_ids += [2, 3]
    assert bm.num_blocks_needed(req, 1) == 1  # token 13 opens block 4
    bm.allocate(req, 1)
    assert len(req.block_table) == 4
    bm.free(req)
    assert req.block_table == [] and bm.num_free_blocks == bm.num_blocks


def test_embedding_in_one_chunk_needs_no_blocks() -> None:
    bm = BlockManager(num_blocks=1, block_size=4)
    req = make_request("e", "embed", 200)
    assert not req.needs_kv(200)
    assert bm.num_blocks_needed(req, 200) == 0 and bm.can_allocate(req, 200)
    bm.allocate(req, 200)
    assert req.block_table == [] and bm.num_free_blocks == 1


def test_embedding_last_chunk_allocates_nothing() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    req = make_request("e", "embed", 21)
    for n, blocks in ((8, 2), (8, 4), (5, 4)):  # the last chunk (tokens 17..21) writes no KV
        bm.allocate(req, n)
        assert len(req.block_table) == blocks
        req.num_computed_tokens += n
    assert req.num_computed_tokens == req.num_tokens
    bm.free(req)
    assert bm.num_free_blocks == 16


def test_encoder_requests_need_no_blocks() -> None:
    bm = BlockManager(num_blocks=1, block_size=4)
    req = make_request("x", "encoder", 100)
    assert bm.num_blocks_needed(req, 100) == 0


def test_allocate_without_room_is_an_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request("g", "generate", 9)
    assert not bm.can_allocate(req, 9)
    with pytest.raises(AssertionError):
        bm.allocate(req, 9)


@settings(max_examples=300, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(1, 24),
       ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40), st.booleans()), max_size=60))
def test_random_allocate_free_never_shares_a_block(block_size: int, num_blocks: int,
                                                   ops: list[tuple[int, int, bool]]) -> None:
    """Any interleaving of allocate/free over a few requests: disjoint tables, nothing lost."""
    bm = BlockManager(num_blocks, block_size)
    reqs = [make_request(f"g{i}", "generate", 200) for i in range(6)]
    for i, n, free in ops:
        req = reqs[i]
        if free:
            bm.free(req)
            req.num_computed_tokens = 0
        else:
            n = min(n, req.num_remaining_tokens)
            if n and bm.can_allocate(req, n):
                bm.allocate(req, n)
                req.num_computed_tokens += n
                assert len(req.block_table) == blocks_for(req.num_computed_tokens, block_size)
        owned = [b for r in reqs for b in r.block_table]
        assert len(owned) == len(set(owned)) and not set(owned) & set(bm.free_blocks)
        assert len(owned) + bm.num_free_blocks == num_blocks
    for req in reqs:
        bm.free(req)
    assert sorted(bm.free_blocks) == list(range(num_blocks))


# ---- driven by the scheduler, under cache pressure ----------------------------------------------------------
@st.composite
def pressured_workloads(draw: st.DrawFn) -> tuple[FakeEngine, list]:
    """Embed/generate mixes with a cache barely larger than the biggest request, so preemption is common."""
    block_size = draw(st.sampled_from([4, 16]))
    arrivals = []
    for i in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["generate", "embed"]))
        req = make_request(f"r{i}", kind, draw(st.integers(1, 200)), draw(st.integers(1, 20)))
        arrival = draw(st.integers(0, 8))
        abort_step = arrival + draw(st.integers(0, 60)) if draw(st.integers(0, 3)) == 0 else None
        arrivals.append((arrival, req, abort_step))
    need = max(1, *(max_blocks_needed(r, block_size) for _, r, _ in arrivals))
    num_blocks = need + draw(st.integers(0, need // 2))
    budget = draw(st.integers(8, 128))
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, 8)),
                          max_chunk_tokens=draw(st.integers(1, budget)))
    return FakeEngine(cfg, num_blocks, block_size), arrivals


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pressured_workloads())
def test_every_block_is_free_after_all_finish_or_abort(workload: tuple[FakeEngine, list]) -> None:
    """Per step (checked inside FakeEngine.step): each scheduled request's table covers exactly
    ceil(kv tokens / block_size) blocks, no block has two owners, an embedding fitting in one chunk gets no
    blocks and an embedding's last chunk allocates none. At the end: every block is free."""
    eng, arrivals = workload
    eng.run(arrivals)
    event("preempted" if eng.num_preemptions else "no preemption")
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sorted(bm.free_blocks) == list(range(bm.num_blocks))
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert all(r.is_finished and not r.block_table for r in eng.requests)


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    eng = FakeEngine(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_chunk_tokens=16),
                     num_blocks=8, block_size=4)
    a, b, c = (make_request(f"r{i}", "generate", 12, 4) for i in range(3))
    for r in (a, b, c):
        eng.add(r)
    eng.step()  # a: 12 tokens (3 blocks), b: 4 tokens (1 block), c waits (budget spent)
    assert (len(a.block_table), len(b.block_table), len(c.block_table)) == (3, 1, 0)
    eng.abort(b)  # mid-prefill
    eng.abort(c)  # never started
    assert b.status is c.status is RequestStatus.ABORTED
    assert eng.block_manager.num_free_blocks == 8 - 3
    check_ownership(eng)
    eng.run([])
    assert a.status is RequestStatus.FINISHED and eng.block_manager.num_free_blocks == 8


def test_preemption_returns_blocks_and_all_finish() -> None:
    """Cache for one request at a time: prompts fit together, their decodes do not, so requests are
    preempted and recomputed; nothing leaks."""
    block_size = 4
    reqs = [make_request(f"g{i}", "generate", 8, max_tokens=6) for i in range(4)]
    need = max(max_blocks_needed(r, block_size) for r in reqs)
    eng = FakeEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_chunk_tokens=64),
                     num_blocks=need, block_size=block_size)
    eng.run([(0, r, None) for r in reqs])
    assert eng.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED and len(r.output_token_ids) == 6 for r in reqs)
    assert eng.block_manager.num_free_blocks == need
