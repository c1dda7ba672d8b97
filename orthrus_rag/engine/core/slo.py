"""Per-kind latency targets (`scheduler.slo`, config/engine.py SloConfig): the one owner of what "at risk" means
and of the step-time bound that keeps a decode's inter-token time under its target.

Two mechanisms, both off until a target is set:
- `itl_s`: a step that carries decodes is sized by the step-cost model (engine/core/step_cost.py) so its predicted
  time stays within the target, whatever the embedding queue holds; a step without decodes stays whole.
- `generate_p95_s` / `embed_p95_s`: pending work of a kind (a prompt or an embedding not yet done) that has waited
  `risk_fraction` of its kind's end-to-end target is at risk; the policy (engine/core/policies.py) then fills
  that kind first, with all of the residual budget but the other kind's `min_share`.

Neither takes work away when nothing is at risk: the step stays as large as its budget and the remaining-token split
decides (work-conserving). Deadlines count from a request's arrival, so a request that waited in the queue is at
risk sooner than one that just came.
"""

from __future__ import annotations

from orthrus_rag.config.engine import SloConfig
from orthrus_rag.engine.core.request import Request


class LatencyTargets:
    def __init__(self, config: SloConfig) -> None:
        self.config = config

    @property
    def itl_s(self) -> float | None:
        return self.config.itl_s

    def target(self, embed: bool) -> float | None:
        """The end-to-end target of a kind (None: none)."""
        return self.config.embed_p95_s if embed else self.config.generate_p95_s

    def at_risk(self, pending: list[Request], embed: bool, now: float) -> bool:
        """Whether the oldest of a kind's pending requests has waited `risk_fraction` of its kind's target."""
        target = self.target(embed)
        if target is None or not pending:
            return False
        # NOTE: in-flight requests come first in `pending`, then waiting ones in arrival order (a preempted one
        # back at the front), so the oldest is among the in-flight ones or the first waiting one; a min over all
        # costs no more than the list the scheduler already built
        oldest = min(r.arrival_time for r in pending)
        return now - oldest >= self.config.risk_fraction * target
