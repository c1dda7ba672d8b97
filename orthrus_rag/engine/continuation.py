"""Continuing a finished generation with appended tokens, keeping its KV: a reasoning-search round (the model stopped
at `</search>`, the passages are appended, it reasons on), a chat's next turn, IRCoT's growing chain.

A generation asks for it with `SamplingParams.hold_kv_s`. When it finishes, the engine remembers its tokens (prompt
and output, here) and the block manager pins its cached blocks until the deadline (engine/core/block_manager.py).
`Engine.continue_(request_id, appended)` then queues a request over prompt + output + appended under the same id
(which drops the hold once admitted): its prefix comes from the held blocks, so it computes only the last partial
block and the appended tokens, and its greedy tokens are those of a fresh request over the whole sequence. Past the
deadline, or when running requests needed the blocks, the continuation still runs: it takes what the prefix cache
kept and recomputes the rest.

The records are tokens only and bounded (the `MAX_RECORDS` most recent, `MAX_RECORD_TOKENS` tokens in all); the KV
they point to is bounded by the hold deadlines and by the cache itself. A round under the same id that is not
continuable (no `hold_kv_s`, aborted, failed) removes the record, so `continue_` never resumes an older round;
`Engine.release` drops a record and its hold at once (a caller done with the sequence).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from orthrus_rag.engine.core.request import Request
from orthrus_rag.params import SamplingParams

MAX_RECORDS = 4096  # finished generations a continuation can still name (tokens only; oldest forgotten first)
MAX_RECORD_TOKENS = 8 << 20  # their tokens in all (4 bytes each: 32 MiB)


@dataclass
class Continuable:
    token_ids: array  # prompt + output, as the model saw and produced them
    params: SamplingParams  # the generation's own: a continuation without params of its own reuses them


class Continuations:
    """The finished generations that may be continued, by request id."""

    def __init__(self, max_records: int = MAX_RECORDS, max_tokens: int = MAX_RECORD_TOKENS) -> None:
        self.max_records, self.max_tokens = max_records, max_tokens
        self._records: OrderedDict[str, Continuable] = OrderedDict()
        self._num_tokens = 0

    def remember(self, req: Request) -> None:
        """Record a generation the scheduler just finished (or aborted): its tokens if it is continuable; otherwise
        whatever an earlier round under its id left is forgotten."""
        self.forget(req.req_id)
        if not req.is_continuable:
            return
        assert req.sampling_params is not None
        record = Continuable(array("i", req.all_token_ids), req.sampling_params)
        self._records[req.req_id] = record
        self._num_tokens += len(record.token_ids)
        while self._records and (len(self._records) > self.max_records or self._num_tokens > self.max_tokens):
            _, old = self._records.popitem(last=False)
            self._num_tokens -= len(old.token_ids)

    def forget(self, request_id: str) -> bool:
        """Drop the record of `request_id`; whether there was one."""
        old = self._records.pop(request_id, None)
        if old is not None:
            self._num_tokens -= len(old.token_ids)
        return old is not None

    def get(self, request_id: str) -> Continuable:
        record = self._records.get(request_id)
        if record is None:
            raise ValueError(f"no finished generation {request_id!r} to continue: it is unknown, did not set "
                             f"SamplingParams.hold_kv_s, was aborted, or is older than the last {self.max_records}")
        return record

    def __len__(self) -> int:
        return len(self._records)
