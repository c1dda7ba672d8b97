"""Continuation: generated blocks join the prefix cache, and a finished generation continues with appended tokens,
its KV held meanwhile. Greedy tokens equal a fresh request's over the whole sequence (under an adapter, through
preemption); a held block is pinned until its deadline or until running requests need it; bad input is named."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from orthrus_rag import CacheConfig, Engine, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.engine.core.block_manager import PrefixCachingBlockManager
from orthrus_rag.engine.core.policies import POLICIES
from orthrus_rag.engine.core.request import Request, RequestKind
from orthrus_rag.layers.lora import attach_adapters, load_peft_adapter
from tests.test_model_parity import EOS, _build, _ids, _StubTokenizer

BS = 4


def gen(req_id: str, prompt: list[int], output: list[int] = (), hold: float = 0.0) -> Request:
    return Request(req_id, RequestKind.GENERATE, list(prompt), output_token_ids=list(output),
                   sampling_params=SamplingParams(max_tokens=8, hold_kv_s=hold))


def compute_all_but_last(bm: PrefixCachingBlockManager, req: Request) -> int:
    """Admit `req` and compute every token but its last (what a finished generation's KV covers); the hit tokens."""
    hit = bm.match_prefix(req)
    n = req.num_remaining_tokens - 1
    assert bm.can_allocate(req, n)
    bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.cache_computed(req)
    return hit


# ---- the block manager alone ----------------------------------------------------------------------------------
def test_generated_blocks_are_cached_so_a_prompt_extending_an_output_finds_them() -> None:
    bm = PrefixCachingBlockManager(num_blocks=16, block_size=BS)
    a = gen("a", range(6), output=[50, 51, 52, 53, 54])  # 11 tokens, 10 computed: blocks 0, 1 full
    compute_all_but_last(bm, a)
    assert a.num_registered_blocks == 2 and len(bm.block_of) == 2
    bm.free(a)
    turn2 = gen("b", [*range(6), 50, 51, 52, 53, 54, 7, 8])  # a's prompt + output + more: both blocks found
    assert compute_all_but_last(bm, turn2) == 8 and bm.num_hit_tokens == 8
    other = gen("c", [*range(6), 50, 99, 52, 53, 54])  # differs inside the output's block: only the first block
    assert compute_all_but_last(bm, other) == 4
    # a victim re-admitted after preemption finds its own output blocks (not counted as a hit)
    for r in (turn2, other):
        bm.free(r)
    victim = gen("v", range(6), output=[50, 51, 52, 53, 54, 60, 61])
    victim.num_preemptions = 1
    hits = bm.num_hit_tokens
    assert bm.match_prefix(victim) == 8 and bm.num_hit_tokens == hits
    bm.free(victim)
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


def test_a_hold_pins_blocks_until_its_deadline_or_until_running_work_needs_them() -> None:
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=BS)
    a = gen("a", range(9), hold=10.0)  # 2 full blocks + 1 partial
    compute_all_but_last(bm, a)
    held = a.block_table[:2]
    bm.hold("a", a, until=100.0)
    bm.free(a)
    assert bm.num_free_blocks == 2 and all(bm.ref_counts[b] == 1 for b in held)
    bm.expire_holds(now=99.0)
    assert bm.num_free_blocks == 2  # not yet
    big = gen("big", range(100, 112))  # needs 3 blocks: the hold gives way rather than the running request
    assert not bm.can_allocate(big, 12) and bm.holds  # asking alone drops nothing (bulk work asks this way)
    huge = gen("huge", range(100, 120))  # 5 blocks: even without the hold too few, so the hold stays
    bm.reclaim(huge, 20)
    assert bm.holds
    bm.reclaim(big, 12)
    assert bm.can_allocate(big, 12) and not bm.holds and bm.num_free_blocks == 4
    b = gen("b", range(9), hold=10.0)
    compute_all_but_last(bm, b)
    bm.hold("b", b, until=100.0)
    bm.free(b)
    bm.expire_holds(now=100.0)
    assert not bm.holds and bm.num_free_blocks == 4 and set(bm.ref_counts) == {0}
    assert compute_all_but_last(bm, gen("b2", [*range(9), 5])) == 8  # released, yet still cached until evicted


def test_a_continuation_drops_the_hold_once_it_has_matched_the_blocks() -> None:
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=BS)
    a = gen("a", range(6), output=[40, 41, 42], hold=10.0)
    compute_all_but_last(bm, a)
    bm.hold("a", a, until=100.0)
    bm.free(a)
    partial = gen("b", [*range(6), 99])  # another id matching only part of the held blocks leaves the hold alone
    assert compute_all_but_last(bm, partial) == 4 and "a" in bm.holds
    bm.free(partial)
    cont = gen("a", [*range(6), 40, 41, 42, 9, 9])
    assert compute_all_but_last(bm, cont) == 8 and not bm.holds
    bm.free(cont)
    bm.hold("a", cont, until=100.0)
    over_http = gen("c", [*range(6), 40, 41, 42, 9, 9, 7])  # another id that matched every held block takes them over
    assert compute_all_but_last(bm, over_http) == 8 and not bm.holds and not bm._hold_tails
    bm.free(over_http)
    cont = gen("a2", [*range(6), 40, 41, 42, 9, 9])
    compute_all_but_last(bm, cont)
    assert all(bm.ref_counts[b] == 1 for b in cont.block_table[:2])  # the continuation's own reference only
    bm.free(cont)
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


def test_hold_kv_s_is_checked() -> None:
    for bad in (-1.0, float("nan"), 601.0, "10"):
        with pytest.raises(ValueError, match="hold_kv_s must be between 0 and 600"):
            SamplingParams(hold_kv_s=bad)


# ---- a tiny random model: exact greedy equality, an adapter, preemption -----------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("continuation")
    hf, ours = _build("llama_tied", tmp / "base")
    torch.manual_seed(7)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                               target_modules=["q_proj", "v_proj", "up_proj"]))
    peft_model.save_pretrained(str(tmp / "gen"))
    slots = attach_adapters(ours, [load_peft_adapter(tmp / "gen", name="gen")])
    return ours, slots


def tiny_engine(tiny, num_blocks: int = 64, prefix_caching: bool = True, policy: str = "orthrus") -> Engine:
    model, slots = tiny
    cfg = EngineConfig(model=ModelConfig(name="tiny", dtype="float32", device="cpu"),
                       cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32, max_chunk_tokens=16, policy=policy))
    engine = Engine(cfg, model, _StubTokenizer())
    engine.adapter_slots, engine.adapter_kinds = dict(slots), {"gen": "generate"}
    return engine


STOP = 7  # a token id that ends a round, as `</search>` does


def rounds_params(adapter: str | None = None, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, hold_kv_s=60.0, adapter=adapter)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [None, "gen"])
def test_a_continuation_equals_a_fresh_request_over_the_whole_sequence(tiny, adapter) -> None:
    engine, plain = tiny_engine(tiny), tiny_engine(tiny, prefix_caching=False)
    prompts = [_ids(37, seed) for seed in range(3)]
    firsts = engine.generate(prompts, rounds_params(adapter, max_tokens=12))
    assert all(o.finish_reason == "length" for o in firsts) and len(engine.continuations) == 3
    assert engine.block_manager.holds  # their full blocks stay pinned meanwhile
    appended = [_ids(9, 10 + i) for i in range(3)]
    for o, extra in zip(firsts, appended):
        assert engine.continue_(o.request_id, extra) == o.request_id
    hits, first_step = engine.block_manager.num_hit_tokens, engine.num_steps
    outs = engine.run_until_done()
    for o, extra in zip(firsts, appended):
        whole = o.prompt_token_ids + o.token_ids + extra
        (fresh,) = plain.generate([whole], rounds_params(adapter, max_tokens=12))  # the first round's params
        cont = outs[o.request_id]
        assert cont.prompt_token_ids == whole and cont.token_ids == fresh.token_ids
        assert cont.finish_reason == fresh.finish_reason
    # each continuation computed only what followed its held blocks: 49 tokens were known, 48 of them in 3 blocks
    assert engine.block_manager.num_hit_tokens - hits == 3 * 48
    prefilled = sum(s.num_prefill_tokens for s in engine.step_stats if s.step >= first_step)
    assert prefilled == sum(len(o.prompt_token_ids) + len(o.token_ids) + 9 - 48 for o in firsts)
    assert engine.block_manager.num_free_blocks + sum(len(b) for b, _ in engine.block_manager.holds.values()) \
        == engine.block_manager.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_continuations_through_preemption_and_lost_holds_keep_their_tokens(tiny, policy) -> None:
    """12 blocks for 6 sequences of up to 70 tokens: holds are dropped and requests preempted along the way, under
    every policy; every round still equals a fresh request's tokens and no block is lost."""
    engine, plain = tiny_engine(tiny, num_blocks=12, policy=policy), tiny_engine(tiny, prefix_caching=False)
    seqs = {f"s{i}": _ids(20 + 3 * i, 20 + i) for i in range(6)}
    params = SamplingParams(max_tokens=12, temperature=0.0, hold_kv_s=60.0, stop_token_ids=[STOP])
    for rid, prompt in seqs.items():
        engine.add_generate(prompt, params, request_id=rid)
    first = engine.num_steps
    for round_ in range(3):
        outs = engine.run_until_done()
        for rid, out in outs.items():
            (fresh,) = plain.generate([seqs[rid]], params)
            assert out.token_ids == fresh.token_ids, f"{rid} round {round_}"
            seqs[rid] = seqs[rid] + out.token_ids + [STOP + 1, round_ + 3]
            if round_ < 2:
                engine.continue_(rid, [STOP + 1, round_ + 3])
    assert sum(s.num_preempted for s in engine.step_stats if s.step >= first) > 0
    bm = engine.block_manager
    pinned = sum(len(b) for b, _ in bm.holds.values())
    assert bm.num_free_blocks + pinned == bm.num_blocks
    bm.expire_holds(float("inf"))
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


@pytest.mark.slow
def test_continuation_errors_name_the_problem(tiny) -> None:
    engine = tiny_engine(tiny)
    with pytest.raises(ValueError, match="no finished generation 'nope' to continue"):
        engine.continue_("nope", [3])
    (plain_out,) = engine.generate([_ids(10, 1)], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(ValueError, match="did not set SamplingParams.hold_kv_s"):
        engine.continue_(plain_out.request_id, [3])
    (held,) = engine.generate([_ids(10, 2)], rounds_params(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.continue_(held.request_id, [EOS + 5])
    engine.continue_(held.request_id, [])  # nothing appended: it generates on from where it stopped
    with pytest.raises(ValueError, match="is still running"):
        engine.continue_(held.request_id, [3])
    engine.abort(held.request_id)  # an aborted round is not continuable, and the earlier round's record goes too
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="was aborted"):
        engine.continue_(held.request_id, [3])
    (again,) = engine.generate([_ids(10, 2)], rounds_params(max_tokens=2))
    engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=1)])  # NOTE: ids differ; the record stays
    rid = engine.continue_(again.request_id, [3])
    out = engine.run_until_done()[rid]
    assert len(out.prompt_token_ids) == 10 + 2 + 1 and len(out.token_ids) == 2
    # a later round under the id that does not hold replaces nothing: the record is gone, and release says so
    assert engine.continue_(rid, [4], SamplingParams(max_tokens=1)) == rid and engine.run_until_done()
    with pytest.raises(ValueError, match="did not set SamplingParams.hold_kv_s"):
        engine.continue_(rid, [4])
    assert not engine.release(rid)
    (kept,) = engine.generate([_ids(20, 3)], rounds_params(max_tokens=2))
    assert engine.block_manager.holds and engine.release(kept.request_id) and not engine.block_manager.holds


@pytest.mark.slow
def test_async_continue_and_its_stream(tiny) -> None:
    engine, plain = tiny_engine(tiny), tiny_engine(tiny, prefix_caching=False)
    prompt = _ids(30, 5)

    async def main() -> tuple:
        async with AsyncEngine(engine) as aeng:
            first = await aeng.generate(prompt, rounds_params(), request_id="chat")
            second = await aeng.continue_("chat", [11, 12])
            snaps = [s async for s in aeng.continue_stream("chat", [13])]
            with pytest.raises(ValueError, match="no finished generation 'other'"):
                await aeng.continue_("other", [1])
            return first, second, snaps

    first, second, snaps = asyncio.run(main())
    whole = prompt + first.token_ids + [11, 12]
    assert second.token_ids == plain.generate([whole], rounds_params())[0].token_ids
    whole += second.token_ids + [13]
    assert snaps[-1].finished and snaps[-1].token_ids == plain.generate([whole], rounds_params())[0].token_ids
    assert snaps[-1].prompt_token_ids == whole
    assert engine.scheduler.requests == {}
    assert engine.continuations.get("chat").token_ids.tolist() == whole + snaps[-1].token_ids


# ---- SmolLM2: a chat's next turn, a round stopped at a stop string ---------------------------------------------
@pytest.mark.slow
def test_a_second_chat_turn_prefills_only_its_new_tokens(engine) -> None:
    """No continuation asked for: a turn-2 prompt that repeats turn 1's prompt and output finds both cached."""
    tok = engine.tokenizer
    turn1 = tok(tok.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe, briefly."}],
                                        add_generation_prompt=True, tokenize=False))["input_ids"]
    (out1,) = engine.generate([turn1], SamplingParams(max_tokens=24, temperature=0.0))
    follow = tok("\n<|im_start|>user\nWhich of them is the longest?<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    turn2 = turn1 + out1.token_ids + follow
    hits, first_step = engine.block_manager.num_hit_tokens, engine.num_steps
    engine.generate([turn2], SamplingParams(max_tokens=4, temperature=0.0))
    known = (len(turn1) + len(out1.token_ids) - 1) // 16 * 16  # turn 1 computed all but its last sampled token
    hit = engine.block_manager.num_hit_tokens - hits
    assert hit >= known > len(turn1)  # generated blocks included
    assert sum(s.num_prefill_tokens for s in engine.step_stats if s.step >= first_step) == len(turn2) - hit


@pytest.mark.slow
def test_a_round_stopped_at_a_stop_string_continues_with_appended_text(engine) -> None:
    prompt = "Question: what is the capital of France? Think, then search with <search>query</search>.\n<search>"
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=["</search>"], hold_kv_s=60.0)
    (first,) = engine.generate([prompt], params)
    passages = "</search>\n<information>Paris is the capital and largest city of France.</information>\n"
    rid = engine.continue_(first.request_id, passages, SamplingParams(max_tokens=8, temperature=0.0))
    hits = engine.block_manager.num_hit_tokens
    cont = engine.run_until_done()[rid]
    whole = first.prompt_token_ids + first.token_ids + engine.tokenizer(passages, add_special_tokens=False)["input_ids"]
    assert cont.prompt_token_ids == whole
    # the fresh request computes its whole prompt (prompt log-probabilities skip the prefix cache)
    (fresh,) = engine.generate([whole], SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0))
    assert cont.token_ids == fresh.token_ids and cont.text == fresh.text
    assert engine.block_manager.num_hit_tokens - hits == (len(first.prompt_token_ids) + len(first.token_ids) - 1) \
        // 16 * 16
    engine.block_manager.expire_holds(float("inf"))  # the continuation held nothing (its params did not ask)


@pytest.mark.slow
def test_a_remote_client_continues_over_http(served, smol_tokenizer) -> None:
    """`RemoteClient.continue_`: the server returns the token ids of a generation that holds its KV; the
    continuation sends them with the appended tokens, and the server's held blocks serve its prefix."""
    from orthrus_rag.engine.clients.remote import RemoteClient

    remote = RemoteClient(served.url, tokenizer=smol_tokenizer)
    appended = "</search>\n<information>Paris is the capital of France.</information>\n"
    hold = SamplingParams(max_tokens=10, temperature=0.0, stop=["</search>"], hold_kv_s=5.0)

    async def main() -> tuple:
        try:
            first = await remote.generate("Question: what is the capital of France? Search: <search>", hold,
                                          request_id="trip")
            second = await remote.continue_("trip", appended, SamplingParams(max_tokens=6, temperature=0.0))
            whole = first.prompt_token_ids + first.token_ids + smol_tokenizer(appended, add_special_tokens=False)[
                "input_ids"]
            fresh = await remote.generate(whole, SamplingParams(max_tokens=6, temperature=0.0))
            with pytest.raises(ValueError, match="no finished generation 'other'"):
                await remote.continue_("other", [1])
            return first, second, fresh, whole
        finally:
            await remote.aclose()

    first, second, fresh, whole = asyncio.run(main())
    assert first.token_ids and first.request_id == "trip" and second.request_id == "trip"
    assert second.prompt_token_ids == [] or second.prompt_token_ids == whole  # ids come back only when held
    assert second.text == fresh.text
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) + len(first.token_ids) - 1) // 16 * 16 > 0
    assert not served.engine.block_manager.holds  # the continuation matched every held block: the hold is gone
    assert not RemoteClient(served.url).can_continue  # text is appended as ids: it needs the tokenizer
