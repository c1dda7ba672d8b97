"""Token-budget scheduler: who runs this step and with how many tokens. Never touches tensors.

Order per step: running decodes (one token each), then the residual budget shared by the policy
(orthrus_rag.engine.core.policies) between embedding and prompt work, in-flight chunked requests before new ones of
their kind, each chunked to fill what is left (`max_chunk_tokens` caps a chunk), then bulk requests (priority > 0:
an ingest while serving) on whatever budget and sequence slots are still left.
Encoder requests (separate bidirectional model) run whole; their tokens cost `encoder_token_weight` each.
When KV blocks run out, the newest running request is preempted (recompute).

After a step, `update_from_output` is the one place that applies its outcome (vLLM's `update_from_output`,
nano-vllm's `postprocess`): computed tokens, prefix-cache registration, sampled tokens and stop checks,
finished requests leaving the queues and freeing their blocks. The engine only turns the result into outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.block_manager import BlockManager
from orthrus_rag.engine.core.policies import Policy, SchedulerQueues, make_policy
from orthrus_rag.engine.core.request import Request, RequestKind, RequestStatus
from orthrus_rag.engine.core.step_cost import StepCostModel
from orthrus_rag.engine.core.step_output import ScheduledRequest, SchedulerOutput, StepResult
from orthrus_rag.engine.core.step_sizing import StepSizer


class Scheduler(SchedulerQueues):
    """The queues (`SchedulerQueues`, what the policies read) and the registry of live requests; schedules each
    step and applies its outcome."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 stop_checker: Callable[[Request], str | None] | None = None,
                 cost_model: StepCostModel | None = None, decode_margin: bool = True) -> None:
        super().__init__(config)
        self.block_manager = block_manager
        # after a sampled token is appended: a finish reason or None (engine/text_io.py); None: never stops
        self.stop_checker = stop_checker or (lambda req: None)
        self.policy: Policy = make_policy(config.policy, config.min_share)
        # the step-time model sizes steps only for a policy that asks for it (the baselines keep token budgets)
        # (config.cost_budget None: the engine passes a model only where it applies: on CUDA, or for a latency
        # target that bounds step time)
        self._cap = config.max_num_batched_tokens  # this step's budget (<= max_num_batched_tokens)
        self._admission_blocked = False
        self._yielded: set[str] = set()  # ids of the decodes that sat out the previous step: not two in a row
        # the step's time bound and token cap from the cost model and latency targets (step_sizing.py)
        self.sizing = StepSizer(config, cost_model if config.cost_budget is not False
                                and self.policy.sizes_steps_by_cost else None, self.targets, decode_margin)
        if self.targets is not None:  # NOTE: read when asked: the engine may set the model after (cost_model)
            self.targets.cost_model = lambda: self.sizing.cost_model
        # every unfinished request by id: the one registry of request state (waiting, running, handed off)
        self.requests: dict[str, Request] = {}

    @property
    def cost_model(self) -> StepCostModel | None:
        """The step-time model that sizes steps and learns from them (one object: step_sizing.py holds it)."""
        return self.sizing.cost_model

    @cost_model.setter
    def cost_model(self, model: StepCostModel | None) -> None:
        self.sizing.cost_model = model

    def add(self, req: Request) -> None:
        self._register(req)
        self.waiting.append(req)
        # NOTE: an `auto` embedding target is predicted from embeddings' lengths; a scored pair (another model, or
        # the backbone) is not one
        if self.targets is not None and req.kind is RequestKind.EMBED and not req.is_bulk:
            self.targets.note_embedding(req)

    def _register(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req

    def reserve_blocks(self, req: Request) -> bool:
        """Blocks for the tokens `req` already has computed elsewhere (a handed-over request), if free."""
        if not self.block_manager.can_allocate(req, 0):
            return False
        self.block_manager.allocate(req, 0)
        return True

    def add_running(self, req: Request) -> None:
        """Admit a decoding request whose KV is already in its blocks (handed over from another engine) straight
        to the running list: it gets one token per step from the next step on."""
        assert req.is_decoding, "add_running() takes a request with only its last sampled token to compute"
        assert len(req.block_table) * self.block_manager.block_size >= req.num_computed_tokens, "KV without blocks"
        self._register(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and return its blocks."""
        self.requests.pop(req.req_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)

    def finish(self, req: Request, reason: str, now: float, status: RequestStatus = RequestStatus.FINISHED) -> None:
        req.status, req.finish_reason, req.finished_time = status, reason, now
        if req.is_continuable:  # NOTE: before its blocks are freed: the cached ones stay pinned for its continuation
            self.block_manager.hold(req.req_id, req, now + req.sampling_params.hold_kv_s)
        self.remove(req)

    def release(self, req: Request, now: float) -> None:
        """A handed-off request: the engine has copied its KV; it leaves this engine."""
        self.finish(req, "handoff", now)

    # ---- after a step ----------------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, output: Any, now: float,
                           step_time: float | None = None) -> StepResult:
        """Apply an executed step (`output`: the runner's RunnerOutput, `step_time`: its measured seconds) to
        the requests it ran."""
        result = StepResult()
        if self.cost_model is not None and step_time is not None:
            self.cost_model.observe(sched.shape(), step_time)
        for s in sched.scheduled:
            if s.req.req_id in output.prompt_logprobs:
                _record_prompt_logprobs(s.req, *output.prompt_logprobs[s.req.req_id])
            s.req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_computed(s.req)  # NOTE: before finished requests free their blocks
        for req in [s.req for s in sched.scheduled] + sched.encoder:
            rid = req.req_id
            if rid in output.embeddings or rid in output.errors:
                if rid in output.errors:
                    result.errors[rid] = output.errors[rid]
                else:
                    result.embeddings[rid] = output.embeddings[rid]
                self.finish(req, "error" if rid in output.errors else "stop", now)
                result.finished.append(req)
            elif rid in output.sampled:
                req.output_token_ids.append(output.sampled[rid])
                if rid in output.logprobs:
                    req.output_logprobs.append(output.logprobs[rid])
                req.first_token_time = req.first_token_time or now
                if req.last_token_time is not None:
                    result.decode_gaps.append(now - req.last_token_time)
                req.last_token_time = now
                reason = self.stop_checker(req)
                if reason is not None:
                    self.finish(req, reason, now)
                    result.finished.append(req)
                elif req.handoff:
                    result.handoffs.append(req)
                elif req.stream:
                    result.streamed.append(req)
        return result

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Preemption by recompute: free the blocks, back to the head of the queue. A victim already given a
        chunk this step loses it (its tokens go back to the budget)."""
        for i, s in enumerate(out.scheduled):
            if s.req is victim:
                out.num_batched_tokens -= s.num_new_tokens
                out.budget_used -= s.num_new_tokens
                del out.scheduled[i]
                break
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _victim(self, req: Request) -> Request:
        """Whose blocks `req` takes: the newest bulk request while there is one (bulk work never holds blocks that
        serving work needs), else the newest running request; a bulk request takes only from bulk ones (the newest,
        perhaps itself), never from serving ones."""
        bulk = next((r for r in reversed(self.running) if r.is_bulk), None)
        if bulk is not None or req.is_bulk:
            return bulk if bulk is not None else req
        return self.running[-1]

    def _schedule_running(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Give blocks to a running request, preempting bulk requests first, then the newest running requests (newer
        than `req`: blocks only flow from newer to older, so the oldest serving request always progresses); False
        if `req` itself was preempted."""
        # NOTE: decodes are scheduled before older in-flight prefills, so a victim may already be in this step
        if not req.is_bulk:  # NOTE: serving work takes a finished generation's held KV before a running one's
            self.block_manager.reclaim(req, num_new)
        while not self.block_manager.can_allocate(req, num_new):
            victim = self._victim(req)
            self._preempt(victim, out)
            if victim is req:
                return False
        self.block_manager.allocate(req, num_new)
        out.scheduled.append(ScheduledRequest(req, num_new))
        out.num_batched_tokens += num_new
        out.budget_used += num_new
        return True

    # ---- the step --------------------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """This step's work; `now` is the clock latency targets count against (time.monotonic(), as the requests'
        arrival times)."""
        self.now = time.monotonic() if now is None else now
        self.block_manager.expire_holds(self.now)
        self._pending = {}
        try:
            return self._schedule_step()
        finally:
            self._pending = None

    def _schedule_step(self) -> SchedulerOutput:
        allow_embed, allow_generate = self.policy.step_kinds(self)
        out = self._schedule(allow_embed, allow_generate)
        if out.is_empty and self.has_unfinished():
            # NOTE: the kind the policy chose could not run (no free blocks for it, or its only request was just
            # preempted): do not waste the step; a one-kind step switches kinds, a mixed one retries
            preempted = out.preempted
            if allow_embed != allow_generate:
                allow_embed, allow_generate = allow_generate, allow_embed
            out = self._schedule(allow_embed, allow_generate, reserve=False)
            out.preempted = preempted + out.preempted
        self._yielded = {r.req_id for r in out.yielded}
        return out

    def _schedule(self, allow_embed: bool, allow_generate: bool, reserve: bool = True) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        self._pending = {}
        self._admission_blocked = False  # a waiting serving request found no free blocks this step (_fill)
        self._cap = cfg.max_num_batched_tokens
        # 1. decodes: one token each, leaving the sequence slots the policy reserves for the other kind
        if allow_generate:
            max_decodes = cfg.max_num_seqs - (self.policy.reserved_seqs(self) if reserve else 0)
            # NOTE: bulk decodes last: they take what slots and budget the serving ones leave
            decodes = [r for r in self.running if r.is_decoding]
            decodes = [r for r in decodes if not r.is_bulk] + [r for r in decodes if r.is_bulk]
            if allow_embed and self.targets is not None:
                out.yielded = self.sizing.yielding_decodes(decodes[:max_decodes], self.pending(embed=True),
                                                           self.pending(embed=False), self._yielded, self.running,
                                                           self.now)
                sitting = {id(r) for r in out.yielded}
                decodes = [r for r in decodes if id(r) not in sitting]
            for req in decodes:
                if self._budget_left(out) < 1 or len(out.scheduled) >= max_decodes:
                    break
                if req in self.running:
                    self._schedule_running(req, 1, out)
        self._pending = {}  # decodes may have preempted: the lanes see the queues as they are now
        self._cap = self.policy.step_cap(self, self.sizing.cap(out, self.running), out.budget_used)
        self.horizon = self.sizing.horizon(out, self._cap, lambda: self.remaining_cost(self.pending(embed=True))
                                           + self.remaining_cost(self.pending(embed=False))
                                           + self.remaining_cost(self.pending_bulk()))
        # 2. the residual budget, shared by the policy's lanes, then whatever is left to anyone (work-conserving);
        # `bulk_min_tokens` of it held back from both while bulk work waits (its floor: step 3 spends it)
        allowed = {True: allow_embed, False: allow_generate}
        bulk = [r for r in self.pending_bulk() if allowed[r.is_embed]] if cfg.bulk_min_tokens else []
        reserve = min(cfg.bulk_min_tokens, self.remaining_cost(bulk), self._budget_left(out)) if bulk else 0
        self._cap -= reserve
        for lane in self.policy.lanes(self, self._budget_left(out)):
            self._fill([r for r in lane.candidates if allowed[r.is_embed]], lane.cap, out)
        self._fill([r for r in self.policy.fallback(self) if allowed[r.is_embed]], None, out)
        # NOTE: an encoder input may have raised the cap meanwhile (one that fits beside no decode): keep that
        self._cap = max(self._cap, min(self._cap + reserve, cfg.max_num_batched_tokens))
        # 3. bulk work (priority > 0: an ingest while serving) on what is still left; beside serving work, at most
        # `bulk_step_tokens` of it (a step's time grows with its tokens, so the leftover budget is not free)
        if not self._admission_blocked:  # NOTE: else a small bulk request would take blocks a waiting one needs
            serving = any(not s.req.is_bulk for s in out.scheduled) or any(not r.is_bulk for r in out.encoder)
            self._fill([r for r in self.pending_bulk() if allowed[r.is_embed]],
                       cfg.bulk_step_tokens if serving else None, out)
        if self.targets is not None:
            out.embed_at_risk, out.generate_at_risk = self.at_risk(embed=True), self.at_risk(embed=False)
        if self.cost_model is not None:
            out.predicted_s = self.cost_model.predict(out.shape())
        return out

    def _top_up(self, req: Request, left: int, out: SchedulerOutput) -> None:
        s = next((s for s in out.scheduled if s.req is req), None)
        if s is None:  # an encoder request: never split, nothing to add
            return
        extra = min(req.num_remaining_tokens - s.num_new_tokens, self.config.max_chunk_tokens - s.num_new_tokens,
                    left)
        if extra < 1 or not self.block_manager.can_allocate(req, s.num_new_tokens + extra):
            return
        self.block_manager.allocate(req, s.num_new_tokens + extra)
        self.block_manager.trim(req, s.num_new_tokens + extra)
        s.num_new_tokens += extra
        out.num_batched_tokens += extra
        out.budget_used += extra

    @property
    def step_cap(self) -> int:
        """The budget of the step being (or last) scheduled: max_num_batched_tokens, or less when the step-cost
        model sized a step that carries decodes."""
        return self._cap

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self._cap - out.budget_used

    def _fill(self, candidates: list[Request], cap: int | None, out: SchedulerOutput) -> None:
        """Chunk candidates in order into at most `cap` budget tokens. In-flight requests continue (and may
        preempt newer ones for blocks); waiting ones are admitted only while blocks are free and no preemption
        happened this step (vLLM v1: a victim re-admitted at once would only be preempted again)."""
        cfg = self.config
        scheduled = {id(s.req) for s in out.scheduled} | {id(r) for r in out.encoder}
        used = 0
        admit = not out.preempted  # once one waiting request cannot start, no later one may (FCFS)
        for req in candidates:
            left = self._budget_left(out) if cap is None else min(self._budget_left(out), cap - used)
            if left < 1 or len(out.scheduled) + len(out.encoder) >= cfg.max_num_seqs:
                break
            if req.is_finished:
                continue
            if id(req) in scheduled:
                if cap is None:  # the work-conserving pass may lengthen a chunk already in this step
                    self._top_up(req, left, out)
                continue
            if req.on_encoder:
                if not admit:
                    continue
                cost = self._encoder_cost(req)
                # NOTE: an encoder request never splits. The first of a lane may overdraw the lane's cap (else a
                # small share could never fit it); one that exceeds the whole budget (a long pair on a large
                # cross-encoder) runs as the step's only encoder request, beside the decodes already in it: waiting
                # for a step of its own would starve it under a steady stream of generations.
                time_fit = self.sizing.encoder_time_fit(req, out)
                if time_fit is None:
                    # NOTE: it can never fit beside decodes: it runs as the step's only encoder request, over the
                    # time target, rather than wait for a step without decodes that a steady stream of generations
                    # may never leave (the token budget still holds)
                    fits = not out.encoder and out.budget_used + cost <= cfg.max_num_batched_tokens
                    if fits:
                        self._cap = max(self._cap, out.budget_used + cost)
                else:
                    fits = time_fit and (cost <= left or (used == 0 and cost <= self._budget_left(out)))
                if not fits and not (not out.encoder and cost > cfg.max_num_batched_tokens):
                    admit = False
                    continue
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                out.encoder.append(req)
                out.num_batched_tokens += req.num_tokens
                out.budget_used += cost
                used += cost
                self._cap = self.sizing.cap_after_encoder(out, self._cap)
                continue
            if req in self.running:
                num_new = min(req.num_remaining_tokens, left, cfg.max_chunk_tokens)
                if self._schedule_running(req, num_new, out):
                    used += num_new
                continue
            if not admit or out.preempted:  # NOTE: a victim of this step waits for the next one
                continue
            self.block_manager.match_prefix(req)  # a cached prompt prefix counts as computed
            num_new = min(req.num_remaining_tokens, left, cfg.max_chunk_tokens)
            if not req.is_bulk:
                self.block_manager.reclaim(req, num_new)
            if not self.block_manager.can_allocate(req, num_new):
                self.block_manager.unmatch(req)
                admit = False  # in-flight requests later in the list still continue
                self._admission_blocked = self._admission_blocked or not req.is_bulk
                continue
            self.block_manager.allocate(req, num_new)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            out.num_batched_tokens += num_new
            out.budget_used += num_new
            used += num_new


def _record_prompt_logprobs(req: Request, first: int, scored: list) -> None:
    """Append a step's prompt log-probabilities (positions `first`, `first` + 1, ...) to those `req` has
    (positions 1 .. len): a request recomputed after preemption scores its prompt again, kept once."""
    have = len(req.prompt_logprobs)
    if first <= have + 1:
        req.prompt_logprobs.extend(scored[have + 1 - first:])
