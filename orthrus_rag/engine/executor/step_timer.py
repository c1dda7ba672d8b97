"""How long one runner step takes on its device: what the step-cost model (engine/step_cost.py) learns from.

CUDA runs kernels asynchronously, so a host clock read when a step's launches return measures launch time, not
step time: an embedding-only step returns before its GEMMs finish (calibration is made of such steps). On CUDA a
step is therefore bracketed by two CUDA events on the device's current stream and the end event is waited for;
the wait sits at the step boundary, where a step that samples tokens synchronises anyway (`.tolist()`). On
other devices execution is synchronous and the host clock is the step time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def run_timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """`fn()` and the seconds it took on `device` (CUDA: event to event, the end waited for)."""
    if device.type != "cuda":
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start
    stream = torch.cuda.current_stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    result = fn()
    end.record(stream)
    end.synchronize()  # NOTE: elapsed_time needs both events completed; this is the step-boundary sync
    return result, begin.elapsed_time(end) / 1e3
