"""Scheduler contracts on CPU with fake runner outputs (vLLM's pattern; DESIGN.md, "Scheduler").

Checked every step by FakeEngine (tests/fake_steps.py): the token budget (encoder tokens weighted), the
sequence cap, the chunk cap, decodes first, block coverage, age priority in preemption (the oldest running
request is never preempted); here on top: FCFS within a kind, termination within the engine's step bound,
and that preempted requests restart from scratch and still complete.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.policies import POLICIES
from orthrus_rag.engine.core.request import Request, RequestStatus
from tests.fake_steps import FakeEngine, fake_token, kind_key, make_request, max_blocks_needed


def _cfg(budget: int, seqs: int = 64, chunk: int | None = None, weight: float = 0.25,
         policy: str = "orthrus") -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_chunk_tokens=chunk or budget,
                           encoder_token_weight=weight, policy=policy)


def _check_completed(eng: FakeEngine) -> None:
    """Every request not aborted finished with all its tokens; nothing is left anywhere."""
    for r in eng.requests:
        assert r.is_finished and not r.block_table, r.req_id
        if r.status is RequestStatus.ABORTED:
            continue
        if r.is_embed:
            assert r.num_computed_tokens == r.num_tokens
        else:
            assert r.sampling_params is not None
            max_tokens = r.sampling_params.max_tokens
            assert r.output_token_ids == [fake_token(i) for i in range(max_tokens)]
            assert r.num_computed_tokens == r.num_prompt_tokens + max_tokens - 1  # the last token is never run
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def _check_fcfs(eng: FakeEngine) -> None:
    """Within each kind, requests start in arrival order (re-admission after preemption aside)."""
    arrival = {id(r): i for i, r in enumerate(eng.requests)}
    for kind in {kind_key(r) for r in eng.requests}:
        started = [arrival[id(r)] for r in eng.admitted if kind_key(r) == kind]
        assert started == sorted(started), f"{kind} requests started out of arrival order"


def _check_restarts(eng: FakeEngine) -> None:
    """A request's chunks are contiguous, except that after a preemption it starts again at token 0."""
    for r in eng.requests:
        chunks = eng.chunks.get(r.req_id, [])
        restarts = sum(1 for start, _ in chunks[1:] if start == 0)
        assert restarts <= r.num_preemptions
        for (s0, n0), (s1, _) in zip(chunks, chunks[1:]):
            assert s1 in (s0 + n0, 0)


# ---- property tests ------------------------------------------------------------------------------------------
@st.composite
def workloads(draw: st.DrawFn) -> tuple[FakeEngine, list]:
    block_size = draw(st.sampled_from([4, 16]))
    arrivals = []
    for i in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["generate", "generate", "embed", "embed", "encoder"]))
        req = make_request(f"r{i}", kind, draw(st.integers(1, 200)), draw(st.integers(1, 20)))
        arrival = draw(st.integers(0, 12))
        abort_step = arrival + draw(st.integers(0, 60)) if draw(st.integers(0, 4)) == 0 else None
        arrivals.append((arrival, req, abort_step))
    need = max(1, *(max_blocks_needed(r, block_size) for _, r, _ in arrivals))
    num_blocks = need + draw(st.integers(0, 3 * need))
    budget = draw(st.integers(1, 128))
    cfg = _cfg(budget, seqs=draw(st.integers(1, 8)), chunk=draw(st.integers(1, 2 * budget)),
               weight=draw(st.sampled_from([0.1, 0.25, 1.0, 2.0])), policy=draw(st.sampled_from(list(POLICIES))))
    return FakeEngine(cfg, num_blocks, block_size), arrivals


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_mixes_respect_budget_fcfs_and_finish(workload: tuple[FakeEngine, list]) -> None:
    """Per step: budget, max_num_seqs, chunk cap, decodes first, block coverage (FakeEngine.step); overall:
    FCFS per kind, every request finishes with all its tokens within the engine's step bound, preempted
    requests restart from token 0."""
    eng, arrivals = workload
    eng.run(arrivals)  # raises if a step schedules nothing with work pending or the step bound is passed
    event("preempted" if eng.num_preemptions else "no preemption")
    event(eng.scheduler.policy.name)
    _check_completed(eng)
    _check_fcfs(eng)
    _check_restarts(eng)
    if not eng.num_preemptions:
        # without recompute every step does new work: at most one step per token to run
        work = sum(r.num_tokens - (0 if r.is_embed else 1) for r in eng.requests)
        assert eng.num_steps <= work


# ---- deterministic scenarios ---------------------------------------------------------------------------------
def test_cache_pressure_preempts_newest_and_reruns_it_from_scratch() -> None:
    """Two 8-token prompts fill a 4-block cache; A's first decode needs a 3rd block, so B (newer) is
    preempted: reset to no computed tokens and no blocks, back at the head of the queue, its sampled token
    kept. B is recomputed from token 0 (prompt plus that token) once A is done, and completes."""
    eng = FakeEngine(_cfg(64), num_blocks=4, block_size=4)
    a, b = make_request("A", "generate", 8, 8), make_request("B", "generate", 8, 8)
    eng.add(a)
    eng.add(b)
    out = eng.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("A", 8), ("B", 8)]
    assert eng.block_manager.num_free_blocks == 0

    out = eng.step()
    assert out.preempted == [b]
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("A", 1)]
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and eng.scheduler.waiting[0] is b
    assert b.output_token_ids == [fake_token(0)]  # recompute keeps the tokens, forgets the cache
    assert len(a.block_table) == 3

    eng.run([])
    assert eng.chunks["B"][0] == (0, 8) and eng.chunks["B"][1] == (0, 9)  # re-run from scratch
    assert eng.chunks["B"][2:] == [(9 + i, 1) for i in range(6)]
    assert eng.admitted == [a, b]
    _check_completed(eng)


def test_decodes_get_a_token_every_step_and_prefill_fills_the_rest() -> None:
    eng = FakeEngine(_cfg(8), num_blocks=64, block_size=4)
    gens = [make_request(f"g{i}", "generate", 2, 10) for i in range(3)]
    for g in gens:
        eng.add(g)
    eng.step()  # three 2-token prompts
    emb = make_request("e", "embed", 40)
    eng.add(emb)
    for _ in range(5):
        out = eng.step()
        assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [
            ("g0", 1), ("g1", 1), ("g2", 1), ("e", 5)]
    eng.run([])
    _check_completed(eng)


def test_in_flight_chunks_continue_before_new_requests() -> None:
    eng = FakeEngine(_cfg(10), num_blocks=64, block_size=4)
    e1, e2 = make_request("e1", "embed", 25), make_request("e2", "embed", 25)
    eng.add(e1)
    eng.add(e2)
    plan = [[("e1", 10)], [("e1", 10)], [("e1", 5), ("e2", 5)], [("e2", 10)], [("e2", 10)]]
    for expected in plan:
        assert [(s.req.req_id, s.num_new_tokens) for s in eng.step().scheduled] == expected
    assert not eng.scheduler.has_unfinished()
    _check_completed(eng)


def test_chunk_cap_and_max_num_seqs() -> None:
    eng = FakeEngine(_cfg(100, seqs=2, chunk=7), num_blocks=64, block_size=16)
    reqs = [make_request(f"e{i}", "embed", 20) for i in range(3)]
    for r in reqs:
        eng.add(r)
    out = eng.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("e0", 7), ("e1", 7)]
    eng.run([])
    assert all(n <= 7 for chunks in eng.chunks.values() for _, n in chunks)
    _check_completed(eng)


def test_encoder_tokens_are_weighted_in_the_budget() -> None:
    """40 encoder tokens at weight 0.25 cost 10 of a 16-token budget: one runs, the next waits."""
    eng = FakeEngine(_cfg(16, weight=0.25), num_blocks=8, block_size=4)
    xs = [make_request(f"x{i}", "encoder", 40) for i in range(3)]
    for x in xs:
        eng.add(x)
    assert eng.step().encoder == [xs[0]]
    eng.run([])
    assert eng.admitted == xs
    _check_completed(eng)


def test_oversized_encoder_request_runs_alone() -> None:
    """An encoder request costing more than the whole budget is not stuck: it runs in a step of its own."""
    eng = FakeEngine(_cfg(8, weight=1.0), num_blocks=8, block_size=4)
    x, g = make_request("x", "encoder", 50), make_request("g", "generate", 4, 2)
    eng.add(x)
    eng.add(g)
    out = eng.step()
    assert out.encoder == [x] and not out.scheduled
    eng.run([])
    _check_completed(eng)


def test_oversized_encoder_request_runs_beside_a_stream_of_decodes() -> None:
    """An encoder request costing more than the whole budget is not starved by decodes that never leave a step
    empty: it runs as the step's only encoder request beside them."""
    eng = FakeEngine(_cfg(8, weight=1.0), num_blocks=16, block_size=4)
    g = make_request("g", "generate", 2, 30)
    eng.add(g)
    eng.step()
    x = make_request("x", "encoder", 50)
    eng.add(x)
    out = eng.step()
    assert out.encoder == [x] and [s.req for s in out.scheduled] == [g]
    eng.run([])
    _check_completed(eng)


def test_waiting_request_is_not_starved_by_arrivals() -> None:
    """A long prompt behind a stream of short generations still starts in arrival order and completes."""
    eng = FakeEngine(_cfg(16, seqs=4), num_blocks=12, block_size=4)
    arrivals: list[tuple[int, Request, int | None]] = [
        (step, make_request(f"s{step}", "generate", 3, 6), None) for step in range(0, 40, 2)]
    arrivals.insert(3, (5, make_request("long", "generate", 40, 4), None))
    eng.run(arrivals)
    _check_completed(eng)
    _check_fcfs(eng)


def test_oldest_request_is_not_starved_by_a_stream_of_newer_decodes() -> None:
    """A long prompt that fills most of the cache, then a steady stream of short generations: newer decodes
    must not take the long request's blocks, so it finishes while the stream is still arriving."""
    eng = FakeEngine(_cfg(16, seqs=8, chunk=8), num_blocks=20, block_size=4)
    long = make_request("long", "generate", 60, 4)
    stream = [(step, make_request(f"s{step}", "generate", 3, 20), None) for step in range(0, 300, 3)]
    eng.run([(0, long, None), *stream])
    assert long.num_preemptions == 0
    assert eng.finished_at["long"] < 60  # 60 prompt tokens at <= 8 a step, then 4 decodes; the stream runs to 300
    _check_completed(eng)
