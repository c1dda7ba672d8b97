"""Token-budget scheduler: who runs this step and with how many tokens. Never touches tensors.

Order per step: running decodes (one token each), then in-flight chunked requests, then waiting requests
chosen by the policy and chunked to fill what is left of the budget (`max_chunk_tokens` caps a chunk).
Encoder requests (separate bidirectional model) run whole; their tokens cost `encoder_token_weight` each.
When KV blocks run out, the newest running request is preempted (recompute).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.block_manager import BlockManager
from orthrus_rag.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decoder rows, in batch order
    encoder: list[Request] = field(default_factory=list)  # whole-sequence encoder requests
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.encoder


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # started decoder requests, oldest first

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and return its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)

    def _encoder_cost(self, req: Request) -> int:
        return max(1, math.ceil(req.num_tokens * self.config.encoder_token_weight))

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Preemption by recompute: free the blocks, back to the head of the queue. A victim already given a
        chunk this step loses it (its tokens go back to the budget)."""
        for i, s in enumerate(out.scheduled):
            if s.req is victim:
                out.num_batched_tokens -= s.num_new_tokens
                del out.scheduled[i]
                break
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _schedule_running(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Give blocks to a running request, preempting the newest running requests (newer than `req`: blocks
        only flow from newer to older, so the oldest request always progresses); False if `req` itself was
        preempted."""
        # NOTE: decodes are scheduled before older in-flight prefills, so a victim may already be in this step
        while not self.block_manager.can_allocate(req, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        self.block_manager.allocate(req, num_new)
        out.scheduled.append(ScheduledRequest(req, num_new))
        out.num_batched_tokens += num_new
        return True

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        # NOTE: the budget left is recomputed from `out`: preempting an already-scheduled victim refunds it
        # 1. decodes: one token each
        for req in [r for r in self.running if r.is_decoding]:
            budget = cfg.max_num_batched_tokens - out.num_batched_tokens
            if budget < 1 or len(out.scheduled) >= cfg.max_num_seqs:
                break
            if req in self.running:
                self._schedule_running(req, 1, out)
        # 2. in-flight chunked requests continue before new ones
        for req in [r for r in self.running if not r.is_decoding]:
            budget = cfg.max_num_batched_tokens - out.num_batched_tokens
            if budget < 1 or len(out.scheduled) >= cfg.max_num_seqs:
                break
            if req not in self.running:
                continue
            num_new = min(req.num_remaining_tokens, budget, cfg.max_chunk_tokens)
            self._schedule_running(req, num_new, out)
        budget = cfg.max_num_batched_tokens - out.num_batched_tokens
        # 3. new requests, in the policy's order; none in a step that had to preempt (vLLM v1): the cache is
        # full, and a victim re-admitted at once would only be preempted again
        for req in self.order_waiting() if not out.preempted else []:
            if len(out.scheduled) + len(out.encoder) >= cfg.max_num_seqs:
                break
            if req.on_encoder:
                cost = self._encoder_cost(req)
                if cost > budget and not out.is_empty:
                    break
                budget -= cost
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                out.encoder.append(req)
                out.num_batched_tokens += req.num_tokens
                continue
            if budget < 1:
                break
            num_new = min(req.num_remaining_tokens, budget, cfg.max_chunk_tokens)
            if not self.block_manager.can_allocate(req, num_new):
                break
            self.block_manager.allocate(req, num_new)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            out.num_batched_tokens += num_new
            budget -= num_new
        return out

    def order_waiting(self) -> list[Request]:
        """Admission order of waiting requests. Here: arrival order (the policies issue refines this)."""
        return list(self.waiting)
