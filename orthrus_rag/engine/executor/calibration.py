"""Start-up calibration of the step-cost model (engine/core/step_cost.py): a few timed forwards of the real model."""

from __future__ import annotations

import logging
import time
from typing import Any

from orthrus_rag.engine.core.request import Request, RequestKind
from orthrus_rag.engine.core.step_output import ScheduledRequest, SchedulerOutput
from orthrus_rag.engine.core.step_cost import StepCostModel
from orthrus_rag.params import PoolingParams

logger = logging.getLogger(__name__)


def calibrate(runner: Any, model: StepCostModel, max_tokens: int, max_seconds: float = 1.0) -> None:
    """Fit `model` to a few timed forwards of `runner`'s real model, within about `max_seconds`.

    The steps are made of throw-away single-chunk embedding requests: those need no KV blocks, so calibration
    touches no request and no block of the engine.
    """
    def step(num_seqs: int, length: int) -> SchedulerOutput:
        reqs = [Request(f"calibrate-{i}", RequestKind.EMBED, [0] * length,
                        pooling_params=PoolingParams(normalize=False)) for i in range(num_seqs)]
        return SchedulerOutput(scheduled=[ScheduledRequest(r, length) for r in reqs])

    shapes = [(1, 1), (16, 1), (1, 64), (2, 128), (1, max_tokens)]
    start = time.perf_counter()
    runner.execute(step(1, 1))  # warm-up: first-call allocations are not a step's cost
    for num_seqs, length in shapes:
        if num_seqs * length > max_tokens:
            continue
        if time.perf_counter() - start > max_seconds:
            break
        sched = step(num_seqs, length)
        seconds = runner.execute(sched).seconds  # device time: on CUDA these steps return before they finish
        if seconds is not None:
            model.observe(sched.shape(), seconds)
    logger.debug("step cost calibrated in %.2f s: %s", time.perf_counter() - start, model.describe())
