"""`POST /retrieve` in Search-R1's retrieval-server shape on a real server (SmolLM2 + MiniLM): many rollouts at once
are answered, their queries batched into shared engine steps; bad input gets a 4xx naming it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.test_documents_api import DOCS

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)


@pytest.fixture(scope="module")
def retrieval(served, tmp_path_factory):
    """A server with an index holding DOCS, on a second engine over the served engine's weights, at the default
    admission limit (a rollout framework sends many queries at once)."""
    from types import SimpleNamespace

    from orthrus_rag import Engine
    from orthrus_rag.data.types import Passage
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread
    from orthrus_rag.retrievers import EngineEmbedder, LiveIndex

    src = served.engine
    engine = Engine(src.config, src.runner.model, src.tokenizer, encoder=src.runner.encoder,
                    encoder_tokenizer=src.inputs.encoder_tokenizer, encoder_pooling=src.encoder_pooling)
    index = LiveIndex.create(tmp_path_factory.mktemp("retrieve") / "index", EngineEmbedder(engine))
    index.add([Passage(d["id"], d["title"], d["text"]) for d in DOCS])
    aengine = AsyncEngine(engine)
    index.embedder = EngineEmbedder(aengine)
    server = ServerThread(aengine, index=index, default_max_tokens=8)
    yield SimpleNamespace(url=server.url.removesuffix("/v1"), engine=engine)
    server.stop()


QUERIES = {"Which planet is red?": "mars", "Who composed the Brandenburg Concertos?": "bach",
           "Which river flows north through Africa?": "nile"}


def test_the_search_r1_shape_with_and_without_scores(retrieval) -> None:
    with httpx.Client(base_url=retrieval.url, timeout=120) as http:
        r = http.post("/retrieve", json={"queries": list(QUERIES), "topk": 2, "return_scores": True})
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        assert len(result) == 3 and all(len(hits) == 2 for hits in result)
        for hits, want in zip(result, QUERIES.values()):
            top = hits[0]
            assert top["document"]["id"] == want and 0 < top["score"] <= 1.0 and top["score"] >= hits[1]["score"]
            doc = next(d for d in DOCS if d["id"] == want)
            assert top["document"]["contents"] == f'"{doc["title"]}"\n{doc["text"]}'  # what its clients split
        plain = http.post("/retrieve", json={"queries": ["Which planet is red?"]}).json()["result"]
        assert len(plain[0]) == 3 and plain[0][0]["id"] == "mars" and "score" not in plain[0][0]  # topk: 3


def test_64_concurrent_rollouts_are_all_answered_in_shared_steps(retrieval) -> None:
    first = retrieval.engine.num_steps

    async def rollout(http: httpx.AsyncClient, i: int) -> list[str]:
        queries = [list(QUERIES)[i % 3], list(QUERIES)[(i + 1) % 3]]
        r = await http.post("/retrieve", json={"queries": queries, "topk": 1, "return_scores": True})
        assert r.status_code == 200, r.text
        return [hits[0]["document"]["id"] for hits in r.json()["result"]]

    async def main() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=retrieval.url, timeout=300) as http:
            return await asyncio.gather(*(rollout(http, i) for i in range(64)))

    answers = asyncio.run(main())
    want = list(QUERIES.values())
    assert answers == [[want[i % 3], want[(i + 1) % 3]] for i in range(64)]
    steps = [s for s in retrieval.engine.step_stats if s.step >= first]
    # 128 queries from 64 clients: the encoder ran many of them per step, not one step each
    assert sum(s.num_encoder_tokens > 0 for s in steps) < 64


@pytest.mark.parametrize("body, status, words", [
    ({"queries": []}, 400, "queries"),
    ({"queries": ["fine", "  "]}, 400, "queries [1] are empty"),
    ({"queries": ["x"], "topk": 0}, 400, "topk"),
    ({"queries": ["x"], "topk": 5000}, 400, "topk"),
    ({"queries": ["x"], "top_k": 2}, 400, "top_k"),
    ({"query": "x"}, 400, "queries"),
])
def test_bad_retrieve_requests_are_named(retrieval, body: dict, status: int, words: str) -> None:
    with httpx.Client(base_url=retrieval.url, timeout=60) as http:
        r = http.post("/retrieve", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_a_server_without_an_index_answers_404_at_retrieve(served) -> None:
    with httpx.Client(base_url=served.url.removesuffix("/v1"), timeout=60) as http:
        r = http.post("/retrieve", json={"queries": ["x"]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_index"
