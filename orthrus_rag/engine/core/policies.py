"""Scheduling policies: how the budget left after decodes is shared between embedding and prompt work.

A policy never touches blocks or tensors: it looks at the pending requests of each kind (in-flight chunked
requests first, then waiting ones in arrival order) and returns *lanes*, each a candidate list with a token
cap. The scheduler fills the lanes in order, then hands any budget still left to every candidate
(work-conserving), in `fallback` order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.request import Request, RequestKind
from orthrus_rag.engine.core.slo import LatencyTargets


class SchedulerQueues:
    """The scheduler's queues, and all a policy may read of the scheduler (read-only to a policy). `Scheduler`
    (scheduler.py) extends it, so the policies never import the scheduler."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._pending: dict[bool, list[Request]] | None = None  # pending() snapshots while a step is scheduled
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # started decoder requests, oldest first
        # per-kind latency targets (engine/core/slo.py); None: no target set
        self.targets: LatencyTargets | None = LatencyTargets(config.slo) if config.slo.is_set else None
        self.now = 0.0  # the clock of the step being scheduled (Scheduler.schedule)
        self.horizon = 0.0  # the predicted seconds of the step being scheduled (0 where steps are not timed)

    def at_risk(self, embed: bool) -> bool:
        """Whether a kind's pending work has waited long enough to put its latency target at risk (slo.py)."""
        return self.targets is not None and self.targets.at_risk(self.pending(embed), embed, self.now, self.horizon)

    def pending(self, embed: bool) -> list[Request]:
        """Requests of one kind with prompt/embedding tokens to process: in-flight chunked ones first (admission
        order), then waiting ones (arrival order; preempted requests were put back at the front). Bulk requests
        (priority > 0) are not among them: no policy sees them (`pending_bulk`)."""
        if self._pending is not None and embed in self._pending:
            return self._pending[embed]  # NOTE: one snapshot per step: policies ask several times
        inflight = [r for r in self.running if r.is_embed == embed and not r.is_decoding and not r.is_bulk]
        waiting = [r for r in self.waiting if r.is_embed == embed and not r.is_bulk]
        if embed and any(r.kind is RequestKind.SCORE for r in waiting):
            # NOTE: scored pairs are embedding work too, but a rerank call brings dozens of long pairs at once: in one
            # arrival order the embeddings behind them waited for all of them (served, 64 clients: embedding p50
            # 12 s); alternating the two keeps each in its own arrival order
            waiting = _interleave([r for r in waiting if r.kind is RequestKind.EMBED],
                                  [r for r in waiting if r.kind is RequestKind.SCORE])
        pending = inflight + waiting
        if self._pending is not None:
            self._pending[embed] = pending
        return pending

    def pending_bulk(self) -> list[Request]:
        """Bulk requests (priority > 0) with tokens to process, both kinds, in-flight first then in arrival order:
        the scheduler gives them what budget the policy's lanes and fallback leave. Kept out of every policy's
        view so that a bulk backlog takes no share of a split, holds no reserved sequence slot and puts no latency
        target at risk (its old arrivals would)."""
        inflight = [r for r in self.running if r.is_bulk and not r.is_decoding]
        return inflight + [r for r in self.waiting if r.is_bulk]

    def remaining_cost(self, reqs: list[Request]) -> int:
        """Budget tokens `reqs` still need (encoder tokens weighted by their relative cost)."""
        return sum(self._encoder_cost(r) if r.on_encoder else r.num_remaining_tokens for r in reqs)

    def _encoder_cost(self, req: Request) -> int:
        return max(1, math.ceil(req.encoder_tokens * self.config.encoder_token_weight))


@dataclass
class Lane:
    candidates: list[Request]
    cap: int  # at most this many budget tokens from this lane


class Policy(Protocol):
    name: str
    sizes_steps_by_cost: bool  # steps with decodes sized by predicted time (engine/core/step_cost.py), not tokens only

    def step_kinds(self, sched: SchedulerQueues) -> tuple[bool, bool]:
        """(embedding work allowed, generation work allowed) this step."""

    def lanes(self, sched: SchedulerQueues, residual: int) -> list[Lane]:
        """Candidate lists with caps, filled in order (kinds not allowed this step are skipped)."""

    def fallback(self, sched: SchedulerQueues) -> list[Request]:
        """Who may use budget the lanes left over."""

    def reserved_seqs(self, sched: SchedulerQueues) -> int:
        """Sequence slots (of max_num_seqs) that running decodes may not take this step."""

    def step_cap(self, sched: SchedulerQueues, cap: int, used: int) -> int:
        """This step's budget once its decodes (`used` budget tokens) are in, given the scheduler's `cap`."""


def _interleave(a: list[Request], b: list[Request]) -> list[Request]:
    out: list[Request] = []
    for i in range(max(len(a), len(b))):
        out += a[i:i + 1] + b[i:i + 1]
    return out


def _urgent(sched: SchedulerQueues) -> list[Request]:
    """Pending latency-critical work (priority < 0), embeddings first."""
    return [r for r in sched.pending(embed=True) + sched.pending(embed=False) if r.priority < 0]


class _Base:
    name = "base"
    sizes_steps_by_cost = False  # NOTE: the baselines keep their published rule, a fixed token budget

    def step_kinds(self, sched: SchedulerQueues) -> tuple[bool, bool]:
        return True, True

    def fallback(self, sched: SchedulerQueues) -> list[Request]:
        return _interleave(sched.pending(embed=True), sched.pending(embed=False))

    def reserved_seqs(self, sched: SchedulerQueues) -> int:
        return 0

    def step_cap(self, sched: SchedulerQueues, cap: int, used: int) -> int:
        return cap


class OrthrusPolicy(_Base):
    """The paper's intra-batch policy: the residual budget is split between the embedding queue and the prompt
    queue in proportion to the tokens each still has to process. `min_share` guards the minority kind (the
    paper's weak spot: embedding tail latency when generation dominates)."""

    name = "orthrus"
    sizes_steps_by_cost = True

    def __init__(self, min_share: float = 0.1) -> None:
        self.min_share = min_share
        self._carry = 0.0  # fractional embedding tokens owed from earlier steps

    def reserved_seqs(self, sched: SchedulerQueues) -> int:
        # NOTE: measured on 2Wiki Iter-RetGen (200 questions at once): with every sequence slot held by decodes,
        # query embeddings waited behind the whole prompt backlog (retrieval p95 636 s). min_share also
        # guards the slots, not only the tokens.
        # never more slots than embeddings are pending: a slot no embedding can use would only hold a decode back
        # (always leave decodes at least one slot)
        wanted = len(sched.pending(embed=True))
        return min(math.ceil(self.min_share * sched.config.max_num_seqs), wanted, sched.config.max_num_seqs - 1)

    def step_cap(self, sched: SchedulerQueues, cap: int, used: int) -> int:
        urgent = _urgent(sched)
        if not urgent:
            return cap
        # NOTE: latency-critical work also gets a short step: the decodes, that work and a min_share floor of the
        # rest. Measured on Iter-RetGen (2Wiki, 40 questions): second-hop queries rode the next step at once, but
        # that step also carried ~230 prompt tokens over ~1,000-token contexts (0.5-0.67 s on 2 cores), so the
        # retrieval p95 was ~2 such steps
        floor = math.ceil(self.min_share * sched.config.max_num_batched_tokens)
        return min(cap, used + sched.remaining_cost(urgent) + floor)

    def lanes(self, sched: SchedulerQueues, residual: int) -> list[Lane]:
        embed, prefill = sched.pending(embed=True), sched.pending(embed=False)
        # NOTE: latency-critical work (priority < 0: e.g. the query a multi-hop chain waits on) first; a 30-token
        # query would otherwise get a sliver of the split beside 1,000-token prompts
        urgent = _urgent(sched)
        first = [Lane(urgent, residual)] if urgent else []
        rem_e, rem_p = sched.remaining_cost(embed), sched.remaining_cost(prefill)
        if rem_e == 0 or rem_p == 0:
            self._carry = 0.0
            return first + ([Lane(embed, residual), Lane(prefill, residual)] if rem_e + rem_p else [])
        risk_e, risk_p = sched.at_risk(embed=True), sched.at_risk(embed=False)
        if risk_e != risk_p:
            # NOTE: one kind's latency target is at risk (slo.py): it takes all but the other kind's floor and
            # fills first; measured without targets (docs/design/scheduling.md): at 9:1 embed:generate a prompt got
            # min_share of each step, so generation p95 was 5x the separate servers'
            share_e = 1.0 - self.min_share if risk_e else self.min_share
        else:
            share_e = min(max(rem_e / (rem_e + rem_p), self.min_share), 1.0 - self.min_share)
        # NOTE: the fractional part carries over, so over a few steps each kind gets its share even when a
        # step's residual is too small to split (a tiny share would otherwise round to 0 for ever)
        want = residual * share_e + self._carry
        cap_e = int(want)
        self._carry = want - cap_e
        lanes = [Lane(embed, cap_e), Lane(prefill, residual - cap_e)]
        # NOTE: the kind at risk, else the kind whose oldest pending request arrived first, fills first (it matters
        # for max_num_seqs)
        generate_first = risk_p if risk_e != risk_p else prefill[0].arrival_time < embed[0].arrival_time
        if generate_first:
            lanes.reverse()
        return first + lanes


class QueueLengthPriorityPolicy(_Base):
    """The published code's rule: the kind with the larger queue length x fixed priority (embed 1, generate 4)
    goes first and may take the whole budget."""

    name = "qlen-priority"

    def __init__(self, embed_priority: float = 1.0, generate_priority: float = 4.0) -> None:
        self.embed_priority, self.generate_priority = embed_priority, generate_priority

    def lanes(self, sched: SchedulerQueues, residual: int) -> list[Lane]:
        embed, prefill = sched.pending(embed=True), sched.pending(embed=False)
        lanes = [Lane(embed, residual), Lane(prefill, residual)]
        if len(prefill) * self.generate_priority > len(embed) * self.embed_priority:
            lanes.reverse()
        return lanes


class HeteroFCFSPolicy(_Base):
    """One queue in arrival order (in-flight first), both kinds mixed in a batch, chunked."""

    name = "hetero-fcfs"

    def lanes(self, sched: SchedulerQueues, residual: int) -> list[Lane]:
        inflight = [r for r in sched.running if not r.is_decoding and not r.is_bulk]
        # NOTE: waiting is in arrival order; bulk work is the scheduler's, after this lane (pending_bulk)
        return [Lane(inflight + [r for r in sched.waiting if not r.is_bulk], residual)]

    def fallback(self, sched: SchedulerQueues) -> list[Request]:
        return []


class UnifiedHomoPolicy(_Base):
    """One engine, but each step is all-embedding or all-generation (decodes + prompts); kinds alternate
    when both have work, so neither starves."""

    name = "unified-homo"

    def __init__(self) -> None:
        self._last_embed = False

    def step_kinds(self, sched: SchedulerQueues) -> tuple[bool, bool]:
        has_e = bool(sched.pending(embed=True))
        has_g = bool(sched.pending(embed=False)) or any(r.is_decoding and not r.is_bulk for r in sched.running)
        if not has_e and not has_g:  # NOTE: only bulk work (pending_bulk) is left: its kind gets the step
            bulk = sched.pending_bulk()
            has_e = any(r.is_embed for r in bulk)
        embed = has_e and (not has_g or not self._last_embed)
        self._last_embed = embed
        return embed, not embed

    def lanes(self, sched: SchedulerQueues, residual: int) -> list[Lane]:
        # the scheduler drops the kind that this step does not allow
        return [Lane(sched.pending(embed=True), residual), Lane(sched.pending(embed=False), residual)]

    def fallback(self, sched: SchedulerQueues) -> list[Request]:
        return []


# the policy registry: name -> a maker given `min_share` (the one list of names; checked here only)
POLICIES: dict[str, Callable[[float], Policy]] = {
    "orthrus": OrthrusPolicy,
    "qlen-priority": lambda min_share: QueueLengthPriorityPolicy(),
    "hetero-fcfs": lambda min_share: HeteroFCFSPolicy(),
    "unified-homo": lambda min_share: UnifiedHomoPolicy(),
}


def check_policy(name: str) -> None:
    """ValueError naming the policies for an unknown name (before any weights load)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; expected one of {', '.join(POLICIES)}")


def make_policy(name: str, min_share: float = 0.1) -> Policy:
    check_policy(name)
    return POLICIES[name](min_share)
