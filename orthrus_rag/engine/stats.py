"""Per-step statistics: how the token budget was split between the kinds of work."""

from __future__ import annotations

from dataclasses import dataclass

from orthrus_rag.engine.scheduler import SchedulerOutput


@dataclass
class StepStats:
    step: int
    num_embed_tokens: int  # decoder-backbone embedding chunks
    num_prefill_tokens: int  # generation prompt chunks (incl. recompute after preemption)
    num_decode_tokens: int
    num_encoder_tokens: int  # whole sequences on the separate encoder
    num_requests: int
    num_waiting: int
    num_running: int
    num_preempted: int
    kv_blocks_used: int
    step_time: float = 0.0

    @property
    def is_mixed(self) -> bool:
        """Embedding and generation tokens in the same step."""
        embed = self.num_embed_tokens + self.num_encoder_tokens
        return embed > 0 and self.num_prefill_tokens + self.num_decode_tokens > 0

    @classmethod
    def from_schedule(cls, step: int, sched: SchedulerOutput, num_waiting: int, num_running: int,
                      kv_blocks_used: int) -> "StepStats":
        embed = prefill = decode = 0
        for s in sched.scheduled:
            if s.req.is_embed:
                embed += s.num_new_tokens
            elif s.req.is_decoding:
                decode += s.num_new_tokens
            else:
                prefill += s.num_new_tokens
        return cls(step, embed, prefill, decode, sum(r.num_tokens for r in sched.encoder),
                   len(sched.scheduled) + len(sched.encoder), num_waiting, num_running, len(sched.preempted),
                   kv_blocks_used)


def summarize_steps(steps: list[StepStats]) -> dict[str, float]:
    """Totals over a run's steps: tokens of each kind, mixed steps, busy time (for metrics and benchmarks)."""
    n = len(steps)
    return {
        "num_steps": n,
        "num_mixed_steps": sum(s.is_mixed for s in steps),
        "embed_tokens": sum(s.num_embed_tokens for s in steps),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "decode_tokens": sum(s.num_decode_tokens for s in steps),
        "encoder_tokens": sum(s.num_encoder_tokens for s in steps),
        "num_preempted": sum(s.num_preempted for s in steps),
        "busy_time": sum(s.step_time for s in steps),
        "max_kv_blocks_used": max((s.kv_blocks_used for s in steps), default=0),
    }
