"""`RayServeClient`'s promise when a replica dies, without a cluster: a call that nothing of had reached the caller
is sent again (Ray's router picks a live replica) and answered; a stream that already yielded text ends with
`EngineUnavailable` (a retryable 503) rather than being sent again; spent retries are a 503 too. The handle is a
fake that fails with Ray's own replica-death errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402

from orthrus_rag.engine.clients.protocol import EngineUnavailable  # noqa: E402
from orthrus_rag.entrypoints.ray.client import RayServeClient  # noqa: E402
from orthrus_rag.outputs import GenerationOutput, ScoreOutput  # noqa: E402
from orthrus_rag.params import (  # noqa: E402
    EmbeddingSpace,  # noqa: E402
    PoolingParams,
    RerankParams,
    SamplingParams,
)

DIED = ActorDiedError()
UNAVAILABLE = ActorUnavailableError("its node went away", None)


class _Stream:
    """What `handle.options(stream=True).m.remote()` returns: an async iterator that can be cancelled."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.cancelled = items, False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A deployment handle whose n-th call (any method) has the n-th outcome: a value, an exception to raise, or
    (streams) a list of snapshots that may end in an exception. `sent` records each call as (method, args)."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.sent: list[tuple[str, tuple]] = []
        self.streams: list[_Stream] = []
        self._stream = False

    def options(self, stream: bool = False) -> "FakeHandle":
        self._stream = stream
        return self

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _Method:
            def remote(self, *args: Any) -> Any:
                handle.sent.append((method, args))
                outcome = handle.outcomes.pop(0)
                if handle._stream:
                    handle._stream = False
                    handle.streams.append(_Stream(outcome))
                    return handle.streams[-1]

                async def answer() -> Any:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    return outcome
                return answer()

        return _Method()


def _client(handle: FakeHandle, retries: int = 2, rerankers: tuple[str, ...] = ("backbone",)) -> RayServeClient:
    return RayServeClient(handle, tokenizer=None, embedding_space=EmbeddingSpace("fake"), max_in_flight=8,
                          retries=retries, reranker_names=rerankers)


def _snapshot(text: str, finished: bool) -> GenerationOutput:
    return GenerationOutput("r/1", [1], [2] * len(text), text, "stop" if finished else None, finished=finished)


CALLS = {"generate": ("Who wrote Hamlet?", SamplingParams(max_tokens=4)),
         "embed": ("a passage", PoolingParams()),
         "embed_many": (["one", "two"], PoolingParams()),
         "score_pairs": ([("a query", "one"), ("a query", "two")], RerankParams(reranker="backbone"))}


@pytest.mark.parametrize("failure", [DIED, UNAVAILABLE], ids=["died", "unavailable"])
@pytest.mark.parametrize("method", list(CALLS))
async def test_a_call_whose_replica_died_is_sent_again_and_answered(method: str, failure: Exception) -> None:
    handle = FakeHandle(failure, "the answer")
    client = _client(handle)
    assert await getattr(client, method)(*CALLS[method]) == "the answer"  # not a 503
    assert handle.sent == [(method, CALLS[method])] * 2  # the same call, sent once more
    assert client.num_in_flight == 0


async def test_a_rerank_call_goes_to_one_replica_and_keeps_the_documents_order() -> None:
    scored = [ScoreOutput("r/1", 0.25, 7), ScoreOutput("r/2", 0.75, 9)]
    handle = FakeHandle(DIED, scored)
    client = _client(handle)
    assert await client.score("a query", ["one", "two"]) == [0.25, 0.75]
    assert handle.sent == [("score_pairs", ([("a query", "one"), ("a query", "two")], None))] * 2  # one call each
    assert client.num_in_flight == 0
    with pytest.raises(TypeError, match="list of strings"):
        await client.score("a query", "one document")


async def test_a_deployment_without_rerankers_refuses_scoring_before_any_call() -> None:
    handle = FakeHandle("never asked for")
    with pytest.raises(ValueError, match="model.rerankers"):
        await _client(handle, rerankers=()).score_pairs([("a query", "one")])
    assert handle.sent == []


async def test_spent_retries_are_a_retryable_503() -> None:
    handle = FakeHandle(DIED, UNAVAILABLE, DIED, "never asked for")
    with pytest.raises(EngineUnavailable, match="ActorDiedError"):
        await _client(handle, retries=2).generate(*CALLS["generate"])
    assert len(handle.sent) == 3
    handle = FakeHandle(DIED, "never asked for")  # deploy.retries=0: the first failure is the answer
    with pytest.raises(EngineUnavailable):
        await _client(handle, retries=0).embed(*CALLS["embed"])
    assert len(handle.sent) == 1


async def test_other_failures_are_not_sent_again() -> None:
    """A request the engine refused would be refused again: only a replica's death is retried."""
    handle = FakeHandle(ValueError("prompt too long"), "never asked for")
    with pytest.raises(ValueError, match="prompt too long"):
        await _client(handle).generate(*CALLS["generate"])
    assert len(handle.sent) == 1


async def test_a_stream_whose_replica_died_before_its_first_snapshot_is_sent_again() -> None:
    first, last = _snapshot("Sh", False), _snapshot("Shakespeare", True)
    handle = FakeHandle([DIED], [first, last])
    got = [s.text async for s in _client(handle).generate_stream(*CALLS["generate"])]
    assert got == ["Sh", "Shakespeare"] and len(handle.sent) == 2
    assert handle.streams[0].cancelled and not handle.streams[1].cancelled  # the broken one is let go, not the done


async def test_a_stream_that_already_yielded_text_ends_with_a_503_not_a_second_answer() -> None:
    handle = FakeHandle([_snapshot("Sh", False), DIED], [_snapshot("Shakespeare", True)])
    got: list[str] = []
    with pytest.raises(EngineUnavailable, match="stream"):
        async for snapshot in _client(handle).generate_stream(*CALLS["generate"]):
            got.append(snapshot.text)
    assert got == ["Sh"] and len(handle.sent) == 1  # resending would repeat text the caller already has
