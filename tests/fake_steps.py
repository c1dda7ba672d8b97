"""A model-free engine loop for scheduler and block-manager tests (vLLM's pattern: fake runner outputs).

`FakeEngine.step()` is `Engine.step()` with the runner replaced by made-up outputs: every scheduled request's
`num_computed_tokens` advances by its chunk; a generating request whose known tokens are all computed
"samples" a fake token and finishes at `max_tokens`; an embedding finishes with its last chunk; an encoder
request finishes the step it runs. With a `clock` (a cost model taken as the truth), time passes: each step lasts
what the clock predicts for its shape, requests arrive at the clock's time and each sampled token's time is kept
(`token_times`), so latency targets can be checked. Every step is checked against the scheduler's and block manager's
contracts (`check_schedule`), so a property test only has to drive requests through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.block_manager import BlockManager
from orthrus_rag.engine.core.request import Request, RequestKind, RequestStatus
from orthrus_rag.engine.core.scheduler import Scheduler
from orthrus_rag.engine.core.step_output import SchedulerOutput
from orthrus_rag.engine.core.step_cost import StepCostModel
from orthrus_rag.params import PoolingParams, SamplingParams

KINDS = ("generate", "embed", "encoder")
FAKE_TOKEN_BASE = 10_000


def fake_token(index: int) -> int:
    """The `index`-th sampled token of any request (deterministic, so recompute is checkable)."""
    return FAKE_TOKEN_BASE + index


def make_request(req_id: str, kind: str, num_tokens: int, max_tokens: int = 1) -> Request:
    prompt = [(7 * i + len(req_id)) % 1000 for i in range(num_tokens)]
    if kind == "generate":
        return Request(req_id, RequestKind.GENERATE, prompt, sampling_params=SamplingParams(max_tokens=max_tokens))
    assert kind in ("embed", "encoder"), kind
    return Request(req_id, RequestKind.EMBED, prompt, pooling_params=PoolingParams(), on_encoder=kind == "encoder")


def kind_key(req: Request) -> str:
    return "encoder" if req.on_encoder else req.kind.value


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_blocks_needed(req: Request, block_size: int) -> int:
    """Blocks `req` holds at its peak when run alone: the last sampled token and an embedding's last chunk
    write no KV (an embedding's last chunk may be a single token)."""
    if req.on_encoder:
        return 0
    if req.is_embed:
        return blocks_for(req.num_prompt_tokens - 1, block_size)
    assert req.sampling_params is not None
    return blocks_for(req.num_prompt_tokens + req.sampling_params.max_tokens - 1, block_size)


def encoder_cost(req: Request, cfg: SchedulerConfig) -> int:
    """Budget cost of a whole encoder request: its tokens weighted by `encoder_token_weight`."""
    return max(1, math.ceil(req.encoder_tokens * cfg.encoder_token_weight))


def step_bound(reqs: Sequence[Request]) -> int:
    """The step limit `Engine.run_until_done` uses: a loop past it counts as stuck."""
    return 10 + 4 * sum(r.num_tokens + (r.sampling_params.max_tokens if r.sampling_params else 0) for r in reqs)


@dataclass
class FakeRunnerOutput:
    sampled: dict = field(default_factory=dict)
    embeddings: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)
    prompt_logprobs: dict = field(default_factory=dict)


def _stop_at_max_tokens(req: Request) -> str | None:
    assert req.sampling_params is not None
    return "length" if len(req.output_token_ids) >= req.sampling_params.max_tokens else None


@dataclass
class _Before:
    """What the scheduler's state looked like before `schedule()`."""

    running: list[Request]
    decodes: list[Request]
    table_lens: dict[int, int]
    reserved: int = 0  # sequence slots the policy kept from decodes (for pending embeddings)
    yielded: frozenset[str] = frozenset()  # ids of the decodes that sat out the previous step


class FakeEngine:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 cost_model: StepCostModel | None = None, clock: StepCostModel | None = None) -> None:
        self.clock = clock
        self.now = 0.0  # seconds on the clock (stays 0 without one)
        self.token_times: dict[str, list[float]] = {}  # req_id -> when each output token was sampled (clock)
        self.block_manager = BlockManager(num_blocks, block_size)
        # NOTE: as the engine (engine.py): a model given for latency targets alone bounds steps by them only; else
        # the cost budget's own rule applies
        margin = config.cost_budget if config.cost_budget is not None else not config.slo.bounds_step_time
        self.scheduler = Scheduler(config, self.block_manager, _stop_at_max_tokens, cost_model, decode_margin=margin)
        self.requests: list[Request] = []  # every request ever added, in arrival order
        self.admitted: list[Request] = []  # in order of first admission
        self.chunks: dict[str, list[tuple[int, int]]] = {}  # req_id -> [(num_computed_tokens before, n)]
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_yielded: list[Request] = []  # the decodes that sat out the latest step (slo.yield_decodes)
        self.num_yielded = 0
        self.finished_at: dict[str, int] = {}  # req_id -> the step it finished in

    def __repr__(self) -> str:
        return (f"FakeEngine({self.scheduler.config}, num_blocks={self.block_manager.num_blocks}, "
                f"block_size={self.block_manager.block_size})")

    # ---- the loop -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        # NOTE: as in the real engine, a request arrives when it is added (not when the test built it)
        req.arrival_time = self.now if self.clock is not None else float(len(self.requests))
        self.requests.append(req)
        self.scheduler.add(req)

    def abort(self, req: Request) -> None:
        if not req.is_finished:
            self.scheduler.remove(req)
            req.status, req.finish_reason = RequestStatus.ABORTED, "abort"
            check_blocks(self)

    def step(self) -> SchedulerOutput:
        before = _Before(running=list(self.scheduler.running),
                         decodes=[r for r in self.scheduler.running if r.is_decoding],
                         table_lens={id(r): len(r.block_table) for r in self.scheduler.running},
                         reserved=self.scheduler.policy.reserved_seqs(self.scheduler),
                         yielded=frozenset(r.req_id for r in self.last_yielded))
        out = self.scheduler.schedule(self.now if self.clock is not None else None)
        check_schedule(self, out, before)
        self.last_yielded = list(out.yielded)
        self.num_yielded += len(out.yielded)
        self.num_preemptions += len(out.preempted)
        self._execute(out)
        self.num_steps += 1
        check_blocks(self)
        return out

    def _execute(self, out: SchedulerOutput) -> None:
        """A fake runner's output, applied by the scheduler as the real engine does."""
        seen = {id(r) for r in self.admitted}
        for req in [s.req for s in out.scheduled] + out.encoder:
            if id(req) not in seen:
                self.admitted.append(req)
        result = FakeRunnerOutput()
        for s in out.scheduled:
            req = s.req
            self.chunks.setdefault(req.req_id, []).append((req.num_computed_tokens, s.num_new_tokens))
            if req.num_computed_tokens + s.num_new_tokens < req.num_tokens:
                continue
            if req.is_embed:
                result.embeddings[req.req_id] = None
            else:
                result.sampled[req.req_id] = fake_token(len(req.output_token_ids))
        for req in out.encoder:
            result.embeddings[req.req_id] = None
        if self.clock is not None:
            self.now += self.clock.predict(out.shape())
            for rid in result.sampled:
                self.token_times.setdefault(rid, []).append(self.now)
        done = self.scheduler.update_from_output(out, result, self.now if self.clock is not None
                                                 else float(self.num_steps))
        for req in out.encoder:
            req.num_computed_tokens = req.num_tokens
        assert all(r.is_finished for r in done.finished)
        self.finished_at.update((r.req_id, self.num_steps) for r in done.finished)

    def run(self, arrivals: Sequence[tuple[int, Request, int | None]], max_steps: int | None = None) -> None:
        """Add each request at its step, abort it at its abort step (if still unfinished), step until idle.

        `arrivals`: (arrival step, request, abort step or None); an abort before arrival is ignored. Fails if a
        step schedules nothing while work is pending (the scheduler is deterministic, so it would stall
        forever) or the loop runs past the engine's step bound for every request, old and new.
        """
        pending = sorted(arrivals, key=lambda a: a[0])
        last_arrival = max((a[0] for a in pending), default=0)
        limit = max_steps if max_steps is not None else last_arrival + step_bound(
            [r for r in self.requests if not r.is_finished] + [a[1] for a in pending])
        aborts = [(a[2], a[1]) for a in pending if a[2] is not None]
        i = 0
        for step in range(limit + 1):
            while i < len(pending) and pending[i][0] <= step:
                self.add(pending[i][1])
                i += 1
            for abort_step, req in aborts:
                if abort_step == step and any(r is req for r in self.requests):
                    self.abort(req)
            if not self.scheduler.has_unfinished():
                if i == len(pending):
                    return
                continue
            out = self.step()
            assert not out.is_empty, f"step {step} scheduled nothing with work pending: the loop would stall"
        raise AssertionError(f"requests unfinished after {limit} steps (a request waits forever)")


# ---- contracts ---------------------------------------------------------------------------------------------
def check_ownership(eng: FakeEngine) -> None:
    """Every block is either free or owned by exactly one request."""
    bm = eng.block_manager
    free = list(bm.free_blocks)
    owned = [b for r in eng.requests for b in r.block_table]
    assert len(set(free)) == len(free), "a block is free twice"
    assert len(set(owned)) == len(owned), "a block is owned by two requests (or twice by one)"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert len(owned) + len(free) == bm.num_blocks, "a block leaked"
    assert set(owned) | set(free) == set(range(bm.num_blocks))


def check_blocks(eng: FakeEngine) -> None:
    """Between steps: ownership, no state on waiting or finished requests, running ones hold exactly
    ceil(num_computed_tokens / block_size) blocks."""
    check_ownership(eng)
    bs = eng.block_manager.block_size
    for r in eng.requests:
        if r.is_finished:
            assert not r.block_table, f"{r.req_id} finished but holds blocks"
    for r in eng.scheduler.waiting:
        assert r.status is RequestStatus.WAITING
        assert r.num_computed_tokens == 0 and not r.block_table, f"{r.req_id} waits with state"
    for r in eng.scheduler.running:
        assert r.status is RequestStatus.RUNNING and not r.on_encoder
        # KV slots for exactly the computed tokens (all of a running request's computed tokens are in the cache)
        assert len(r.block_table) == blocks_for(r.num_computed_tokens, bs), r.req_id


def check_schedule(eng: FakeEngine, out: SchedulerOutput, before: _Before) -> None:
    cfg, bs = eng.scheduler.config, eng.block_manager.block_size
    ids = [id(s.req) for s in out.scheduled] + [id(r) for r in out.encoder]
    assert len(set(ids)) == len(ids), "a request is scheduled twice in one step"
    check_ownership(eng)
    running_ids = {id(r) for r in eng.scheduler.running}
    preempted_ids = {id(r) for r in out.preempted}

    # budget: decoder tokens plus weighted encoder tokens; a single oversized encoder request may overdraw it (alone,
    # or beside the decoder tokens, which stay within it)
    decoder = sum(s.num_new_tokens for s in out.scheduled)
    cost = decoder + sum(encoder_cost(r, cfg) for r in out.encoder)
    lone_encoder = (len(out.encoder) == 1 and encoder_cost(out.encoder[0], cfg) > cfg.max_num_batched_tokens
                    and decoder <= cfg.max_num_batched_tokens)
    assert cost <= cfg.max_num_batched_tokens or lone_encoder, f"budget exceeded: {cost}"
    assert cost <= eng.scheduler.step_cap or lone_encoder, f"step budget exceeded: {cost}"
    assert len(out.scheduled) + len(out.encoder) <= cfg.max_num_seqs

    for s in out.scheduled:
        req, n = s.req, s.num_new_tokens
        assert not req.on_encoder and id(req) in running_ids and req.status is RequestStatus.RUNNING
        assert 1 <= n <= req.num_remaining_tokens, (req.req_id, n)
        assert n <= cfg.max_chunk_tokens
        kv = req.num_kv_tokens_after(n)
        assert len(req.block_table) * bs >= kv, f"{req.req_id}: KV slots missing"
        assert len(req.block_table) == blocks_for(kv, bs), f"{req.req_id}: blocks beyond its KV tokens"
        if req.is_embed and req.num_computed_tokens + n == req.num_tokens:
            if req.num_computed_tokens == 0:
                assert not req.block_table, "an embedding that fits in one chunk got blocks"
            if id(req) in before.table_lens and id(req) not in preempted_ids:
                assert len(req.block_table) == before.table_lens[id(req)], "an embedding's last chunk allocated"
    for req in out.encoder:
        assert req.on_encoder and not req.block_table and id(req) not in running_ids
        assert not any(w is req for w in eng.scheduler.waiting)
    for req in out.preempted:
        assert req.num_computed_tokens == 0 and req.pooler_state is None
        if id(req) not in ids:  # (it may be re-admitted in the same step, from scratch)
            assert not req.block_table and req.status is RequestStatus.WAITING
            assert any(w is req for w in eng.scheduler.waiting)

    # age priority: blocks are taken from bulk requests, then from newer ones only, so the oldest running serving
    # request (which fits the cache alone) is never preempted and cannot starve; a bulk request takes blocks only
    # from bulk ones
    serving = [r for r in before.running if not r.is_bulk]
    if serving:
        assert id(serving[0]) not in preempted_ids, f"oldest request {serving[0].req_id} preempted"

    # decodes first: every running decode gets its token while they all fit and nothing was preempted, except one
    # that yields to an embedding at risk (slo.yield_decodes): never two steps running, and then not scheduled
    yielded = {id(r) for r in out.yielded}
    for r in out.yielded:
        assert r.is_decoding and r.req_id not in before.yielded, f"decode {r.req_id} yielded two steps running"
    sched = {id(s.req): s.num_new_tokens for s in out.scheduled}
    # (unified-homo: only in its generation steps; its embedding steps run no decode by design)
    embed_step = any(s.req.is_embed for s in out.scheduled) or bool(out.encoder)
    homo_embed_step = eng.scheduler.policy.name == "unified-homo" and embed_step
    if homo_embed_step:
        assert not any(not s.req.is_embed for s in out.scheduled), "unified-homo step mixed the kinds"
    if (not out.preempted and not homo_embed_step
            and len(before.decodes) <= min(cfg.max_num_batched_tokens, cfg.max_num_seqs - before.reserved)):
        for d in before.decodes:
            assert sched.get(id(d), 0) >= 1 or id(d) in yielded, f"running decode {d.req_id} skipped a step"
    assert not any(id(s.req) in yielded for s in out.scheduled), "a yielding decode was scheduled"
