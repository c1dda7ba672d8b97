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

`embed_p95_s="auto"`: the target is `auto_multiple` times an embedding's own unloaded latency, the step-cost model's
prediction (engine/core/step_cost.py) of a step that holds one embedding of the mean length seen so far and nothing
else; the model is calibrated at start-up and refitted from every step, so the target follows the machine and the
load's embeddings. A fixed target is a number only a benchmark on the same machine can give: the same 0.13 s that
held embeddings at 0.79x the separate servers' p95 on an AMX Xeon gave 13x on an AVX2 EPYC at its defaults.

None takes work away when nothing is at risk: the step stays as large as its budget and the remaining-token split
decides (work-conserving). Deadlines count from a request's arrival, so a request that waited in the queue is at
risk sooner than one that just came.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from orthrus_rag.config.engine import SloConfig
from orthrus_rag.engine.core.request import Request
from orthrus_rag.engine.core.step_cost import StepCostModel, StepShape

logger = logging.getLogger(__name__)

# "auto": the embedding length assumed before one is seen (tokens; a question or a short passage), how fast the
# running mean follows new ones, and a floor under the target (a fit not yet calibrated may predict ~0)
AUTO_FIRST_TOKENS = 32.0
AUTO_LENGTH_WEIGHT = 0.05
AUTO_FLOOR_S = 0.02


class LatencyTargets:
    def __init__(self, config: SloConfig, cost_model: Callable[[], StepCostModel | None] = lambda: None) -> None:
        self.config = config
        # "auto": the step-cost model (the scheduler's, read when the target is) and the embeddings seen so far
        self.cost_model = cost_model
        self.embed_tokens = AUTO_FIRST_TOKENS
        self.embed_on_encoder = False
        self._logged_auto: float | None = None  # the auto target last logged

    @property
    def itl_s(self) -> float | None:
        return self.config.itl_s

    def note_embedding(self, req: Request) -> None:
        """An embedding request arrived: its length joins the running mean an `auto` target is predicted for."""
        self.embed_tokens += AUTO_LENGTH_WEIGHT * (req.num_tokens - self.embed_tokens)
        self.embed_on_encoder = req.on_encoder

    def embed_target(self) -> float | None:
        """The embeddings' end-to-end target in seconds (None: none); `auto` predicted now (see the module)."""
        value = self.config.embed_p95_s
        if value != "auto":
            return value
        unloaded = self.unloaded_embed_s()
        target = max(self.config.auto_multiple * unloaded, AUTO_FLOOR_S)
        # NOTE: logged once the model has seen steps, then each time it moved by a quarter
        if ((cost := self.cost_model()) is not None and cost.num_observed
                and (self._logged_auto is None or abs(target - self._logged_auto) > 0.25 * self._logged_auto)):
            self._logged_auto = target
            logger.info("slo.embed_p95_s=auto: %.3f s (%g x an embedding's unloaded %.1f ms, %.0f tokens)", target,
                        self.config.auto_multiple, 1e3 * unloaded, self.embed_tokens)
        return target

    def unloaded_embed_s(self) -> float:
        """The predicted seconds of a step holding one embedding of the mean length alone (0 without a model)."""
        cost = self.cost_model()
        if cost is None:
            return 0.0
        n = max(1, round(self.embed_tokens))
        shape = (StepShape(0, 0, num_encoder_tokens=n) if self.embed_on_encoder
                 else StepShape(n, n * (n + 1) // 2))
        return cost.predict(shape)

    def step_time_bound(self, with_decodes: bool) -> float | None:
        """How long a step may be predicted to take (None: no bound): the inter-token target where the step
        carries decodes, half the embedding target always, the tighter of those that apply."""
        embed = self.embed_target()
        bounds = [b for b in (self.config.itl_s if with_decodes else None, embed / 2 if embed else None) if b]
        return min(bounds) if bounds else None

    def target(self, embed: bool) -> float | None:
        """The end-to-end target of a kind (None: none)."""
        return self.embed_target() if embed else self.config.generate_p95_s

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
