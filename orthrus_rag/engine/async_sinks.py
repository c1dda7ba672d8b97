"""Where an `AsyncEngine` request's results wait on the event loop: a future for an awaited request, or a queue of
growing snapshots for a stream (event-loop side only; the engine thread hands them over in batches)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from orthrus_rag.engine.clients.protocol import RequestAborted
from orthrus_rag.outputs import GenerationOutput


class Snapshots:
    """A stream's pending items. Unread snapshots are cumulative, so a newer one replaces an unread older one:
    a slow consumer holds O(1) snapshots, not one per token."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    def put_nowait(self, item: Any) -> None:
        last = self._items[-1] if self._items else None
        if is_snapshot(last) and is_snapshot(item):
            self._items[-1] = item
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def is_snapshot(item: Any) -> bool:
    return isinstance(item, GenerationOutput) and not item.finished


class Sink:
    """Where one request's results go: a future (embed/generate) or a queue (stream). Event-loop side only."""

    def __init__(self, request_id: str, queue: Snapshots | None = None,
                 future: asyncio.Future[Any] | None = None, bulk: bool = False) -> None:
        assert (queue is None) != (future is None)
        self.request_id, self.queue, self.future, self.bulk = request_id, queue, future, bulk

    def put(self, item: Any) -> None:
        if self.queue is not None:
            self.queue.put_nowait(item)
        elif not self.future.done():  # NOTE: done when the awaiting caller was cancelled
            if is_abort(item):  # an awaiter of an aborted request gets RequestAborted, a stream its final output
                item = RequestAborted(self.request_id)
            if isinstance(item, BaseException):
                self.future.set_exception(item)
            else:
                self.future.set_result(item)


def is_abort(item: Any) -> bool:
    return getattr(item, "finish_reason", None) == "abort" and getattr(item, "finished", False)
