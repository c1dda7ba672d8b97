"""`EngineClientDriver`: the submit / poll `ServingClient` seam over any `EngineClient`, so the load drivers of the
benchmarks measure a client (a running server through `RemoteClient`, an `AsyncEngine`, a deployment) the way they
measure the in-process engine and the peers: from the caller's side, one request at a time."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace

from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.outputs import EngineOutput, error_output
from orthrus_rag.params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)


class EngineClientDriver:
    """Owns `client` and a private event loop thread that every request of it runs on (an `EngineClient` binds
    to one loop). A request that fails comes back as an error output naming why; the others go on."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client-driver", daemon=True)
        self._thread.start()
        self._done: queue.SimpleQueue[EngineOutput] = queue.SimpleQueue()
        self._closed = False

    def submit(self, kind: str, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        if self._closed:
            raise RuntimeError("the driver is shut down")
        kind = RequestKind(kind)  # NOTE: a ValueError naming the kinds for anything else
        call = self.client.generate if kind is RequestKind.GENERATE else self.client.embed
        future = asyncio.run_coroutine_threadsafe(call(input, params, request_id), self._loop)
        future.add_done_callback(lambda f: self._done.put(_finished(kind.value, request_id, f)))

    def poll(self, timeout_s: float) -> list[EngineOutput]:
        try:
            outputs = [self._done.get(timeout=max(0.0, timeout_s))]
        except queue.Empty:
            return []
        while True:
            try:
                outputs.append(self._done.get_nowait())
            except queue.Empty:
                return outputs

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop).result(60)
        except Exception as exc:  # noqa: BLE001 (the loop still stops)
            logger.warning("closing the client failed: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _finished(kind: str, request_id: str, future: Future) -> EngineOutput:
    """The request's final output under the caller's id, or an error output naming why it failed."""
    try:
        out = future.result()
    except BaseException as exc:  # noqa: BLE001 (reported as this request's output)
        return error_output(kind, request_id, f"{type(exc).__name__}: {exc}")
    return out if out.request_id == request_id else replace(out, request_id=request_id)
