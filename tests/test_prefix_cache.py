"""Prefix caching: prompts that start alike share KV blocks; outputs never change, blocks are never lost."""

from __future__ import annotations

import pytest

from orthrus_rag import Engine, SamplingParams
from orthrus_rag.engine.core.block_manager import PrefixCachingBlockManager
from orthrus_rag.engine.core.request import Request, RequestKind
from tests.conftest import SMOL, engine_overrides
from tests.fake_steps import make_request

BS = 4


def gen(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, RequestKind.GENERATE, list(prompt), sampling_params=SamplingParams(max_tokens=4))


def run_prompt(bm: PrefixCachingBlockManager, req: Request) -> int:
    """Admit `req`, compute its whole prompt in one go (as an engine step would), register it; the hit tokens."""
    hit = bm.match_prefix(req)
    n = req.num_remaining_tokens
    assert bm.can_allocate(req, n)
    bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.cache_computed(req)
    return hit


# ---- the block manager alone ----------------------------------------------------------------------------------
def test_a_shared_prefix_is_served_from_the_cache_and_the_last_token_is_computed() -> None:
    bm = PrefixCachingBlockManager(num_blocks=16, block_size=BS)
    a = gen("a", range(10))  # blocks [0-3] [4-7] full, [8-9] partial
    assert run_prompt(bm, a) == 0
    b = gen("b", [*range(8), 99, 98, 97])  # the same two full blocks, then its own
    assert run_prompt(bm, b) == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    c = gen("c", range(8))  # a prompt made only of cached blocks still computes its last token
    assert run_prompt(bm, c) == 4 and c.num_computed_tokens == 8
    d = gen("d", [5, *range(1, 10)])  # differs in the first token: nothing shared
    assert run_prompt(bm, d) == 0
    assert bm.num_hit_tokens == 12
    for r in (a, b, c, d):
        bm.free(r)
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


def test_freed_blocks_keep_their_content_until_needed_and_unnamed_ones_go_first() -> None:
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=BS)
    a = gen("a", range(9))  # 2 named blocks + 1 unnamed partial
    run_prompt(bm, a)
    named = set(a.block_table[:2])
    bm.free(a)
    other = make_request("x", "generate", 4)  # one block: taken from the unnamed ones, the cache survives
    bm.allocate(other, 4)
    assert other.block_table[0] not in named and run_prompt(bm, gen("a2", range(9))) == 8
    bm2 = PrefixCachingBlockManager(num_blocks=2, block_size=BS)
    first = gen("f", range(9))
    bm2.match_prefix(first)
    assert not bm2.can_allocate(first, 9)  # needs 3 blocks: the scheduler undoes the match
    bm2.unmatch(first)
    assert first.num_computed_tokens == 0 and first.block_table == [] and bm2.num_free_blocks == 2


def test_an_evicted_block_is_no_longer_found() -> None:
    bm = PrefixCachingBlockManager(num_blocks=3, block_size=BS)
    a = gen("a", range(9))
    run_prompt(bm, a)
    bm.free(a)
    big = make_request("big", "generate", 12)  # takes every block: both named ones are overwritten
    bm.allocate(big, 12)
    assert bm.block_of == {} and bm.name_of == {}
    bm.free(big)
    assert run_prompt(bm, gen("a2", range(9))) == 0


def test_embeddings_never_share() -> None:
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=BS)
    run_prompt(bm, gen("a", range(9)))
    emb = make_request("e", "embed", 9)
    emb.prompt_token_ids = list(range(9))
    assert bm.match_prefix(emb) == 0 and emb.block_table == []


# ---- the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    plain = Engine.from_pretrained(SMOL, **engine_overrides(num_blocks=24))
    cached = Engine.from_pretrained(SMOL, **engine_overrides(num_blocks=24, enable_prefix_caching=True))
    return plain, cached


PREFIX = ("You answer questions from the passages below. Passage: The Nile is a river in Africa that flows north "
          "into the Mediterranean Sea. Passage: The Amazon carries more water than any other river. ")
QUESTIONS = ["Question: which river flows north? Answer:", "Question: which river carries most water? Answer:",
             "Question: where does the Nile end? Answer:", "Question: name a river in Africa. Answer:"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_greedy_outputs_do_not_change_and_shared_prompts_compute_less(engines) -> None:
    plain, cached = engines
    prompts = [PREFIX + q for q in QUESTIONS]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    first = cached.num_steps
    assert [o.token_ids for o in cached.generate(prompts[:1], GREEDY)] == want[:1]  # fills the cache
    assert [o.token_ids for o in cached.generate(prompts[1:], GREEDY)] == want[1:]  # served from it
    prompt_tokens = sum(s.num_prefill_tokens for s in cached.step_stats if s.step >= first)
    total = sum(len(cached.inputs.prompt(p)) for p in prompts)
    shared = len(cached.inputs.prompt(PREFIX)) // 16 * 16
    assert cached.block_manager.num_hit_tokens >= 3 * (shared - 16)
    assert prompt_tokens <= total - 3 * (shared - 16)
    assert cached.block_manager.num_free_blocks == cached.block_manager.num_blocks  # cached blocks count as free


@pytest.mark.slow
def test_preemption_and_a_cache_full_of_other_prompts_keep_outputs(engines) -> None:
    plain, cached = engines
    prompts = [PREFIX * 3 + q for q in QUESTIONS] + [f"Story {i}: once upon a time there was a river" for i in
                                                     range(6)]
    long_greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, long_greedy)]
    first = cached.num_steps
    for _ in range(2):  # the second round starts from a cache the first one filled (and partly evicted)
        assert [o.token_ids for o in cached.generate(prompts, long_greedy)] == want
    assert sum(s.num_preempted for s in cached.step_stats if s.step >= first) > 0  # 24 blocks are too few
    bm = cached.block_manager
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}
    assert set(bm.block_of.values()) == set(bm.name_of) and len(bm.block_of) == len(bm.name_of)
