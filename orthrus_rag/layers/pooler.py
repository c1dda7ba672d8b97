"""Incremental poolers: turn a request's hidden states, arriving chunk by chunk, into one embedding.

A request's tokens run through the decoder over several steps, in order. After each step the runner calls
`state.update(hidden, positions)` with that chunk's final hidden states; `state.finish()` gives the
embedding. Equal to `pool_whole` on the full sequence up to floating-point reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orthrus_rag.params import PoolingParams


class PoolerState:
    """Per-request pooling state. Subclasses implement `update` and `_pool`; `finish` normalises."""

    def __init__(self, params: PoolingParams, num_tokens: int) -> None:
        self.params = params
        self.num_tokens = num_tokens
        self.num_seen = 0  # a Python count, so locating position 0 / n-1 needs no device sync

    def update(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Fold in one chunk: hidden [n, d], positions [n] (0-based, consecutive, chunks in order)."""
        raise NotImplementedError

    def _pool(self) -> torch.Tensor:
        raise NotImplementedError

    def finish(self) -> torch.Tensor:
        """The embedding: float32 [d] ([n, d] for 'all'), or the head's output on it, L2-normalised if asked."""
        if self.num_seen != self.num_tokens:
            raise RuntimeError(f"pooler saw {self.num_seen} of {self.num_tokens} tokens before finish()")
        return _finish(self._pool(), self.params)


class MeanState(PoolerState):
    """Running float32 sum and count; O(d) memory."""

    def __init__(self, params: PoolingParams, num_tokens: int) -> None:
        super().__init__(params, num_tokens)
        self.total: torch.Tensor | None = None

    def update(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        chunk = hidden.float().sum(0)  # fp32 accumulator: bf16 sums over thousands of tokens lose digits
        self.total = chunk if self.total is None else self.total + chunk
        self.num_seen += hidden.shape[0]

    def _pool(self) -> torch.Tensor:
        return self.total / self.num_seen


class WeightedMeanState(PoolerState):
    """Running Σ w_t·h_t and Σ w_t; w_t = t (1-based, SGPT) or the caller's weights[position]."""

    def __init__(self, params: PoolingParams, num_tokens: int) -> None:
        super().__init__(params, num_tokens)
        self.weights = None if params.weights is None else torch.as_tensor(params.weights, dtype=torch.float32)
        self.total: torch.Tensor | None = None
        self.weight_sum: torch.Tensor | None = None

    def update(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        if self.weights is None:
            w = positions.to(hidden.device, torch.float32) + 1.0
        else:
            if self.weights.device != hidden.device:  # move once, not every step
                self.weights = self.weights.to(hidden.device)
            w = self.weights[positions.to(hidden.device)]
        chunk = (hidden.float() * w[:, None]).sum(0)
        self.total = chunk if self.total is None else self.total + chunk
        self.weight_sum = w.sum() if self.weight_sum is None else self.weight_sum + w.sum()
        self.num_seen += hidden.shape[0]

    def _pool(self) -> torch.Tensor:
        return self.total / self.weight_sum


class TokenState(PoolerState):
    """Keep the hidden state of one position: 0 for cls/first, num_tokens - 1 for last."""

    def __init__(self, params: PoolingParams, num_tokens: int, position: int) -> None:
        super().__init__(params, num_tokens)
        self.position = position
        self.kept: torch.Tensor | None = None

    def update(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        row = self.position - self.num_seen
        if 0 <= row < hidden.shape[0]:
            # copy: the runner may hand us a view of a buffer it reuses next step
            self.kept = hidden[row].to(torch.float32, copy=True)
        self.num_seen += hidden.shape[0]

    def _pool(self) -> torch.Tensor:
        return self.kept


class AllState(PoolerState):
    """Keep every hidden row (O(n·d) memory): the float32 [n, d] matrix."""

    def __init__(self, params: PoolingParams, num_tokens: int) -> None:
        super().__init__(params, num_tokens)
        self.chunks: list[torch.Tensor] = []

    def update(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        self.chunks.append(hidden.detach().clone())  # clone: the runner's buffer may be reused
        self.num_seen += hidden.shape[0]

    def _pool(self) -> torch.Tensor:
        return torch.cat(self.chunks).float()


def _finish(pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """The head, then L2 normalisation, as asked: what every pooling ends with."""
    out = params.head(pooled) if params.head is not None else pooled
    return F.normalize(out, dim=-1) if params.normalize else out


def _check_weights(params: PoolingParams, num_tokens: int) -> None:
    if params.weights is not None and len(params.weights) != num_tokens:
        raise ValueError(f"got {len(params.weights)} pooling weights for {num_tokens} tokens; need one per token")


def make_pooler_state(params: PoolingParams, num_tokens: int, start: int = 0) -> PoolerState:
    """A fresh pooling state for a request of `num_tokens` tokens whose first `start` came from the prefix cache
    (their hidden states never pass here: only `last` pooling can start past 0, as a scored pair does)."""
    if num_tokens < 1:
        raise ValueError(f"cannot pool an empty sequence (num_tokens={num_tokens})")
    if start:
        if params.pooling != "last" or not 0 < start < num_tokens:
            raise ValueError(f"pooling={params.pooling} cannot start at token {start} of {num_tokens}")
        state = TokenState(params, num_tokens, num_tokens - 1)
        state.num_seen = start
        return state
    _check_weights(params, num_tokens)
    if params.pooling == "mean":
        return MeanState(params, num_tokens)
    if params.pooling == "weighted_mean":
        return WeightedMeanState(params, num_tokens)
    if params.pooling in ("cls", "first"):
        return TokenState(params, num_tokens, 0)
    if params.pooling == "last":
        return TokenState(params, num_tokens, num_tokens - 1)
    return AllState(params, num_tokens)


def pool_whole(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Reference: pool a whole [n, d] sequence at once (tests, and the encoder path that runs unchunked)."""
    n = hidden.shape[0]
    if n < 1:
        raise ValueError("cannot pool an empty sequence")
    _check_weights(params, n)
    h = hidden.float()
    if params.pooling == "mean":
        out = h.mean(0)
    elif params.pooling == "weighted_mean":
        if params.weights is None:
            w = torch.arange(1, n + 1, dtype=torch.float32, device=h.device)
        else:
            w = torch.as_tensor(params.weights, dtype=torch.float32, device=h.device)
        out = (h * w[:, None]).sum(0) / w.sum()
    elif params.pooling in ("cls", "first"):
        out = h[0].clone()  # clone: never hand back a view of the caller's buffer
    elif params.pooling == "last":
        out = h[-1].clone()
    else:
        out = h.clone()
    return _finish(out, params)
