"""What one engine step runs (`SchedulerOutput`: the scheduler's decision, the runner's input) and what it changed
(`StepResult`: the scheduler's account of it, the engine's input for outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orthrus_rag.engine.core.request import Request
from orthrus_rag.engine.core.step_cost import StepShape


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decoder rows, in batch order
    encoder: list[Request] = field(default_factory=list)  # whole-sequence encoder requests
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0  # decoder + encoder tokens in the step
    budget_used: int = 0  # against max_num_batched_tokens: encoder tokens count at their relative cost
    # latency targets (engine/core/slo.py): the kinds whose target was at risk when the step was shared, and
    # whether a target's time bound (itl_s, embed_p95_s) cut the step below its token budget
    embed_at_risk: bool = False
    generate_at_risk: bool = False
    time_capped: bool = False
    yielded: list[Request] = field(default_factory=list)  # decodes that sat out this step (slo.yield_decodes)
    # the step-cost model's seconds for the step as scheduled (None without a model): beside the measured time it
    # shows whether sizing under- or overpredicts
    predicted_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.encoder

    def shape(self) -> StepShape:
        """The step's work, for the cost model (call before the step's tokens count as computed)."""
        tokens = pairs = adapter_rows = sampled = 0
        adapters = set()
        for s in self.scheduled:
            tokens += s.num_new_tokens
            pairs += s.num_new_tokens * (s.req.num_computed_tokens + s.num_new_tokens)
            if s.req.adapter_slot:
                adapter_rows += s.num_new_tokens
                adapters.add(s.req.adapter_slot)
            # NOTE: the runner's rule for a generation row (runner._run_decoder)
            sampled += not s.req.is_embed and s.req.num_computed_tokens + s.num_new_tokens == s.req.num_tokens
        return StepShape(tokens, pairs, sum(r.encoder_tokens for r in self.encoder), adapter_rows, len(adapters),
                         sampled)


@dataclass
class StepResult:
    """What one executed step changed, for the engine to turn into outputs."""

    finished: list[Request] = field(default_factory=list)  # finish_reason set, out of the queues, blocks freed
    streamed: list[Request] = field(default_factory=list)  # unfinished streaming generations with a new token
    handoffs: list[Request] = field(default_factory=list)  # first token sampled; blocks kept until `release`
    embeddings: dict[str, Any] = field(default_factory=dict)  # req_id -> pooled result (finished ones)
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why pooling failed (finished ones)
    decode_gaps: list[float] = field(default_factory=list)  # seconds since each sampled token's previous one
