"""What an engine step costs: predicted from its shape, learned from measured step times.

A fixed token budget treats every token alike, but a step's time is not proportional to its tokens: each
step pays a fixed part (reading every weight once, per-layer launches; on an H200 a 64-row decode of an 8B model
is all fixed part) and a part per token (GEMM work) and per attended key. The scheduler asks this model how many
prompt and embedding tokens fit beside a step's decodes before the step outgrows its time target.

The model is linear in seven features (1, decoder tokens, attention pairs Σ new x keys in thousands, encoder
tokens, rows under a LoRA adapter, distinct adapters in the step: each adapter adds small products to every
targeted layer, and sampled rows: each pays the LM head's product over the vocabulary and the sampler's draw,
SmolLM2's 576 x 49,152 head alone ~20% of a token's layer products), fitted by recursive least squares with forgetting, so it follows the machine it runs on: first from a
few timed steps at start-up (engine/executor/calibration.py), then from every measured step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShape:
    num_tokens: int  # decoder rows
    attention_pairs: int  # Σ over sequences of new tokens x keys
    num_encoder_tokens: float = 0  # in the embedding encoder's tokens (Request.encoder_tokens)
    num_adapter_rows: int = 0
    num_adapters: int = 0
    # rows that produce a token this step (every decode, a prompt's last chunk): without this term, steps of ~26
    # decodes overran the fit by 15-50% (docs/design/cost-model.md)
    num_sampled_rows: int = 0

    def features(self) -> np.ndarray:
        return np.array([1.0, self.num_tokens, self.attention_pairs / 1000.0, self.num_encoder_tokens,
                         self.num_adapter_rows, self.num_adapters, self.num_sampled_rows])


class StepCostModel:
    """Seconds per step as theta · features, fitted online (recursive least squares, forgetting `forget`)."""

    def __init__(self, forget: float = 0.995) -> None:
        # NOTE: a weak prior (20 ms + 1 ms per token, a 2-core CPU's order of magnitude) until steps are measured
        self.theta = np.array([0.02, 1e-3, 1e-4, 2.5e-4, 1e-5, 1e-3, 2e-4])
        self.cov = np.diag([1.0, 1e-4, 1e-4, 1e-4, 1e-6, 1e-3, 1e-4])
        self.forget = forget
        self.num_observed = 0

    def predict(self, shape: StepShape) -> float:
        return float(max(self.theta @ shape.features(), 0.0))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not np.isfinite(seconds) or seconds <= 0:
            return
        x = shape.features()
        px = self.cov @ x
        gain = px / (self.forget + x @ px)
        self.theta = self.theta + gain * (seconds - self.theta @ x)
        self.cov = (self.cov - np.outer(gain, px)) / self.forget
        # NOTE: a cost never falls with more work; keep the fit physical under noisy early steps
        self.theta[1:] = np.maximum(self.theta[1:], 0.0)
        self.theta[0] = max(self.theta[0], 0.0)
        self.num_observed += 1

    @property
    def seconds_per_token(self) -> float:
        return float(self.theta[1])

    def tokens_within(self, shape: StepShape, target: float, pairs_per_token: float) -> int:
        """How many more decoder tokens (each attending `pairs_per_token` keys) fit in `target` seconds beside
        `shape`'s work (prompt tokens: a chunk's one sampled row, if it is the prompt's last, is left out)."""
        left = target - self.predict(shape)
        per_token = self.theta[1] + self.theta[2] * pairs_per_token / 1000.0
        if left <= 0:
            return 0
        if per_token <= 0:
            return 1 << 30
        return int(left / per_token)

    def describe(self) -> str:
        t = self.theta
        return (f"{t[0] * 1e3:.1f} ms + {t[1] * 1e3:.3f} ms/token + {t[2] * 1e3:.4f} ms/1k pairs + "
                f"{t[3] * 1e3:.3f} ms/encoder token + {t[4] * 1e3:.4f} ms/adapter row + {t[5] * 1e3:.2f} ms/adapter + "
                f"{t[6] * 1e3:.3f} ms/sampled row ({self.num_observed} steps)")

