"""DeploymentClient (an EngineClient over a submit/poll system) and the Embedder over it: errors kept per request."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from orthrus_rag.data.types import QAExample
from orthrus_rag.pipelines import IterRetGen
from orthrus_rag.retrievers import EngineEmbedder

from orthrus_rag import PoolingParams, SamplingParams
from orthrus_rag.engine.clients import ClientFailed, DeploymentClient, RequestFailed
from orthrus_rag.engine.core.request import RequestKind
from orthrus_rag.engine.deploy import WorkerError
from orthrus_rag.engine.loop import EngineLoop, StepFailed
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput, error_output

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class FakeClient:
    """A submit/poll system that finishes each request `delay` polls after its submit; inputs steer failures:
    "bad" is refused at submit, "reject" is rejected by poll (WorkerError naming it), "error" finishes with an
    error, "crash" makes the next poll fail as a whole, "never" never finishes."""

    def __init__(self, delay: int = 2) -> None:
        self.delay = delay
        self.pending: list[list] = []  # [polls left, kind, request id, input]
        self.rejects: list[str] = []
        self.crash = False
        self.threads: set[str] = set()
        self.shut = 0

    def submit(self, kind, request_id, input, params):  # noqa: ANN001
        self.threads.add(threading.current_thread().name)
        if input == "bad":
            raise ValueError("input is bad")
        if input == "dead":  # what a peer does once one of its engines has died
            raise RuntimeError("generate: engine died")
        if input == "reject":
            self.rejects.append(request_id)
            return
        self.crash |= input == "crash"
        self.pending.append([self.delay, kind, request_id, input])

    def poll(self, timeout_s):  # noqa: ANN001
        self.threads.add(threading.current_thread().name)
        if self.crash:
            raise WorkerError("the embed worker exited unexpectedly")
        if self.rejects:
            raise WorkerError("rejected", request_ids=(self.rejects.pop(),))
        time.sleep(min(timeout_s, 0.005))
        done = []
        for item in self.pending:
            item[0] -= 1
            if item[0] <= 0 and item[3] != "never":
                done.append(item)
        self.pending = [p for p in self.pending if p not in done]
        outs = []
        for _, kind, rid, text in done:
            if kind == "generate":
                outs.append(GenerationOutput(rid, [], [1], text.upper(), "error" if text == "error" else "length"))
            else:
                outs.append(EmbeddingOutput(rid, [], torch.tensor([float(len(text)), 1.0]),
                                            error="pooling failed" if text == "error" else None))
        return outs

    def shutdown(self):
        self.shut += 1


def test_results_reach_their_callers_and_the_client_stays_on_one_thread() -> None:
    client = FakeClient()
    with DeploymentClient(client, poll_s=0.01) as bridge:
        async def main():
            return await asyncio.gather(bridge.generate("abc"), bridge.embed_many(["x", "yyy"]),
                                        bridge.generate("d"))
        gen, embs, gen2 = asyncio.run(main())
        assert (gen.text, gen2.text) == ("ABC", "D")
        assert [e.embedding[0].item() for e in embs] == [1.0, 3.0]
        assert bridge.generate_sync("sync").text == "SYNC"  # blocking use from a plain thread
    assert client.threads == {"deployment-pump"} and client.shut == 1


def test_failures_stay_with_their_request() -> None:
    client = FakeClient()
    with DeploymentClient(client, poll_s=0.01) as bridge:
        futures = {t: bridge.submit("generate", t) for t in ("ok", "bad", "reject", "error", "ok2")}
        assert futures["ok"].result(5).text == "OK" and futures["ok2"].result(5).text == "OK2"
        with pytest.raises(RequestFailed, match="input is bad"):
            futures["bad"].result(5)
        with pytest.raises(RequestFailed, match="rejected"):
            futures["reject"].result(5)
        with pytest.raises(RequestFailed, match="failed: ERROR"):
            futures["error"].result(5)
        with pytest.raises(RequestFailed, match="pooling failed"):
            bridge.embed_sync(["fine", "error"], timeout_s=5)
        assert bridge.embed_sync(["still serving"], timeout_s=5)[0].embedding[0].item() == 13.0
    with DeploymentClient(FakeClient()) as bridge, pytest.raises(ValueError, match="unknown request kind"):
        bridge.submit("classify", "x")


def test_a_failed_client_fails_every_waiting_request_and_refuses_new_ones() -> None:
    client = FakeClient(delay=1000)
    bridge = DeploymentClient(client, poll_s=0.01)
    waiting = [bridge.submit("generate", "slow") for _ in range(3)]
    crash = bridge.submit("embed", "crash")
    for f in [*waiting, crash]:
        with pytest.raises(ClientFailed, match="WorkerError: the embed worker exited unexpectedly") as info:
            f.result(5)
        assert isinstance(info.value.__cause__, WorkerError)
    with pytest.raises(ClientFailed, match="serving client failed"):
        bridge.submit("generate", "late")
    bridge.shutdown()
    assert client.shut == 1


def test_a_client_that_fails_at_submit_fails_that_request_too() -> None:
    bridge = DeploymentClient(FakeClient(delay=1000), poll_s=0.01)
    slow = bridge.submit("generate", "slow")
    dead = bridge.submit("generate", "dead")
    for f in (slow, dead):  # none is left waiting forever
        with pytest.raises(ClientFailed, match="engine died"):
            f.result(5)
    bridge.shutdown()


def test_a_failed_client_stops_the_pipeline_run_instead_of_failing_every_question() -> None:
    """A client failed as a whole fails every later request too; the run stops (app.run keeps what it recorded
    and resume= continues it) rather than recording every remaining question as failed."""
    client = FakeClient(delay=1000)
    examples = [QAExample(f"q{i}", f"question {i}?", ["x"]) for i in range(3)]
    with DeploymentClient(client, poll_s=0.01, stall_timeout_s=0.5) as bridge:
        with pytest.raises(ClientFailed, match="no output for 0.5 s"):
            asyncio.run(IterRetGen(bridge, None).run(examples))


def test_stall_and_shutdown_are_bounded() -> None:
    bridge = DeploymentClient(FakeClient(), poll_s=0.01, stall_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ClientFailed, match="TimeoutError: no output for") as info:
        bridge.submit("generate", "never").result(5)
    assert isinstance(info.value.__cause__, TimeoutError)
    assert time.monotonic() - t0 < 3
    bridge.shutdown()

    bridge = DeploymentClient(FakeClient(delay=10**6), poll_s=0.01)
    pending: Future = bridge.submit("generate", "slow")
    bridge.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pending.result(5)
    with pytest.raises(RuntimeError, match="shut down"):
        bridge.submit("generate", "after")
    bridge.shutdown()  # idempotent


def test_max_in_flight_holds_the_rest_in_the_bridge() -> None:
    client = FakeClient(delay=3)
    seen: list[int] = []
    poll = client.poll
    client.poll = lambda t: (seen.append(len(client.pending)), poll(t))[1]  # type: ignore[method-assign]
    with DeploymentClient(client, poll_s=0.01, max_in_flight=4) as bridge:
        outs = bridge.embed_sync([f"t{i}" for i in range(20)], timeout_s=10)
    assert len(outs) == 20 and max(seen) <= 4


# ---- over the real engine ----------------------------------------------------------------------------------------
class SteppedEngine:
    """A submit/poll system over one engine, stepped in the polling thread (a deployment's worker, in process)."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.loop, self.done = EngineLoop(engine), []

    def submit(self, kind, request_id, input, params):  # noqa: ANN001
        self.loop.add(RequestKind(kind), request_id, input, params, _Finished(self.done, kind, request_id))

    def poll(self, timeout_s):  # noqa: ANN001
        if self.loop.has_work:
            with contextlib.suppress(StepFailed):  # its requests come back as error outputs
                self.loop.run_step()
        else:
            time.sleep(timeout_s)
        done, self.done[:] = list(self.done), []
        return done

    def shutdown(self) -> None:
        self.loop.fail_all(RuntimeError("shut down"))


class _Finished:
    def __init__(self, done: list, kind: str, request_id: str) -> None:
        self.done, self.kind, self.request_id = done, kind, request_id

    def put(self, output) -> None:  # noqa: ANN001
        if output.finished:
            self.done.append(output)

    def fail(self, exc: BaseException) -> None:
        self.done.append(error_output(self.kind, self.request_id, f"{type(exc).__name__}: {exc}"))


def test_bridge_over_the_engine_matches_engine_run(engine) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    texts = ["rivers and mountains", "a short note"]
    want_gen, want_emb = engine.run(prompts, GREEDY, texts, PoolingParams())
    bridge = DeploymentClient(SteppedEngine(engine))
    try:
        async def main():
            return await asyncio.gather(*(bridge.generate(p, GREEDY) for p in prompts), bridge.embed_many(texts))
        *gens, embs = asyncio.run(main())
        assert [g.token_ids for g in gens] == [g.token_ids for g in want_gen]
        for got, ref in zip(embs, want_emb):
            torch.testing.assert_close(got.embedding, ref.embedding, atol=1e-5, rtol=0)
        with pytest.raises(RequestFailed, match="prompt is empty"):
            bridge.generate_sync("", GREEDY, timeout_s=30)
    finally:
        bridge.shutdown(close_client=False)  # the shared engine stays up for other tests


def test_the_embedder_over_a_deployment_matches_it_in_process(engine) -> None:
    docs = ["Paris is the capital of France.", "The Nile flows north."]
    doc, query = PoolingParams(), PoolingParams(instruction="query: ")
    reference = EngineEmbedder(engine, document_params=doc, query_params=query)
    bridge = DeploymentClient(SteppedEngine(engine), embedding_space=engine.embedding_space)
    try:
        embedder = EngineEmbedder(bridge, document_params=doc, query_params=query)
        # NOTE: the same identity, so an index built in-process serves a deployment of the same engine
        assert embedder.identity == reference.identity
        np.testing.assert_allclose(embedder.embed_documents(docs), reference.embed_documents(docs), atol=1e-5)
        got = asyncio.run(embedder.aembed_query("capital of France"))
        np.testing.assert_allclose(got, reference.embed_query("capital of France"), atol=1e-5)
    finally:
        bridge.shutdown(close_client=False)


def test_a_deployment_client_embeds_like_the_engine_on_a_separate_encoder() -> None:
    from orthrus_rag import Engine
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.clients.deployment_client import encoder_pooling_of
    from orthrus_rag.params import EmbeddingSpace
    from tests.conftest import MINILM, SMOL, engine_overrides

    engine = Engine.from_pretrained(SMOL, embedding_model=MINILM, **engine_overrides())
    local = AsyncEngine(engine)
    pooling = local.embedding_space.encoder_pooling
    assert dict(pooling) == encoder_pooling_of(MINILM)  # what a deployment reads from the model's folder
    doc = PoolingParams(**pooling, truncate=True)
    query = PoolingParams(**pooling, instruction="query: ", truncate=True)
    # NOTE: what `start_deployment` knows of its workers: the config's names, not the loaded engine
    bridge = DeploymentClient(SteppedEngine(engine), tokenizer=engine.tokenizer,
                              embedding_space=EmbeddingSpace(SMOL, MINILM, encoder_pooling=encoder_pooling_of(MINILM)))
    try:
        a, b = EngineEmbedder(local, doc, query), EngineEmbedder(bridge, doc, query)
        assert a.identity == b.identity and a.identity["embedding_model"] == MINILM
        assert a.identity["dimension"] == 384
        np.testing.assert_allclose(b.embed_documents(["the Nile flows north"]),
                                   a.embed_documents(["the Nile flows north"]), atol=1e-5)
    finally:
        bridge.shutdown(close_client=False)
