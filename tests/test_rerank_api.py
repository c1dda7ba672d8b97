"""The rerank routes over HTTP: Cohere's own client (v2 and v1), vLLM's /score shape, the model list, and bad input
answered 4xx with an OpenAI-style body while the other requests go on."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

from orthrus_rag import Engine
from orthrus_rag.models.cross_encoder import BertCrossEncoder
from orthrus_rag.params import MAX_RERANK_DOCUMENTS, RerankParams
from tests.test_rerank import DOCS, QUERY, tiny_cross_encoder


@pytest.fixture(scope="module")
def server(smol_engine, tmp_path_factory):
    from transformers import AutoTokenizer

    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread

    folder = tmp_path_factory.mktemp("cross")
    tiny_cross_encoder(folder)
    src = smol_engine
    config = replace(src.config, model=replace(src.config.model, rerankers=["backbone", str(folder)]))
    cross = {str(folder): (BertCrossEncoder.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder)))}
    engine = Engine(config, src.runner.model, src.tokenizer, cross_encoders=cross)
    want = {name: engine.score(QUERY, DOCS, RerankParams(reranker=name)) for name in engine.rerankers}
    thread = ServerThread(AsyncEngine(engine, max_in_flight=16), default_max_tokens=8)
    yield thread, want, str(folder)
    thread.stop()
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def base(url: str) -> str:
    return url.removesuffix("/v1")


def test_cohere_v2_client_reranks(server):
    import cohere

    thread, want, _ = server
    client = cohere.ClientV2(api_key="unused", base_url=base(thread.url))
    out = client.rerank(model="backbone", query=QUERY, documents=DOCS, top_n=2)
    best = sorted(range(len(DOCS)), key=lambda i: -want["backbone"][i])[:2]
    assert [r.index for r in out.results] == best
    assert [r.relevance_score for r in out.results] == pytest.approx([want["backbone"][i] for i in best], abs=1e-5)


def test_cohere_v1_client_returns_documents(server):
    import cohere

    thread, want, cross = server
    client = cohere.Client(api_key="unused", base_url=base(thread.url))
    out = client.rerank(model=cross, query=QUERY, documents=DOCS, return_documents=True)
    assert len(out.results) == len(DOCS)
    for r in out.results:
        assert r.document.text == DOCS[r.index]
        assert r.relevance_score == pytest.approx(want[cross][r.index], abs=1e-5)
    scores = [r.relevance_score for r in out.results]
    assert scores == sorted(scores, reverse=True)


def test_vllm_rerank_and_score_shapes(server):
    thread, want, _ = server
    root = base(thread.url)
    r = httpx.post(f"{root}/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS]}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "backbone" and body["usage"]["total_tokens"] > 0  # the first loaded is the default
    assert {x["index"] for x in body["results"]} == {0, 1, 2}
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in body["results"])
    r = httpx.post(f"{thread.url}/score", json={"model": "backbone", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and all(d["object"] == "score" for d in data)
    assert [d["score"] for d in data] == pytest.approx(want["backbone"], abs=1e-5)
    pairs = httpx.post(f"{root}/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}, timeout=60).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want["backbone"][:2], abs=1e-5)


def test_models_list_the_rerankers(server):
    thread, _, cross = server
    cards = {m["id"]: m for m in httpx.get(f"{thread.url}/models", timeout=10).json()["data"]}
    assert cards["backbone"]["kinds"] == ["score"] and cards[cross]["kinds"] == ["score"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "  ", "documents": DOCS}, 400, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["ok", ""]}, 400, "documents[1]"),
    ("/v1/rerank", {"query": QUERY, "documents": ["d"] * (MAX_RERANK_DOCUMENTS + 1)}, 400, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "nope"}, 404, "model"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, 400, None),
    ("/v1/score", {"text_1": [QUERY] * 2, "text_2": DOCS}, 400, "text_1"),
])
def test_bad_input_is_a_4xx_with_an_openai_body(server, path, body, status, param):
    thread, _, _ = server
    r = httpx.post(f"{base(thread.url)}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_a_bad_instruction_for_a_cross_encoder_fails_alone(server):
    """The engine refuses the pair (400); a good request right after is answered."""
    thread, want, cross = server
    root = base(thread.url)
    r = httpx.post(f"{root}/v1/rerank", json={"model": cross, "query": QUERY, "documents": DOCS,
                                               "instruction": "judge"}, timeout=60)
    assert r.status_code == 400 and "takes no instruction" in r.json()["error"]["message"]
    ok = httpx.post(f"{root}/v1/rerank", json={"model": cross, "query": QUERY, "documents": DOCS}, timeout=60)
    assert ok.status_code == 200


def test_langchain_reranker_over_http(server):
    from langchain_core.documents import Document

    from orthrus_rag.integrations.langchain import OrthrusReranker

    thread, want, _ = server
    docs = [Document(page_content=d, metadata={"n": i}) for i, d in enumerate(DOCS)]
    reranker = OrthrusReranker(base_url=thread.url, model="backbone", top_n=2)
    best = sorted(range(len(DOCS)), key=lambda i: -want["backbone"][i])[:2]
    for out in (reranker.compress_documents(docs, QUERY), asyncio.run(reranker.acompress_documents(docs, QUERY))):
        assert [d.metadata["n"] for d in out] == best
        assert [d.metadata["relevance_score"] for d in out] == pytest.approx([want["backbone"][i] for i in best],
                                                                             abs=1e-5)
    assert reranker.compress_documents([], QUERY) == []


def test_remote_client_scores_through_the_server(server):
    from orthrus_rag.engine.clients import RemoteClient

    thread, want, cross = server
    client = RemoteClient(thread.url)
    assert client.reranker_names == ["backbone", cross]

    async def main():
        try:
            return [await client.score(QUERY, DOCS, RerankParams(reranker=name)) for name in ("backbone", cross)]
        finally:
            await client.aclose()

    got = asyncio.run(main())
    assert got[0] == pytest.approx(want["backbone"], abs=1e-5)  # in the documents' order, not best first
    assert got[1] == pytest.approx(want[cross], abs=1e-5)
    with pytest.raises(ValueError, match="truncate=False"):
        asyncio.run(client.score(QUERY, DOCS, RerankParams(truncate=False)))


def test_langchain_reranker_in_process(smol_engine):
    from langchain_core.documents import Document

    from orthrus_rag.integrations.langchain import LocalOrthrus, OrthrusReranker

    src = smol_engine
    config = replace(src.config, model=replace(src.config.model, rerankers=["backbone"]))
    engine = Engine(config, src.runner.model, src.tokenizer)
    want = engine.score(QUERY, DOCS)
    docs = [Document(page_content=d) for d in DOCS]
    try:
        out = OrthrusReranker(engine=engine, top_n=None).compress_documents(docs, QUERY)
        assert sorted(d.page_content for d in out) == sorted(DOCS)  # all of them, reordered
        scores = [d.metadata["relevance_score"] for d in out]
        assert scores == sorted(scores, reverse=True)
        assert scores == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    finally:
        LocalOrthrus.of(engine).close()
