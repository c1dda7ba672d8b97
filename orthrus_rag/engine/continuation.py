"""Continuing a finished generation with appended tokens, keeping its KV: a reasoning-search round (the model stopped
at `</search>`, the passages are appended, it reasons on), a chat's next turn, IRCoT's growing chain.

A generation asks for it with `SamplingParams.hold_kv_s`. When it finishes, the engine remembers its tokens (prompt
and output, here) and the block manager pins its cached blocks until the deadline (engine/core/block_manager.py).
`Engine.continue_(request_id, appended)` then queues a request over prompt + output + appended under the same id
(which drops the hold once admitted): its prefix comes from the held blocks, so it computes only the last partial block and the appended tokens, and its
greedy tokens are those of a fresh request over the whole sequence. Past the deadline, or when running requests
needed the blocks, the continuation still runs: it takes what the prefix cache kept and recomputes the rest.

The records are tokens only and bounded (the `MAX_RECORDS` most recent); the KV they point to is bounded by the
hold deadlines and by the cache itself.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from orthrus_rag.engine.core.request import Request
from orthrus_rag.params import SamplingParams

MAX_RECORDS = 4096  # finished generations a continuation can still name (tokens only; oldest forgotten first)


@dataclass
class Continuable:
    token_ids: array  # prompt + output, as the model saw and produced them
    params: SamplingParams  # the generation's own: a continuation without params of its own reuses them


class Continuations:
    """The finished generations that may be continued, by request id."""

    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self.max_records = max_records
        self._records: OrderedDict[str, Continuable] = OrderedDict()

    def remember(self, req: Request) -> None:
        """Record a generation the scheduler just finished, if it asked to be continuable."""
        if not req.is_continuable:
            return
        assert req.sampling_params is not None
        self._records[req.req_id] = Continuable(array("l", req.all_token_ids), req.sampling_params)
        self._records.move_to_end(req.req_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> Continuable:
        record = self._records.get(request_id)
        if record is None:
            raise ValueError(f"no finished generation {request_id!r} to continue: it is unknown, did not set "
                             f"SamplingParams.hold_kv_s, was aborted, or is older than the last {self.max_records}")
        return record

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)
