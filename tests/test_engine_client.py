"""The one client seam: `EngineClient`, implemented by the in-process `AsyncEngine`, the deployments'
`DeploymentClient` and the HTTP `RemoteClient`; pipelines and the `EngineEmbedder` run through any of them."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch
from orthrus_rag.data.types import Passage, QAExample

from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.engine.clients import DeploymentClient, EngineClient, RemoteClient
from orthrus_rag.engine.clients.protocol import BulkQuota
from orthrus_rag.params import EmbeddingSpace, PoolingParams, SamplingParams
from tests.conftest import SERVED_REFERENCE_TEXTS
from tests.fake_engine import FakeEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _members(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls)} | set(getattr(cls, "__annotations__", {}))


@pytest.mark.parametrize("make", [
    lambda: AsyncEngine(FakeEngine()),
    lambda: DeploymentClient(_Idle(), embedding_space=EmbeddingSpace("m")),
    lambda: RemoteClient("http://127.0.0.1:9/v1"),  # NOTE: nothing connects until a request
], ids=["in-process", "deployment", "remote"])
def test_every_front_end_has_the_whole_protocol(make):
    client = make()
    wanted = {n for n in _members(EngineClient) if not n.startswith("_")} - _members(object)
    have = _members(type(client)) | set(vars(client))
    assert wanted <= have, sorted(wanted - have)
    for name in ("generate", "embed", "embed_many", "abort", "aclose"):
        assert inspect.iscoroutinefunction(getattr(type(client), name)), name
    if isinstance(client, DeploymentClient):
        client.shutdown()


@pytest.mark.parametrize("make,keeps_one", [
    (lambda: AsyncEngine(FakeEngine(), max_in_flight=4, max_bulk_in_flight=8), True),
    (lambda: DeploymentClient(_Idle(), embedding_space=EmbeddingSpace("m")), False),
    (lambda: RemoteClient("http://127.0.0.1:9/v1"), False),
], ids=["in-process", "deployment", "remote"])
def test_only_the_in_process_engine_keeps_a_bulk_quota_apart(make, keeps_one):
    """The server holds bulk requests to `BulkQuota`'s limit where the client has one, else to `max_in_flight`."""
    client = make()
    assert isinstance(client, BulkQuota) is keeps_one
    if keeps_one:
        assert (client.max_bulk_in_flight, client.num_bulk_in_flight) == (8, 0)
    if isinstance(client, DeploymentClient):
        client.shutdown()


class _Idle:
    def submit(self, *args):  # pragma: no cover (never called)
        raise AssertionError

    def poll(self, timeout_s):
        return []

    def shutdown(self):
        pass


def test_an_embedding_space_routes_as_the_engine_does():
    space = EmbeddingSpace("smol", "minilm", ("adapters/a",), {"a": 1}, {"pooling": "cls", "normalize": False})
    assert space.route(None).on_encoder and space.default_pooling().pooling == "cls"
    assert space.route(PoolingParams(adapter="a")).slot == 1
    with pytest.raises(ValueError, match="unknown adapter 'b'"):
        space.route(PoolingParams(adapter="b"))
    assert EmbeddingSpace("smol").default_pooling() == PoolingParams()


# ---- over HTTP: the shared test server ------------------------------------------------------------------------------
@pytest.fixture
def remote(served):
    client = RemoteClient(served.url, max_in_flight=4)
    yield client
    asyncio.run(client.aclose())


def test_the_remote_client_names_what_the_server_serves(remote, served):
    space = remote.embedding_space
    assert (space.model, space.embedding_model, space.kind) == (served.model, served.embedding_model, "engine")


def test_remote_embeddings_equal_the_engines_own(remote, served):
    outs = remote.embed_sync(SERVED_REFERENCE_TEXTS)
    for got, want in zip(outs, served.reference):
        torch.testing.assert_close(got.embedding, want.float(), atol=1e-5, rtol=0)
    again = asyncio.run(remote.embed_many(SERVED_REFERENCE_TEXTS))
    torch.testing.assert_close(again[1].embedding, outs[1].embedding, atol=1e-6, rtol=0)


def test_remote_pooling_it_cannot_send_is_refused_by_name(remote):
    with pytest.raises(ValueError, match="pooling cannot be set over the OpenAI API"):
        remote.embed_sync(["x"], PoolingParams(pooling="cls"))


def test_remote_generation_and_its_stream_agree(remote):
    async def main():
        whole = await remote.generate("The capital of France is", GREEDY)
        snaps = [s async for s in remote.generate_stream("The capital of France is", GREEDY)]
        return whole, snaps

    whole, snaps = asyncio.run(main())
    assert whole.text and whole.finish_reason in ("length", "stop")
    assert snaps[-1].finished and snaps[-1].text == whole.text
    assert all(not s.finished for s in snaps[:-1]) and remote.num_in_flight == 0


def test_an_iter_retgen_question_runs_through_the_remote_client(remote, served):
    from orthrus_rag.pipelines import IterRetGen
    from orthrus_rag.retrievers import DenseRetriever, EngineEmbedder

    passages = [Passage("0", "Nile", "The Nile flows north into the Mediterranean Sea."),
                Passage("1", "Austen", "Jane Austen wrote Pride and Prejudice in 1813."),
                Passage("2", "Everest", "Mount Everest is the highest mountain above sea level.")]
    embedder = EngineEmbedder(remote)
    assert embedder.identity["embedding_model"] == served.embedding_model and embedder.identity["dimension"] == 384
    retriever = DenseRetriever(embedder)
    retriever.build(passages)
    ex = QAExample("q", "Who wrote Pride and Prejudice?", ["Jane Austen"])
    rec = asyncio.run(IterRetGen(remote, retriever, iterations=2, k=1,
                                 sampling_params=SamplingParams(max_tokens=8, temperature=0.0)).answer(ex))
    assert len(rec.iterations) == 2
    assert rec.iterations[0].retrieved[0]["title"] == "Austen"
    assert all(it.generation for it in rec.iterations)


# ---- the benchmarks over a running server --------------------------------------------------------------------------
def test_a_running_server_is_a_benchmark_system(served):
    from omegaconf import OmegaConf

    from scripts.bench.harness import system_factory

    cfg = OmegaConf.create({"experiment": {"clients": 4}})
    client = system_factory(f"remote:{served.url}", cfg)()

    async def main():
        try:
            return await asyncio.gather(client.embed(SERVED_REFERENCE_TEXTS[0], None, "e"),
                                        client.generate("The capital of France is", GREEDY, "g"))
        finally:
            await client.aclose()

    emb, gen = asyncio.run(main())
    torch.testing.assert_close(emb.embedding, served.reference[0].float(), atol=1e-5, rtol=0)
    assert gen.text and gen.finish_reason in ("length", "stop")


def test_remote_generation_sends_vllms_extra_sampling_fields(remote):
    """`ignore_eos`, `min_tokens`, `top_k` and the rest reach the server's engine: a reply that ends at EOS runs to
    max_tokens when the params ignore it, over HTTP as in process."""
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"

    async def main():
        free = await remote.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0))
        held = await remote.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, top_k=5))
        return free, held

    free, held = asyncio.run(main())
    assert free.finish_reason == "stop" and held.finish_reason == "length"
    assert held.text.startswith(free.text) and len(held.text) > len(free.text)
