"""Statistics over many steps: `StepAggregator` keeps totals and histograms of any number of `StepStats`
(orthrus_rag/outputs.py: what the engine hands its step observers) in constant memory (run summaries, metrics)."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from orthrus_rag.outputs import StepStats


class Histogram:
    """Counts of values in fixed buckets: `counts[i]` holds values in (edges[i-1], edges[i]] (the first bucket
    everything up to edges[0], the last everything above edges[-1]). O(buckets) memory for any number of values;
    quantiles interpolate within a bucket, so they are exact to a bucket's width."""

    def __init__(self, edges: Sequence[float]) -> None:
        assert list(edges) == sorted(edges) and len(edges) > 0
        self.edges = list(edges)
        self.counts = [0] * (len(self.edges) + 1)
        self.total = 0
        self.sum = 0.0
        self.max = float("-inf")

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += 1
        self.sum += value
        self.max = max(self.max, value)

    def quantile(self, q: float) -> float:
        if self.total == 0:
            return float("nan")
        rank = q * self.total
        seen = 0
        for i, count in enumerate(self.counts):
            if count and seen + count >= rank:
                lo = self.edges[i - 1] if i > 0 else 0.0
                hi = self.edges[i] if i < len(self.edges) else self.max
                return min(lo + (hi - lo) * (rank - seen) / count, self.max)
            seen += count
        return self.max

    def to_json(self) -> dict[str, Any]:
        return {"edges": self.edges, "counts": self.counts, "total": self.total,
                "mean": self.sum / self.total if self.total else float("nan"),
                **{f"p{q}": self.quantile(q / 100) for q in (50, 95, 99)},
                "max": self.max if self.total else float("nan")}


def _log_edges(lo: float, hi: float, per_decade: int) -> list[float]:
    n = round(math.log10(hi / lo) * per_decade)
    return [lo * 10 ** (i / per_decade) for i in range(n + 1)]


STEP_TIME_EDGES = _log_edges(1e-4, 1e3, 10)  # 0.1 ms .. 1,000 s, 10 buckets a decade (~26% wide)
STEP_TOKEN_EDGES = [2.0 ** i for i in range(17)]  # 1 .. 65,536 tokens


class StepAggregator:
    """Totals and histograms of every step added, in constant memory (what a long run's summary reports,
    however many steps it took). Thread-safe: the engine's thread adds, another may read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = dict.fromkeys(
            ("num_steps", "num_mixed_steps", "embed_tokens", "prefill_tokens", "decode_tokens", "encoder_tokens",
             "num_preempted", "busy_time", "max_kv_blocks_used", "prefix_cache_hit_tokens"), 0)
        self.step_time = Histogram(STEP_TIME_EDGES)
        self.step_tokens = Histogram(STEP_TOKEN_EDGES)

    def add(self, s: StepStats) -> None:
        tokens = s.num_embed_tokens + s.num_prefill_tokens + s.num_decode_tokens + s.num_encoder_tokens
        with self._lock:
            t = self.totals
            t["num_steps"] += 1
            t["num_mixed_steps"] += int(s.is_mixed)
            t["embed_tokens"] += s.num_embed_tokens
            t["prefill_tokens"] += s.num_prefill_tokens
            t["decode_tokens"] += s.num_decode_tokens
            t["encoder_tokens"] += s.num_encoder_tokens
            t["num_preempted"] += s.num_preempted
            t["prefix_cache_hit_tokens"] += s.num_prefix_hit_tokens
            t["busy_time"] += s.step_time
            t["max_kv_blocks_used"] = max(t["max_kv_blocks_used"], s.kv_blocks_used)
            self.step_time.add(s.step_time)
            self.step_tokens.add(tokens)

    def add_row(self, row: dict[str, Any]) -> None:
        """A steps.jsonl row (`vars(StepStats)`, extra keys ignored)."""
        self.add(StepStats(**{k: row[k] for k in StepStats.__dataclass_fields__ if k in row}))

    def summary(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.totals)
            out["step_time_s"] = self.step_time.to_json()
            out["tokens_per_step"] = self.step_tokens.to_json()
        return out


def summarize_steps(steps: Iterable[StepStats]) -> dict[str, Any]:
    """Totals and histograms over a run's steps: tokens of each kind, mixed steps, busy time, step times."""
    agg = StepAggregator()
    for s in steps:
        agg.add(s)
    return agg.summary()


def planned_stats(step: int, sched: Any, num_waiting: int, num_running: int,
                   kv_blocks_used: int) -> StepStats:
    """A step's stats as the scheduler planned it (`sched`: engine/core/scheduler.py's SchedulerOutput;
    `record_execution` adds what ran)."""
    embed = prefill = decode = 0
    for s in sched.scheduled:
        if s.req.is_embed:
            embed += s.num_new_tokens
        elif s.req.is_decoding:
            decode += s.num_new_tokens
        else:
            prefill += s.num_new_tokens
    return StepStats(step, embed, prefill, decode, sum(r.num_tokens for r in sched.encoder),
                     len(sched.scheduled) + len(sched.encoder), num_waiting, num_running, len(sched.preempted),
                     kv_blocks_used, embed_at_risk=sched.embed_at_risk, generate_at_risk=sched.generate_at_risk,
                     time_capped=sched.time_capped, num_yielded_decodes=len(sched.yielded),
                     predicted_step_time=sched.predicted_s)
