"""Live ingestion over HTTP (`/v1/documents`, `/v1/search`) on a real server (SmolLM2 + MiniLM): documents added
are found by the next query, deletions by the next one too, bad documents get a 4xx naming them and change
nothing, and a server killed with SIGKILL restarts with what it had taken."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MINILM, SMOL, embed_priorities, engine_overrides

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [{"id": "mars", "title": "Mars", "text": "Mars is the fourth planet from the Sun, a red and dusty world."},
        {"id": "bach", "title": "Johann Sebastian Bach",
         "text": "Bach was a German composer of the Baroque period, known for the Brandenburg Concertos."},
        {"id": "nile", "title": "Nile", "text": "The Nile is a river in Africa that flows north into the Mediterranean."}]
LONG_TEXT = " ".join(f"word{i}" for i in range(600))  # past MiniLM's 256 tokens


@pytest.fixture(scope="module")
def indexed(served, tmp_path_factory):
    """A server with an index (made empty), on a second engine over the served engine's weights."""
    from types import SimpleNamespace

    from orthrus_rag import Engine
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread
    from orthrus_rag.retrievers import EngineEmbedder, LiveIndex

    src = served.engine
    engine = Engine(src.config, src.runner.model, src.tokenizer, encoder=src.runner.encoder,
                    encoder_tokenizer=src.inputs.encoder_tokenizer, encoder_pooling=src.encoder_pooling)
    aengine = AsyncEngine(engine, max_in_flight=4, max_bulk_in_flight=8)
    folder = tmp_path_factory.mktemp("live") / "index"
    index = LiveIndex.create(folder, EngineEmbedder(aengine))
    server = ServerThread(aengine, index=index, default_max_tokens=8)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield SimpleNamespace(http=http, index=index, folder=folder, engine=engine, aengine=aengine)
    server.stop()


def _search(http: httpx.Client, query: str, k: int = 3) -> list[str]:
    r = http.post("/search", json={"query": query, "k": k})
    assert r.status_code == 200, r.text
    return [hit["id"] for hit in r.json()["data"]]


def _snapshot(folder: Path) -> tuple:
    live = folder / "live"
    return tuple(sorted((p.name, p.read_bytes()) for p in live.iterdir())) if live.is_dir() else ()


def test_added_documents_are_retrieved_by_the_next_query_and_deleted_ones_are_not(indexed) -> None:
    r = indexed.http.post("/documents", json={"documents": DOCS})
    assert r.status_code == 200, r.text
    assert [d["id"] for d in r.json()["data"]] == ["mars", "bach", "nile"] and r.json()["num_documents"] == 3
    assert _search(indexed.http, "Which planet is red?", 1) == ["mars"]
    assert _search(indexed.http, "Who composed the Brandenburg Concertos?", 1) == ["bach"]
    hit = indexed.http.post("/search", json={"query": "a river in Africa", "k": 1}).json()["data"][0]
    assert hit["id"] == "nile" and hit["title"] == "Nile" and 0 < hit["score"] <= 1.0
    assert indexed.http.get("/documents/bach").json()["title"] == "Johann Sebastian Bach"

    assert indexed.http.delete("/documents/mars").status_code == 200
    assert "mars" not in _search(indexed.http, "Which planet is red?", 3)
    assert indexed.http.get("/documents/mars").status_code == 404
    r = indexed.http.request("DELETE", "/documents", json={"ids": ["bach", "nile"]})
    assert r.status_code == 200 and r.json()["num_documents"] == 0
    assert _search(indexed.http, "Who composed the Brandenburg Concertos?") == []


@pytest.mark.parametrize("documents, status, named", [
    ([DOCS[0], {"id": "e", "text": "   "}], 400, "documents[1] (id 'e'): the text is empty"),
    ([DOCS[0], {"id": "long", "text": LONG_TEXT}], 400, "documents[1] (id 'long'): embedding input has"),
    ([DOCS[0], DOCS[0]], 400, "the id 'mars' is repeated in this batch"),
    ([DOCS[0], {"id": "kept", "text": "a second copy"}], 409, "a document with id 'kept' is present already"),
    ([{"id": "", "text": "no id"}], 400, "documents.0.id"),
    ([{"id": "x", "text": "fine", "colour": "red"}], 400, "colour"),
])
def test_bad_documents_get_a_4xx_naming_them_and_change_nothing(indexed, documents: list, status: int,
                                                                named: str) -> None:
    existing = indexed.http.post("/documents", json={"documents": [{"id": "kept", "text": "already here"}]})
    assert existing.status_code in (200, 409)
    before, count = _snapshot(indexed.folder), len(indexed.index)
    r = indexed.http.post("/documents", json={"documents": documents})
    assert r.status_code == status, r.text
    assert named in r.json()["error"]["message"]
    assert _snapshot(indexed.folder) == before and len(indexed.index) == count
    assert indexed.http.get("/documents/mars").status_code == 404  # the good document of the batch is not kept


def test_a_long_document_is_cut_when_asked_and_an_unknown_delete_changes_nothing(indexed) -> None:
    r = indexed.http.post("/documents", json={"documents": [{"id": "cut", "text": LONG_TEXT}], "truncate": True})
    assert r.status_code == 200, r.text
    before, count = _snapshot(indexed.folder), len(indexed.index)
    r = indexed.http.request("DELETE", "/documents", json={"ids": ["cut", "never-added"]})
    assert r.status_code == 404 and "never-added" in r.json()["error"]["message"]
    assert _snapshot(indexed.folder) == before and len(indexed.index) == count
    assert indexed.http.get("/documents/cut").status_code == 200


def test_documents_embed_as_bulk_work_and_queries_do_not(indexed) -> None:
    docs = [{"id": f"bulk{i}", "text": f"Bulk document number {i} about rivers."} for i in range(2)]
    with embed_priorities(indexed.engine) as seen:
        assert indexed.http.post("/documents", json={"documents": docs}).status_code == 200
        added = list(seen)
        _search(indexed.http, "rivers")
    assert len(added) == 2 and all(priority > 0 for _, priority in added)
    assert len(seen) == 3 and seen[-1][1] <= 0  # the query: serving work
    assert indexed.http.request("DELETE", "/documents", json={"ids": ["bulk0", "bulk1"]}).status_code == 200


def test_embeddings_take_vllms_priority_field_against_the_bulk_limit(indexed) -> None:
    """`priority` > 0 is bulk work: it counts against the bulk in-flight limit (8 here), not the serving one (4)."""
    body = {"model": MINILM, "input": [f"text {i}" for i in range(6)]}
    with embed_priorities(indexed.engine) as seen:
        bulk = indexed.http.post("/embeddings", json={**body, "priority": 1})
    assert bulk.status_code == 200, bulk.text
    assert len(bulk.json()["data"]) == 6 and [p for _, p in seen] == [1] * 6
    serving = indexed.http.post("/embeddings", json=body)
    assert serving.status_code == 400 and "at most 4" in serving.json()["error"]["message"]
    too_many = indexed.http.post("/embeddings", json={**body, "input": body["input"] * 2, "priority": 1})
    assert too_many.status_code == 400 and "at most 8" in too_many.json()["error"]["message"]
    assert "bulk requests" in too_many.json()["error"]["message"]


def test_a_server_without_an_index_says_how_to_give_it_one(served) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as http:
        for r in (http.post("/search", json={"query": "x"}), http.post("/documents", json={"documents": DOCS})):
            assert r.status_code == 404 and r.json()["error"]["code"] == "no_index"
            assert "retriever.index_dir" in r.json()["error"]["message"]


def test_an_ingest_in_flight_takes_no_serving_slot(indexed) -> None:
    """Bulk embeddings count against their own quota: serving requests are admitted beside a full one."""
    import asyncio

    from orthrus_rag.engine.clients.protocol import EngineQueueFull
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.params import PoolingParams

    async def main() -> None:
        async with AsyncEngine(indexed.engine, max_in_flight=2, max_bulk_in_flight=3) as aengine:
            bulk = [asyncio.ensure_future(aengine.embed(f"document {i}", PoolingParams(priority=1)))
                    for i in range(3)]
            await asyncio.sleep(0)  # submitted: the bulk quota is full
            assert aengine.num_bulk_in_flight == 3 and aengine.num_in_flight == 0
            with pytest.raises(EngineQueueFull, match="bulk"):
                await aengine.embed("one too many", PoolingParams(priority=1))
            serving = await asyncio.gather(aengine.embed("a query"), aengine.embed("another query"))
            assert len(serving) == 2 and len(await asyncio.gather(*bulk)) == 3
            assert aengine.num_bulk_in_flight == 0 and aengine.num_in_flight == 0

    # NOTE: the indexed server's engine is idle between tests; this front end steps it meanwhile
    asyncio.run(main())


def _serve(folder: Path, port: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "orthrus_rag.entrypoints.cli", "serve", f"retriever.index_dir={folder}",
            "serve.create_index=true", f"serve.port={port}", "serve.log_level=warning",
            "+model.kernel_overrides.linears=dense",
            *(f"cache.num_blocks={engine_overrides()['num_blocks']}",)]
    return subprocess.Popen(args, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _wait_up(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the server did not come up:\n{log.read_text()[-3000:]}")


def test_a_killed_server_restarts_with_the_documents_it_took(tmp_path: Path) -> None:
    from orthrus_rag.entrypoints.openai.server import free_port

    folder, log = tmp_path / "index", tmp_path / "log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(folder, port, log)
    try:
        _wait_up(url, proc, log)
        with httpx.Client(base_url=f"{url}/v1", timeout=120) as http:
            assert http.post("/documents", json={"documents": DOCS}).status_code == 200
            assert http.delete("/documents/nile").status_code == 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert json.loads((folder / "live" / "live.json").read_text())["deleted"] == [2]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(folder, port, log)  # NOTE: create_index again: the folder holds one now, so it is opened
    try:
        _wait_up(url, proc, log)
        with httpx.Client(base_url=f"{url}/v1", timeout=120) as http:
            assert _search(http, "Which planet is red?", 1) == ["mars"]
            assert "nile" not in _search(http, "a river in Africa", 3)
            assert http.get("/documents/bach").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
