"""Per-kind latency targets (`scheduler.slo`, config/engine.py SloConfig): the one owner of what "at risk" means
and of the step-time bounds that keep a decode's inter-token time and an embedding's latency under their targets.

Four mechanisms, each off until its target is set:
- `itl_s`: a step that carries decodes is sized by the step-cost model (engine/core/step_cost.py) so its predicted
  time stays within the target, whatever the embedding queue holds.
- `embed_p95_s` also bounds every step's predicted time, to half the target: an embedding that arrives while a
  step runs waits for it, then runs in the next one, so two steps are its latency at best. Without the bound a
  step of the whole token budget (~0.2 s on 2 cores) alone outlasts a tight embedding target, however the
  residual budget is shared (measured at 3:7 on 2 cores: the separate embedding server answers in 0.15 s p95,
  one 256-token step takes 0.2 s; docs/design/scheduling.md). A loose target (above two full steps) never binds.
- `generate_p95_s` / `embed_p95_s`: pending work of a kind (a prompt or an embedding not yet done) that will have
  waited `risk_fraction` of its kind's end-to-end target by the end of the step being scheduled is at risk; the
  policy (engine/core/policies.py) then fills that kind first, with all of the residual budget but the other
  kind's `min_share`.

- `yield_decodes` (on by default, with `embed_p95_s`): where the decodes in flight alone leave no room in the
  step's bound for the next chunk of each embedding at risk, some decodes sit out the step (step_sizing.py
  `yielding_decodes`). A decode yields at most one step in two, and never past `itl_s`. Measured without it (1:9
  on 2 cores): ~26 decodes filled a 60 ms bound, so an embedding ran 32 tokens a step over 2-3 steps
  while the generations' own p95 was half the separate servers'.

None takes work away when nothing is at risk: the step stays as large as its budget and the remaining-token split
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

    def step_time_bound(self, with_decodes: bool) -> float | None:
        """How long a step may be predicted to take (None: no bound): the inter-token target where the step
        carries decodes, half the embedding target always, the tighter of those that apply."""
        bounds = [b for b in (self.config.itl_s if with_decodes else None,
                              self.config.embed_p95_s / 2 if self.config.embed_p95_s else None) if b]
        return min(bounds) if bounds else None

    def target(self, embed: bool) -> float | None:
        """The end-to-end target of a kind (None: none)."""
        return self.config.embed_p95_s if embed else self.config.generate_p95_s

    def late(self, pending: list[Request], embed: bool, now: float, horizon: float) -> list[Request]:
        """The requests of `pending` at risk by the end of a step of `horizon` seconds (the rule of `at_risk`, for
        each request rather than the oldest), in `pending`'s order."""
        target = self.target(embed)
        if target is None:
            return []
        return [r for r in pending if now - r.arrival_time + horizon >= self.config.risk_fraction * target]

    def at_risk(self, pending: list[Request], embed: bool, now: float, horizon: float = 0.0) -> bool:
        """Whether the oldest of a kind's pending requests will have waited `risk_fraction` of its kind's target
        by the end of the step being scheduled (`horizon`: its predicted seconds; 0 where steps are not timed):
        passed over in this step, it would be late for the next."""
        target = self.target(embed)
        if target is None or not pending:
            return False
        # NOTE: in-flight requests come first in `pending`, then waiting ones in arrival order (a preempted one
        # back at the front), so the oldest is among the in-flight ones or the first waiting one; a min over all
        # costs no more than the list the scheduler already built
        oldest = min(r.arrival_time for r in pending)
        return now - oldest + horizon >= self.config.risk_fraction * target
