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

    def _preempt_newest(self, out: SchedulerOutput, protect: Request) -> bool:
        """Free the newest running request that is not yet in this step; False if there is none."""
        scheduled = {id(s.req) for s in out.scheduled}
        for victim in reversed(self.running):
            if victim is not protect and id(victim) not in scheduled:
                self.running.remove(victim)
                self.block_manager.free(victim)
                victim.reset_for_recompute()
                self.waiting.appendleft(victim)
                out.preempted.append(victim)
                return True
        return False

    def _schedule_running(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Give blocks to a running request, preempting newer ones if needed; False if `req` itself was
        preempted."""
        while not self.block_manager.can_allocate(req, num_new):
            if not self._preempt_newest(out, protect=req):
                self.running.remove(req)
                self.block_manager.free(req)
                req.reset_for_recompute()
                self.waiting.appendleft(req)
                out.preempted.append(req)
                return False
        self.block_manager.allocate(req, num_new)
        out.scheduled.append(ScheduledRequest(req, num_new))
        out.num_batched_tokens += num_new
        return True

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        # 1. decodes: one token each
        for req in [r for r in self.running if r.is_decoding]:
            if budget < 1 or len(out.scheduled) >= cfg.max_num_seqs:
                break
            if req in self.running and self._schedule_running(req, 1, out):
                budget -= 1
        # 2. in-flight chunked requests continue before new ones
        for req in [r for r in self.running if not r.is_decoding]:
            if budget < 1 or len(out.scheduled) >= cfg.max_num_seqs:
                break
            if req not in self.running:
                continue
            num_new = min(req.num_remaining_tokens, budget, cfg.max_chunk_tokens)
            if self._schedule_running(req, num_new, out):
                budget -= num_new
        # 3. new requests, in the policy's order
        for req in self.order_waiting():
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
