"""What each scheduling policy does with the budget left after decodes (fake runner, no model)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.policies import POLICIES, make_policy
from orthrus_rag.params import PoolingParams
from tests.fake_steps import FakeEngine, make_request


def _engine(policy: str, budget: int = 100, chunk: int | None = None, min_share: float = 0.0,
            seqs: int = 64) -> FakeEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_chunk_tokens=chunk or budget, max_num_seqs=seqs,
                          policy=policy, min_share=min_share)
    return FakeEngine(cfg, num_blocks=4096, block_size=16)


def _split_step(eng: FakeEngine) -> tuple[int, int]:
    """Run one step; (embedding tokens, prompt tokens) it scheduled."""
    decodes = {id(r) for r in eng.scheduler.running if r.is_decoding}
    out = eng.step()
    embed = sum(s.num_new_tokens for s in out.scheduled if s.req.is_embed)
    prefill = sum(s.num_new_tokens for s in out.scheduled if not s.req.is_embed and id(s.req) not in decodes)
    return embed, prefill


def test_orthrus_splits_by_remaining_tokens_not_request_counts():
    eng = _engine("orthrus")
    eng.add(make_request("g0", "generate", 100, max_tokens=4))  # one long prompt: 100 tokens
    for i in range(3):  # three embeddings: 300 tokens
        eng.add(make_request(f"e{i}", "embed", 100))
    assert _split_step(eng) == (75, 25)


def test_orthrus_min_share_guards_the_minority_kind():
    eng = _engine("orthrus", min_share=0.2)
    for i in range(20):
        eng.add(make_request(f"g{i}", "generate", 500))
    eng.add(make_request("e0", "embed", 50))
    embed, prefill = _split_step(eng)
    assert embed == 20 and prefill == 80  # the raw share would give the embedding 1 token of 100


def test_orthrus_serves_latency_critical_work_before_the_split():
    """A 30-token query that a multi-hop chain waits on (priority < 0) runs whole in the next step, instead of
    a sliver of the remaining-token split beside a prompt backlog."""
    eng = _engine("orthrus", min_share=0.1)
    for i in range(10):
        eng.add(make_request(f"g{i}", "generate", 1000))
    eng.add(make_request("doc", "embed", 300))
    query = make_request("query", "embed", 30)
    query.pooling_params = PoolingParams(priority=-1)
    eng.add(query)
    embed, prefill = _split_step(eng)
    # the query whole, and a short step: the rest gets only its min_share floor (10 of 100 tokens)
    assert query.is_finished and embed >= 30 and embed + prefill == 30 + 10
    assert sum(_split_step(eng)) == 100  # nothing latency-critical pending: whole steps again
    plain = _engine("orthrus", min_share=0.1)  # the same without the priority: the query waits for its share
    for i in range(10):
        plain.add(make_request(f"g{i}", "generate", 1000))
    plain.add(make_request("doc", "embed", 300))
    late = make_request("query", "embed", 30)
    plain.add(late)
    assert sum(_split_step(plain)) == 100
    assert not late.is_finished


def test_latency_critical_work_shortens_its_step_beside_decodes():
    """With decodes running, a step that carries a latency-critical query carries the decodes, the query and the
    min_share floor of other work, so the query's step is short; the other policies keep whole steps."""
    for policy, short in (("orthrus", True), ("hetero-fcfs", False)):
        eng = _engine(policy, budget=200, min_share=0.1)
        for i in range(4):
            eng.add(make_request(f"g{i}", "generate", 20, max_tokens=50))
        eng.step()  # the four prompts (80 tokens): decoding from now on
        for i in range(4):
            eng.add(make_request(f"p{i}", "generate", 1000))
        query = make_request("query", "embed", 30)
        query.pooling_params = PoolingParams(priority=-1)
        eng.add(query)
        out = eng.step()
        assert query.is_finished == short  # hetero-fcfs: the query waits behind the earlier prompts
        assert out.num_batched_tokens == (4 + 30 + 20 if short else 200)


def test_qlen_priority_follows_the_published_rule():
    eng = _engine("qlen-priority")
    for i in range(3):
        eng.add(make_request(f"e{i}", "embed", 100))
    eng.add(make_request("g0", "generate", 100))
    assert _split_step(eng) == (0, 100)  # 1 x 4 > 3 x 1: generation takes the whole budget first
    eng = _engine("qlen-priority")
    for i in range(5):
        eng.add(make_request(f"e{i}", "embed", 100))
    eng.add(make_request("g0", "generate", 100))
    assert _split_step(eng) == (100, 0)  # 5 x 1 > 1 x 4


def test_hetero_fcfs_is_one_queue_in_arrival_order():
    eng = _engine("hetero-fcfs", budget=150)
    eng.add(make_request("g0", "generate", 100))
    eng.add(make_request("e0", "embed", 100))
    eng.add(make_request("g1", "generate", 100))
    out = eng.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("g0", 100), ("e0", 50)]


def test_unified_homo_steps_never_mix_and_alternate():
    eng = _engine("unified-homo", budget=64)
    for i in range(4):
        eng.add(make_request(f"g{i}", "generate", 40, max_tokens=6))
        eng.add(make_request(f"e{i}", "embed", 40))
    kinds = []
    while eng.scheduler.has_unfinished():
        out = eng.step()
        embed_kinds = {s.req.is_embed for s in out.scheduled}
        assert len(embed_kinds) == 1
        kinds.append(embed_kinds.pop())
    assert kinds[:4] == [True, False, True, False]


def test_unknown_policy_is_rejected(monkeypatch):
    from orthrus_rag.config.build import engine_config
    from orthrus_rag.engine.engine import Engine
    from orthrus_rag.engine.executor import loading

    monkeypatch.setattr(loading, "load_models", lambda config: pytest.fail("weights loaded for an unknown policy"))
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'"):
        Engine.from_config(engine_config(policy="fifo"))
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("fifo")


@st.composite
def backlogs(draw: st.DrawFn) -> tuple[FakeEngine, int]:
    budget = draw(st.integers(8, 256))
    eng = _engine("orthrus", budget=budget, seqs=256)
    for i in range(draw(st.integers(0, 8))):
        eng.add(make_request(f"g{i}", "generate", draw(st.integers(1, 300)), max_tokens=draw(st.integers(1, 5))))
    for i in range(draw(st.integers(0, 8))):
        eng.add(make_request(f"e{i}", "embed", draw(st.integers(1, 300))))
    return eng, budget


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backlogs())
def test_orthrus_split_follows_remaining_token_proportion(backlog: tuple[FakeEngine, int]) -> None:
    """Every step (no chunk cap, blocks or seq limits binding): the embedding tokens equal the residual budget
    times the embedding share of the remaining tokens, to within one token (the fractional part carries over
    to later steps), except that a kind with fewer tokens than its share leaves the rest to the other."""
    eng, budget = backlog
    for _ in range(2000):
        if not eng.scheduler.has_unfinished():
            return
        decodes = [r for r in eng.scheduler.running if r.is_decoding]
        rem_e = sum(r.num_remaining_tokens for r in eng.scheduler.pending(embed=True))
        rem_p = sum(r.num_remaining_tokens for r in eng.scheduler.pending(embed=False))
        residual = budget - len(decodes)
        embed, prefill = _split_step(eng)
        if rem_e + rem_p == 0 or residual <= 0:
            continue
        raw = residual * rem_e / (rem_e + rem_p)  # the fractional part may carry from step to step
        lo = min(rem_e, max(math.floor(raw) - 1, residual - rem_p, 0))
        hi = min(rem_e, max(math.ceil(raw) + 1, residual - rem_p))
        assert lo <= embed <= hi, (embed, lo, hi, rem_e, rem_p, residual)
        assert prefill == min(rem_p, residual - embed)
    raise AssertionError("workload did not finish")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_finishes_a_mixed_backlog(policy):
    eng = _engine(policy, budget=32, chunk=16)
    reqs = [make_request(f"g{i}", "generate", 20 + 7 * i, max_tokens=5) for i in range(5)]
    reqs += [make_request(f"e{i}", "embed", 10 + 13 * i) for i in range(5)]
    reqs += [make_request(f"x{i}", "encoder", 30) for i in range(3)]
    eng.run([(i % 4, r, None) for i, r in enumerate(reqs)])
    assert all(r.is_finished for r in reqs)


def test_orthrus_keeps_sequence_slots_for_embeddings_when_decodes_fill_them():
    eng = _engine("orthrus", budget=100, seqs=8, min_share=0.25)
    for i in range(8):
        eng.add(make_request(f"g{i}", "generate", 4, max_tokens=50))
    eng.step()  # eight prompts in one step; from now on eight decodes would take every slot
    eng.add(make_request("e0", "embed", 30))
    out = eng.step()
    assert [s.req.req_id for s in out.scheduled if s.req.is_embed] == ["e0"]
    assert sum(not s.req.is_embed for s in out.scheduled) == 7  # one embedding pending: one slot kept, not 2
    for i in (1, 2, 3):
        eng.add(make_request(f"e{i}", "embed", 30))
    out = eng.step()
    assert sum(s.req.is_embed for s in out.scheduled) == 2  # ceil(0.25 x 8) = 2 slots at most
    assert sum(not s.req.is_embed for s in out.scheduled) == 6
    eng = _engine("hetero-fcfs", budget=100, seqs=8)
    for i in range(8):
        eng.add(make_request(f"g{i}", "generate", 4, max_tokens=50))
    eng.step()
    eng.add(make_request("e0", "embed", 30))
    assert not any(s.req.is_embed for s in eng.step().scheduled)  # the baseline has no such guard


def _bulk(req):
    req.pooling_params = PoolingParams(priority=1)
    return req


def _serving_tokens(out) -> dict[str, int]:
    return {**{s.req.req_id: s.num_new_tokens for s in out.scheduled if not s.req.is_bulk},
            **{r.req_id: r.num_tokens for r in out.encoder if not r.is_bulk}}


@pytest.mark.parametrize("bulk_first", [False, True])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bulk_work_takes_only_what_serving_leaves(policy, bulk_first):
    """Under every policy a bulk backlog (priority > 0: an ingest), whether it arrived before or after the serving
    requests, leaves their schedule exactly as it is without it, step by step, and runs on the budget they leave:
    all of it done soon after they are."""
    def serving(eng):
        for i in range(4):
            eng.add(make_request(f"g{i}", "generate", 60, max_tokens=12))
        for i in range(6):
            eng.add(make_request(f"e{i}", "encoder" if i % 2 else "embed", 25))

    plain, busy = _engine(policy, min_share=0.1), _engine(policy, min_share=0.1)
    serving(plain)
    bulk = [_bulk(make_request(f"b{i}", "encoder" if i % 3 else "embed", 40)) for i in range(12)]
    if not bulk_first:
        serving(busy)
    for req in bulk:
        busy.add(req)
    if bulk_first:
        serving(busy)
    bulk_tokens = 0
    for _ in range(40):
        a, b = plain.step(), busy.step()
        assert _serving_tokens(a) == _serving_tokens(b)
        bulk_tokens += sum(s.num_new_tokens for s in b.scheduled if s.req.is_bulk) + sum(
            r.num_tokens for r in b.encoder if r.is_bulk)
        if not plain.scheduler.has_unfinished():
            break
    assert not plain.scheduler.has_unfinished()
    if policy != "unified-homo":  # NOTE: its steps never mix kinds: no slack beside a serving step of the other kind
        assert bulk_tokens > 0  # it used the slack beside the serving work, not only after it
    for _ in range(20):
        if not busy.scheduler.has_unfinished():
            break
        busy.step()
    assert all(r.is_finished for r in bulk)


def test_bulk_waits_while_serving_work_fills_every_step():
    eng = _engine("orthrus", min_share=0.1)
    for i in range(5):
        eng.add(make_request(f"g{i}", "generate", 200))
    doc = _bulk(make_request("doc", "encoder", 30))
    eng.add(doc)
    for _ in range(10):  # 1,000 prompt tokens: ten whole steps of 100
        out = eng.step()
        assert out.num_batched_tokens == 100 and doc not in out.encoder
    out = eng.step()
    assert doc in out.encoder


@pytest.mark.parametrize("kind", ["embed", "encoder"])
def test_bulk_step_tokens_bounds_bulk_beside_serving_work_only(kind):
    """With `bulk_step_tokens`, a step that carries serving work takes at most that much bulk work (the first
    encoder input may overdraw it, as a lane's first may); a step without serving work gives bulk all of it."""
    def bulk_cost(out) -> float:
        return sum(s.num_new_tokens for s in out.scheduled if s.req.is_bulk) + sum(
            r.num_tokens * 0.25 for r in out.encoder if r.is_bulk)

    capped, free = _engine("orthrus", min_share=0.1), _engine("orthrus", min_share=0.1)
    for eng in (capped, free):
        eng.scheduler.config.bulk_step_tokens = 8 if eng is capped else None
        for i in range(3):
            eng.add(make_request(f"g{i}", "generate", 4, max_tokens=30))
        for i in range(100):
            eng.add(_bulk(make_request(f"b{i}", kind, 40)))
    for _ in range(5):
        a, b = capped.step(), free.step()
        assert _serving_tokens(a) == _serving_tokens(b) and any(not s.req.is_bulk for s in a.scheduled)
        assert bulk_cost(a) <= (8 if kind == "embed" else 10) < bulk_cost(b)
    while any(not r.is_bulk for r in capped.scheduler.running + list(capped.scheduler.waiting)):
        capped.step()
    out = capped.step()  # only bulk left: the whole budget
    assert bulk_cost(out) > 8 and not _serving_tokens(out)


def test_bulk_step_tokens_is_checked():
    with pytest.raises(ValueError, match="bulk_step_tokens"):
        SchedulerConfig(bulk_step_tokens=0)


@pytest.mark.parametrize("policy", ["orthrus", "hetero-fcfs"])
def test_bulk_min_tokens_gives_bulk_its_floor_in_steps_that_serving_would_fill(policy):
    """Where serving work fills every step (test_bulk_waits_while_serving_work_fills_every_step), `bulk_min_tokens`
    holds that much budget back for bulk work each step: a bulk prompt chunks through at the floor, an encoder
    input costing less takes only its cost, and serving gets the rest; with no bulk left serving has it all."""
    eng = _engine(policy, min_share=0.1)
    eng.scheduler.config.bulk_min_tokens = 10
    for i in range(5):
        eng.add(make_request(f"g{i}", "generate", 200))
    doc, chunked = _bulk(make_request("doc", "encoder", 30)), _bulk(make_request("chunked", "embed", 25))
    eng.add(doc)
    eng.add(chunked)
    first = eng.step()
    assert doc in first.encoder  # cost ceil(30 x 0.25) = 8 of the floor's 10; the other 2 go to the bulk prompt
    assert [s.num_new_tokens for s in first.scheduled if s.req is chunked] == [2]
    assert sum(_serving_tokens(first).values()) == 90  # the budget less the floor
    seen = 2
    for _ in range(3):
        out = eng.step()
        got = sum(s.num_new_tokens for s in out.scheduled if s.req is chunked)
        assert got == min(10, 25 - seen) and sum(_serving_tokens(out).values()) == 100 - got
        seen += got
    assert seen == 25
    out = eng.step()
    assert sum(_serving_tokens(out).values()) == 100  # nothing bulk left: no floor held back


def test_bulk_min_tokens_is_checked():
    with pytest.raises(ValueError, match="bulk_min_tokens"):
        SchedulerConfig(bulk_min_tokens=-1)
    with pytest.raises(ValueError, match="bulk_min_tokens"):
        SchedulerConfig(max_num_batched_tokens=64, bulk_min_tokens=65)
    with pytest.raises(ValueError, match="bulk_min_tokens"):
        SchedulerConfig(bulk_step_tokens=8, bulk_min_tokens=16)
    assert SchedulerConfig(bulk_step_tokens=16, bulk_min_tokens=16).bulk_min_tokens == 16


def test_bulk_is_not_a_pending_kind_and_puts_no_target_at_risk():
    """The policies never see bulk: no share of a split, no reserved sequence slot, no latency target at risk from
    an old bulk arrival."""
    eng = _engine("orthrus", min_share=0.5, seqs=8)
    for i in range(3):
        eng.add(_bulk(make_request(f"b{i}", "embed", 500)))
    eng.add(make_request("g0", "generate", 300))
    sched = eng.scheduler
    assert sched.pending(embed=True) == [] and [r.req_id for r in sched.pending_bulk()] == ["b0", "b1", "b2"]
    assert sched.policy.reserved_seqs(sched) == 0
    embed, prefill = _split_step(eng)
    assert (embed, prefill) == (0, 100)  # the prompt takes the whole step: bulk gets what it leaves (nothing)


def test_blocks_go_from_bulk_to_serving_never_the_other_way():
    """Short of KV blocks, a serving request preempts a bulk one before any newer serving one, and a bulk request
    never takes blocks from serving work; while a waiting serving request finds no blocks, no bulk one is admitted."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_chunk_tokens=64, max_num_seqs=16, policy="orthrus")
    eng = FakeEngine(cfg, num_blocks=12, block_size=16)  # 192 KV slots
    bulk_gen = make_request("bulk", "generate", 60, max_tokens=40)
    bulk_gen.sampling_params.priority = 1
    eng.add(bulk_gen)
    for _ in range(3):
        eng.step()
    assert bulk_gen.is_decoding and bulk_gen in eng.scheduler.running
    # the two serving generations fit the cache together (2 x 4 blocks), not beside the bulk one (7 blocks)
    first, second = make_request("s0", "generate", 30, max_tokens=20), make_request("s1", "generate", 30,
                                                                                    max_tokens=20)
    eng.add(first)
    eng.add(second)
    preempted = []
    for _ in range(200):
        out = eng.step()
        preempted += [r.req_id for r in out.preempted]
        if first.is_finished and second.is_finished:
            break
    assert first.is_finished and second.is_finished
    assert preempted and set(preempted) == {"bulk"}  # only the bulk generation gave its blocks back
    late = _bulk(make_request("late", "embed", 200))  # needs blocks while the bulk generation catches up
    eng.add(late)
    for _ in range(300):
        if not eng.scheduler.has_unfinished():
            break
        eng.step()
    assert bulk_gen.is_finished and late.is_finished


def test_no_bulk_request_is_admitted_while_a_serving_one_waits_for_blocks():
    cfg = SchedulerConfig(max_num_batched_tokens=128, max_chunk_tokens=64, max_num_seqs=16, policy="orthrus")
    eng = FakeEngine(cfg, num_blocks=8, block_size=16)
    eng.add(make_request("g0", "generate", 96, max_tokens=30))  # 6 of the 8 blocks once its prompt is in
    eng.step()
    eng.step()
    big = make_request("big", "generate", 64, max_tokens=4)  # its first chunk needs 4 blocks: 2 are free
    eng.add(big)
    doc = _bulk(make_request("doc", "embed", 20))  # one chunk: no blocks of its own
    eng.add(doc)
    out = eng.step()
    assert big not in [s.req for s in out.scheduled] and not doc.is_finished
    for _ in range(60):
        if not eng.scheduler.has_unfinished():
            break
        eng.step()
    assert big.is_finished and doc.is_finished


def test_scored_pairs_and_embeddings_alternate_in_the_embedding_queue():
    """A rerank call's burst of pairs does not queue every embedding behind it: waiting pairs and embeddings
    alternate, each kind in its own arrival order (a pair is embedding work: the same lane)."""
    from orthrus_rag.engine.core.request import Request, RequestKind

    eng = _engine("orthrus")
    pairs = [Request(f"s{i}", RequestKind.SCORE, list(range(1, 40)), pooling_params=PoolingParams(pooling="last"))
             for i in range(4)]
    embeds = [make_request(f"e{i}", "embed", 10) for i in range(2)]
    for r in pairs + embeds:
        eng.add(r)
    assert [r.req_id for r in eng.scheduler.pending(embed=True)] == ["e0", "s0", "e1", "s1", "s2", "s3"]
    eng.run([])
    assert all(r.is_finished for r in pairs + embeds)
