"""How long a step may take, and so how many tokens it carries: the step-cost model's (step_cost.py) use by the
scheduler, apart from who runs (scheduler.py, policies.py).

Without a cost model a step is a token budget (`max_num_batched_tokens`). With one, a step that carries decodes is
sized by predicted time: `step_time_target`, else the decodes' own predicted time x (1 + `step_time_margin`) (the
margin rule, where `decode_margin` is on), and in any case no longer than a latency target's bound (slo.py: the
inter-token target on steps with decodes, the embedding target on every step). A bound set by a latency target
also holds a whole encoder input to it (an encoder request never splits, so a token cap alone cannot), and gives
the at-risk rule its horizon: how much longer a request passed over now will wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.core.request import Request
from orthrus_rag.engine.core.slo import LatencyTargets
from orthrus_rag.engine.core.step_cost import StepCostModel, StepShape


class SchedulerOutput(Protocol):
    """What sizing reads of the step being scheduled (scheduler.SchedulerOutput; not imported: it imports this)."""

    scheduled: Sequence[Any]  # ScheduledRequest: .req, .num_new_tokens
    budget_used: int
    time_capped: bool

    def shape(self) -> StepShape: ...


class StepSizer:
    """One step's time bound and token cap, set once its decodes are in (`cap`), then asked while it is filled."""

    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel | None, targets: LatencyTargets | None,
                 decode_margin: bool) -> None:
        self.config = config
        self.cost_model = cost_model
        self.targets = targets
        # the cost budget's own rule for steps with decodes; False where the model is on only for latency targets,
        # which then alone bound steps
        self.decode_margin = decode_margin
        # this step's time bound when a latency target (slo.itl_s, slo.embed_p95_s) sized it: whole encoder inputs
        # are held to it as well (the margin rule without a target stays a token budget, as before targets)
        self.time_target: float | None = None
        self.keys_per_token = 0.0  # the keys a prompt / embedding chunk token is expected to attend

    def cap(self, out: SchedulerOutput, running: list[Request]) -> int:
        """This step's token budget once its decodes are in: what fits in the step-time target beside them.
        Without decodes a step is whole (max_num_batched_tokens) unless an embedding target bounds every step."""
        cfg, cost = self.config, self.cost_model
        self.time_target = None
        bound = self.targets.step_time_bound(bool(out.scheduled)) if self.targets is not None else None
        if cost is None:
            return cfg.max_num_batched_tokens
        shape = out.shape()
        target = bound
        if out.scheduled and (self.decode_margin or cfg.step_time_target):
            own = self.decode_time_target(shape)
            target = own if target is None else min(own, target)
        if target is None:
            return cfg.max_num_batched_tokens
        if bound is not None:
            # NOTE: a latency target's bound holds whole encoder inputs to it too (encoder_time_fit)
            self.time_target = target
        self.keys_per_token = self._keys_per_token(running)
        extra = max(cost.tokens_within(shape, target, self.keys_per_token), cfg.min_step_tokens)
        cap = min(cfg.max_num_batched_tokens, out.budget_used + extra)
        out.time_capped = bound is not None and cap < cfg.max_num_batched_tokens
        return cap

    def _keys_per_token(self, running: list[Request]) -> float:
        chunks = [r.num_computed_tokens for r in running if not r.is_decoding]
        return (sum(chunks) / len(chunks) if chunks else 0.0) + self.config.max_chunk_tokens / 2

    def yielding_decodes(self, decodes: list[Request], embeds: list[Request], prompts: list[Request],
                         yielded_before: set[str], running: list[Request], now: float) -> list[Request]:
        """The decodes (of `decodes`, in keep order: the last yield first) that sit out this step so that the next
        chunk of each pending embedding at risk (of `embeds`) fits in the step's time bound (slo.py,
        `yield_decodes`). None yields while a pending prompt (of `prompts`) is at risk, where all fit anyway, or
        where even yielding every decode that may would not make them fit (an embedding flood: steps stay full of
        decodes, as without the rule). A decode may yield if it did not in the previous step (`yielded_before`),
        and where `itl_s` is set, only if two bounded steps keep its gap within it."""
        targets, cost = self.targets, self.cost_model
        if targets is None or cost is None or not targets.config.yield_decodes or not decodes:
            return []
        bound = targets.step_time_bound(with_decodes=True)
        if bound is None or targets.at_risk(prompts, False, now, bound):
            return []
        late = targets.late(embeds, True, now, bound)
        if not late:
            return []
        cfg, itl = self.config, targets.itl_s
        need = sum(min(r.num_remaining_tokens, cfg.max_chunk_tokens) for r in late if not r.on_encoder)
        encoder_need = sum(r.encoder_tokens for r in late if r.on_encoder)
        if prompts:  # NOTE: the policy gives a kind at risk all but the other kind's min_share
            need = int(need / (1.0 - cfg.min_share)) + 1
        keys = self._keys_per_token(running)

        def fits(rows: list[Request]) -> bool:
            adapters = [r.adapter_slot for r in rows if r.adapter_slot]
            shape = StepShape(len(rows), sum(r.num_computed_tokens + 1 for r in rows), encoder_need, len(adapters),
                              len(set(adapters)), len(rows))
            return cost.predict(shape) <= bound and (need == 0 or cost.tokens_within(shape, bound, keys) >= need)

        def may_yield(r: Request) -> bool:
            return r.req_id not in yielded_before and (
                itl is None or r.last_token_time is None or now - r.last_token_time + 2 * bound <= itl)

        kept = [r for r in decodes if not may_yield(r)]
        if not fits(kept) or fits(decodes):
            return []
        optional = [r for r in decodes if may_yield(r)]
        # the most of `optional` (oldest first) that still fit: a step only grows with its rows, so bisect
        lo, hi = 0, len(optional)  # kept + optional[:lo] fits, kept + optional[:hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(kept + optional[:mid]) else (lo, mid)
        return optional[lo:]

    def horizon(self, out: SchedulerOutput, cap: int, pending_cost: Callable[[], int]) -> float:
        """The step's predicted seconds once filled to `cap`, or with all the pending work (`pending_cost()` budget
        tokens) where that is less, and at least a latency target's bound where one sized it (0 without a cost model or targets): a
        request passed over now waits that long more (slo.py's at-risk rule counts it)."""
        if self.cost_model is None or self.targets is None:
            return 0.0
        shape = out.shape()
        more = max(min(cap - out.budget_used, pending_cost()), 0)
        predicted = self.cost_model.predict(replace(shape, num_tokens=shape.num_tokens + more))
        # NOTE: the cap fills the step to just under its bound, so a request that arrived just before this step
        # (it has waited ~0) fell short of an embedding target's threshold (half the target, as the bound) by the
        # rounding: measured at 3:7, embeddings waited a third step (p95 0.25 s against a 0.165 s target)
        return max(predicted, self.time_target or 0.0)

    def decode_time_target(self, shape: StepShape) -> float:
        """How long the cost budget lets a step carrying decodes take: `step_time_target`, or the decodes' own
        predicted time x (1 + step_time_margin). (Latency targets bound it further: slo.py.)"""
        cfg = self.config
        if cfg.step_time_target:
            return cfg.step_time_target
        assert self.cost_model is not None
        return (1.0 + cfg.step_time_margin) * self.cost_model.predict(shape)

    def encoder_time_fit(self, req: Request, out: SchedulerOutput) -> bool | None:
        """Whether a whole encoder request keeps a step within a latency target's time bound: True, False (not in
        this step), or None: it would overrun the bound even beside the decodes alone, so no step can ever fit it."""
        if self.time_target is None or self.cost_model is None:
            return True
        base = out.shape()
        with_req = replace(base, num_encoder_tokens=base.num_encoder_tokens + req.encoder_tokens)
        if self.cost_model.predict(with_req) <= self.time_target:
            return True
        decodes = [s for s in out.scheduled if s.req.is_decoding]
        alone = StepShape(len(decodes), sum(s.req.num_computed_tokens + 1 for s in decodes), req.encoder_tokens,
                          num_sampled_rows=len(decodes))
        return None if self.cost_model.predict(alone) > self.time_target else False

    def cap_after_encoder(self, out: SchedulerOutput, cap: int) -> int:
        """The cap once an encoder request joined a time-bounded step: its time is not left for the chunks after it
        (the cap counted decoder tokens only)."""
        if self.time_target is None or self.cost_model is None:
            return cap
        left = self.cost_model.tokens_within(out.shape(), self.time_target, self.keys_per_token)
        return min(cap, out.budget_used + left)
