"""A step's constrained rows: fill one bitmask row per constrained request, mask those logits, advance the
matchers past the sampled tokens. Only constrained rows are touched; the logits are copied only when a constrained
row also reports log-probabilities (those are of the raw distribution, as vLLM reports them)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab / 32)], every token allowed (bit 1)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask [rows, vocab] a bitmask encodes (token t is bit t % 32 of word t // 32)."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.view(bitmask.size(0), -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every disallowed token's logit to -inf, in place (logits [rows, vocab], bitmask [rows, words])."""
    logits.masked_fill_(~allowed_tokens(bitmask.to(logits.device), logits.size(1)), float("-inf"))


def constrain(logits: torch.Tensor, matchers: Sequence[Any], eos_token_id: int | None,
              keep_raw: bool = False) -> torch.Tensor:
    """The logits to sample from, each constrained row (its matcher not None) masked to what its grammar allows
    next: `logits` itself, masked in place, or a masked copy with `keep_raw`. A row whose grammar allows nothing (a matcher
    in error) is left only EOS, so the request ends instead of sampling from an empty distribution."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    bitmask = allocate_bitmask(len(rows), logits.size(1))
    for j, i in enumerate(rows):
        matchers[i].fill(bitmask, j)
    empty = ~bitmask.any(dim=1)
    if bool(empty.any()):
        for j in empty.nonzero().flatten().tolist():
            logger.warning("a constrained request's grammar allows no token (%s); ending it",
                           matchers[rows[j]].error or "no error reported")
            bitmask[j] = 0
            if eos_token_id is not None:
                bitmask[j, eos_token_id // 32] = 1 << (eos_token_id % 32) if eos_token_id % 32 != 31 else -(2**31)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone() if keep_raw else logits
    sub = masked.index_select(0, index)
    apply_bitmask(sub, bitmask)
    masked.index_copy_(0, index, sub)
    return masked


def advance(matchers: Sequence[Any], token_ids: Sequence[int]) -> None:
    """Move each constrained row's matcher past its sampled token."""
    for matcher, tok in zip(matchers, token_ids):
        if matcher is not None and not matcher.consume(tok):
            logger.warning("a constrained request sampled token %d its grammar refused (%s)", tok, matcher.error)
