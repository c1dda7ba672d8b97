"""A short way to finish a structure: from a matcher's state, the tokens that bring its grammar to an accepting state
(close the open string, the open objects and arrays, write the required keys that are missing with minimal values;
end a Lark sentence).

llguidance gives no shortest completion, so one is searched for on copies of the matcher (a copy costs ~2 us),
byte by byte, with bytes the grammar forces (`compute_ff_bytes`: a required key's name, the rest of an enum value)
taken whole:
- greedily first, for JSON: a `}` or `]` that closes structure, else `"`, else `0`, else the lowest other byte the
  grammar allows (one token mask, ~10 us, gives the allowed bytes): 0.1-0.4 ms for a JSON schema;
- where greedy runs past `MAX_CLOSING_BYTES` (a grammar whose way out is not a closer, e.g. a list that ends with a
  "."), breadth first over the allowed bytes, at most `MAX_SEARCH_NODES` states.
The bytes are then written in the fewest tokens the tokenizer gives them (its own tokenization, when the grammar takes
it), else one token per byte.

Neither search is always shortest (greedy takes the enum value with the lowest first byte, not the shortest one),
but what is returned is always a completion the grammar accepts.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

MAX_CLOSING_BYTES = 256  # a structure needing more is left as it is (its budget cannot be planned for)
MAX_SEARCH_NODES = 32  # states the breadth-first fallback expands

_QUOTE = ord('"')
_CLOSERS = b"}]"
# NOTE: `"` first: inside a string it ends the string; `0` is the shortest number. The rest are every other byte, in
# order, so that any grammar that allows some byte gets one
_PREFERRED = bytes(dict.fromkeys(b'"0' + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100)) + bytes(range(0x20))
                                  + b"\x7f"))


class ByteTokens:
    """The one-byte token of each byte value (None where the vocabulary has none), read once per tokenizer."""

    def __init__(self, lltokenizer: Any) -> None:
        self.tokenizer = lltokenizer
        self.of: list[int | None] = []
        for b in range(256):
            ids = lltokenizer.tokenize_bytes(bytes([b]))
            self.of.append(ids[0] if len(ids) == 1 else None)
        # the bytes that have a token, in `_PREFERRED` order, and where each token's bit lies in a mask's bytes
        self._bytes = np.array([b for b in _PREFERRED if self.of[b] is not None], dtype=np.int64)
        ids = np.array([self.of[b] for b in self._bytes], dtype=np.int64)
        self._at, self._bit = ids >> 3, (ids & 7).astype(np.uint8)

    def tokens(self, data: bytes) -> list[int] | None:
        """One token per byte; None if a byte has no token of its own."""
        ids = [self.of[b] for b in data]
        return None if None in ids else ids  # type: ignore[return-value]

    def allowed(self, matcher: Any) -> list[int]:
        """The bytes whose one-byte token `matcher` allows next, in `_PREFERRED` order (one mask: ~10 us)."""
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        return self._bytes[(mask[self._at] >> self._bit) & 1 == 1].tolist()


def closing_tokens(matcher: Any, byte_tokens: ByteTokens) -> list[int] | None:
    """Tokens that take llguidance matcher `matcher` (left unchanged) to an accepting state: [] when it is in one
    already, None when it is in error or neither search found a closing."""
    if matcher.is_error():
        return None
    closing = _greedy(matcher, byte_tokens)
    if closing is None:
        closing = _breadth_first(matcher, byte_tokens)
    if closing is None:
        return None
    per_byte = byte_tokens.tokens(closing)
    assert per_byte is not None, "the searches only take bytes that have a token"
    fewer = byte_tokens.tokenizer.tokenize_bytes(closing)
    if len(fewer) < len(per_byte):
        check = matcher.deep_copy()
        if check.consume_tokens(fewer) and check.is_accepting():
            return fewer
    return per_byte


def _greedy(matcher: Any, byte_tokens: ByteTokens) -> bytes | None:
    work = matcher.deep_copy()
    closing = bytearray()
    while not work.is_accepting():
        if len(closing) >= MAX_CLOSING_BYTES:
            return None
        forced = work.compute_ff_bytes()
        if not forced:
            b = _next_byte(work, byte_tokens)
            forced = bytes([b]) if b is not None else b""
        ids = byte_tokens.tokens(forced)
        if not forced or ids is None or not work.consume_tokens(ids):
            return None  # nothing allowed, or a forced byte with no token of its own
        closing += forced
    return bytes(closing)


def _next_byte(work: Any, byte_tokens: ByteTokens) -> int | None:
    """The byte greedy takes next: a closer that ends structure (after it no `"` may follow at once, which tells a
    `}` closing an object from a `}` written inside a string), else the first allowed byte in `_PREFERRED`."""
    quote = byte_tokens.of[_QUOTE]
    for b in _CLOSERS:
        tok = byte_tokens.of[b]
        if tok is not None and work.validate_tokens([tok] if quote is None else [tok, quote]) == 1:
            return b
    for b in _PREFERRED[:2]:  # NOTE: `"` and `0` by themselves first: a one-token check is ~1 us, a mask ~10
        tok = byte_tokens.of[b]
        if tok is not None and work.validate_tokens([tok]) == 1:
            return b
    allowed = byte_tokens.allowed(work)
    return allowed[0] if allowed else None


def _breadth_first(matcher: Any, byte_tokens: ByteTokens) -> bytes | None:
    """The closing with the fewest search steps (a forced run of bytes is one step), among the first
    `MAX_SEARCH_NODES` states."""
    queue: deque[bytes] = deque([b""])
    for _ in range(MAX_SEARCH_NODES):
        if not queue:
            return None
        path = queue.popleft()
        work = matcher.deep_copy()
        ids = byte_tokens.tokens(path)
        forced = b""
        if ids is None or not work.consume_tokens(ids):
            continue
        while len(path) + len(forced) < MAX_CLOSING_BYTES and (more := work.compute_ff_bytes()) \
                and (more_ids := byte_tokens.tokens(more)) is not None and work.consume_tokens(more_ids):
            forced += more
        if work.is_accepting():
            return path + forced
        if len(path) + len(forced) >= MAX_CLOSING_BYTES:
            continue
        queue.extend(path + forced + bytes([b]) for b in byte_tokens.allowed(work))
    return None
