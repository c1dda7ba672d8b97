"""Prometheus metrics of one served engine, in their own registry (several apps in one process never collide).

Step metrics hang on the client's step observers (`EngineClient.observe_steps`: called on the engine thread with every step's `StepStats`, no
polling); request metrics come from each output's `RequestMetrics` when the server hands it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from orthrus_rag.outputs import StepStats
from orthrus_rag.outputs import RequestMetrics

if TYPE_CHECKING:
    from orthrus_rag.engine.core.block_manager import BlockManager

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (0, 1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)
STEP_KINDS = ("embed", "prefill", "decode", "encoder")


class ServerMetrics:
    def __init__(self, client: Any, pending: Any = None, block_manager: BlockManager | None = None) -> None:
        """`client`: the served `EngineClient` (its step observers); `pending`: a callable giving the number of
        unfinished requests; `block_manager`: the in-process engine's, whose KV blocks the gauges read."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter("orthrus_requests", "Finished HTTP requests by endpoint kind and status",
                                ["kind", "status"], registry=r)
        self.prompt_tokens = Counter("orthrus_prompt_tokens", "Input tokens by request kind", ["kind"], registry=r)
        self.generation_tokens = Counter("orthrus_generation_tokens", "Generated tokens", registry=r)
        self.step_tokens = Histogram("orthrus_step_tokens", "Tokens per engine step by kind", ["kind"],
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.steps = Counter("orthrus_steps", "Engine steps", registry=r)
        self.mixed_steps = Counter("orthrus_mixed_steps", "Engine steps that carried embedding and generation "
                                   "tokens together", registry=r)
        self.mixed_share = Gauge("orthrus_mixed_step_share", "Share of engine steps that carried both kinds",
                                 registry=r)
        self.waiting = Gauge("orthrus_num_requests_waiting", "Requests waiting in the scheduler (last step)",
                             registry=r)
        self.running = Gauge("orthrus_num_requests_running", "Requests running in the scheduler (last step)",
                             registry=r)
        self.pending = Gauge("orthrus_num_requests_pending", "Requests submitted and not yet finished",
                             registry=r)
        self.kv_used = Gauge("orthrus_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("orthrus_kv_blocks_total", "KV cache blocks in all", registry=r)
        self.prefix_hits = Counter("orthrus_prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                                   "cache", registry=r)
        self.preempted = Counter("orthrus_preemptions", "Requests preempted (recompute)", registry=r)
        self.ttft = Histogram("orthrus_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("orthrus_e2e_latency_seconds", "Arrival to finish, by request kind", ["kind"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queueing = Histogram("orthrus_queueing_seconds", "Arrival to first scheduled step, by request kind",
                                  ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        # NOTE: an embedding's latency is orthrus_e2e_latency_seconds{kind="embed"}; time to first token is a
        # generation's (an embedding has one result, at its end)
        self.itl = Histogram("orthrus_inter_token_latency_seconds", "Gap between a generation's consecutive "
                             "sampled tokens, one observation per token", buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("orthrus_time_per_output_token_seconds", "A finished generation's mean time per "
                              "output token after its first", buckets=ITL_BUCKETS, registry=r)
        self.at_risk = Counter("orthrus_slo_at_risk_steps", "Engine steps shared while a kind's latency target "
                               "(scheduler.slo) was at risk, by kind", ["kind"], registry=r)
        self.time_capped = Counter("orthrus_slo_time_capped_steps", "Engine steps a latency target's time bound "
                                   "(scheduler.slo.itl_s, embed_p95_s) cut below their token budget", registry=r)
        self.yielded = Counter("orthrus_slo_yielded_decodes", "Decodes that sat out a step so that an embedding at "
                               "risk fit in its time bound (scheduler.slo.yield_decodes)", registry=r)
        self._pending = pending
        self._num_steps = self._num_mixed = 0
        self._blocks = block_manager
        if block_manager is not None:
            self.kv_total.set(block_manager.num_blocks)
            self.kv_used.set(block_manager.num_used_blocks)
        self._stop = client.observe_steps(self.observe_step)

    def close(self) -> None:
        """Stop observing the steps (the engine may outlive this server)."""
        if self._stop is not None:
            self._stop()
            self._stop = None

    # ---- engine thread ------------------------------------------------------------------------------------
    def observe_step(self, stats: StepStats) -> None:
        for kind, n in zip(STEP_KINDS, (stats.num_embed_tokens, stats.num_prefill_tokens, stats.num_decode_tokens,
                                        stats.num_encoder_tokens)):
            if n:  # NOTE: a kind absent from a step is not a step of 0 tokens of it
                self.step_tokens.labels(kind).observe(n)
        self.steps.inc()
        self._num_steps += 1
        if stats.is_mixed:
            self.mixed_steps.inc()
            self._num_mixed += 1
        self.mixed_share.set(self._num_mixed / self._num_steps)
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_used.set(stats.kv_blocks_used if self._blocks is None else self._blocks.num_used_blocks)
        if stats.num_preempted:
            self.preempted.inc(stats.num_preempted)
        for gap in stats.decode_gaps:
            self.itl.observe(gap)
        if stats.embed_at_risk:
            self.at_risk.labels("embed").inc()
        if stats.generate_at_risk:
            self.at_risk.labels("generate").inc()
        if stats.time_capped:
            self.time_capped.inc()
        if stats.num_yielded_decodes:
            self.yielded.inc(stats.num_yielded_decodes)
        if stats.num_prefix_hit_tokens > 0:  # NOTE: a preempted request's hits return (a negative step count)
            self.prefix_hits.inc(stats.num_prefix_hit_tokens)

    # ---- event loop -----------------------------------------------------------------------------------------
    def observe_request(self, kind: str, metrics: RequestMetrics | None, prompt_tokens: int,
                        completion_tokens: int = 0) -> None:
        """One finished engine request (`kind`: "embed" or "generate")."""
        self.prompt_tokens.labels(kind).inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)
        if metrics is None:
            return
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
            if completion_tokens > 1 and metrics.finished_time is not None:
                self.tpot.observe((metrics.finished_time - metrics.first_token_time) / (completion_tokens - 1))
        if metrics.e2e_latency is not None:
            self.e2e.labels(kind).observe(metrics.e2e_latency)
        if metrics.queueing_time is not None:
            self.queueing.labels(kind).observe(metrics.queueing_time)

    def render(self) -> bytes:
        if self._pending is not None:
            self.pending.set(self._pending())
        if self._blocks is not None:  # NOTE: blocks freed after the last step show too
            self.kv_used.set(self._blocks.num_used_blocks)
        return generate_latest(self.registry)
