"""Closing a structured output before its token budget runs out (`StructuredOutputsParams.close_on_length`).

Without it, a JSON-schema request that reaches `max_tokens` inside a string returns invalid JSON (vLLM does the
same). With it, the request keeps a plan: tokens that would close the structure from where it is
(`closing.closing_tokens`). The model samples as usual, under its grammar's mask; a sampled token that would leave a
closing longer than the tokens left after it is replaced by the plan's next token (by EOS when the output was already
complete). So once the tokens left equal the plan, every token the model samples is either one that still closes in
time (its own `"}` for the plan's `"` and `}`) or the plan's, and the output ends, at the budget, as the closing
completes. Only a replaced token marks the output as closed for its budget (`closed`: its finish_reason stays
"length" even when the closing completes the grammar). A model whose own tokens close the output in time is not
touched, as long as the closings found fit too: they are short, not always shortest (closing.py), so an output that
would end in exactly its budget's last tokens may be closed a little differently. A budget smaller than the shortest
closing (a schema whose required skeleton alone is longer) replaces nothing: no output of it could parse, and the
model keeps its tokens.

Plans are computed only in the last `horizon` tokens of the budget (`HORIZON`, or twice the closing of the empty
output, the schema's required skeleton, when that is longer; then twice the longest plan seen), and a plan is reused
while the sampled tokens follow it or leave it valid (a character added inside a string), so a request pays nothing
before its last tokens and 0.1-0.5 ms per structural token in them (~3 ms for a grammar that greedy cannot close,
closing.py; a state with no closing found is searched again after 1, 2, 4, ... tokens). What is still cut where the
budget ends: a structure whose closing is already longer than the tokens left when planning starts (the model opened
more than the horizon allows for), and one whose closing neither search of closing.py finds (a regex that ends in a
fixed sentence after free text: no closer leads there).
"""

from __future__ import annotations

import logging
from typing import Any

from orthrus_rag.structured.closing import ByteTokens, closing_tokens

logger = logging.getLogger(__name__)

HORIZON = 32  # tokens before the budget's end at which plans start being kept


class LengthGuard:
    """One request's token budget and its current closing plan, beside its llguidance matcher."""

    def __init__(self, budget: int, byte_tokens: ByteTokens, eos_token_id: int | None, horizon: int = HORIZON,
                 ) -> None:
        self.budget = budget
        self.used = 0
        self.closed = False  # a sampled token was replaced to close the structure in time
        self._byte_tokens = byte_tokens
        self._eos = eos_token_id
        self._plan: list[int] | None = None  # a closing from the current state; None: not computed
        self._horizon = horizon
        # NOTE: where no closing is found (a regex whose end is a fixed sentence after free text), the search is
        # retried after 1, 2, 4, ... tokens, not at every token: a few searches in all, not one per step
        self._retry_at = 0
        self._backoff = 1

    @property
    def remaining(self) -> int:
        return self.budget - self.used

    def prepare(self, matcher: Any) -> None:
        """Compute the plan that the next `take` checks against, if it is due (the runner calls this from the mask
        worker, while the forward runs, so that `take` seldom searches on the step's critical path)."""
        self._current_plan(matcher)

    def consumed(self, token_id: int) -> None:
        """Note a token the matcher took (a replayed one of a handed-off request, or one `take` kept)."""
        self.used += 1
        plan = self._plan
        self._plan = plan[1:] if plan and plan[0] == token_id else None

    def take(self, matcher: Any, token_id: int) -> int:
        """Consume a sampled token, or in its place the plan's next one when the sampled token would leave a
        closing longer than the tokens left; returns the token consumed (the sampled one when refused)."""
        old = self._current_plan(matcher)
        if not matcher.consume_token(token_id):
            return token_id  # refused: the matcher is in error (the caller reports it)
        self.consumed(token_id)
        if self._plan is not None or old is None or len(old) > self.remaining + 1:
            return token_id  # on the plan, not planning yet, or no plan fits
        # the token left the plan: does the old plan still close from here (a character added to a string), or a
        # new one, in the tokens left?
        if _still_closes(matcher, old) and len(old) <= self.remaining:
            self._plan = old
            return token_id
        new = self._current_plan(matcher)
        if new is not None and len(new) <= self.remaining:
            return token_id
        replacement = old[0] if old else self._eos
        if replacement is None or not matcher.rollback(1):
            return token_id
        self.used -= 1
        if not matcher.consume_token(replacement):  # the old plan was valid here: only a bug lands here
            logger.warning("the closing plan's token %d was refused: %s", replacement, matcher.get_error())
            return replacement
        self.used += 1
        self._plan = old[1:]
        self.closed = True
        return replacement

    def _current_plan(self, matcher: Any) -> list[int] | None:
        if self._plan is None and self.remaining <= self._horizon and self.used >= self._retry_at:
            self._plan = closing_tokens(matcher, self._byte_tokens)
            if self._plan is not None:
                self._horizon = max(self._horizon, 2 * len(self._plan))
                self._backoff = 1
            else:
                self._retry_at = self.used + self._backoff
                self._backoff *= 2
        return self._plan


def _still_closes(matcher: Any, plan: list[int]) -> bool:
    if matcher.validate_tokens(plan) != len(plan):
        return False
    check = matcher.deep_copy()
    return bool(check.consume_tokens(plan)) and check.is_accepting()
