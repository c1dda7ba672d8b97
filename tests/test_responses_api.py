"""`POST /v1/responses` with the `file_search` tool and the vector-store surface, driven by the official `openai`
client on a real server (SmolLM2 + MiniLM): the search runs in the server over documents added with
/v1/documents or files in a vector store; streaming sends the Responses API's events; bad input is a 4xx naming
it; a failed search is a failed tool call, not a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_documents_api import DOCS

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

NOTES = ("Velmora is a harbour town on the Isle of Quen. Its lighthouse, the Grey Finger, was built in 1821 by "
         "the engineer Tamsin Oake.\n\nThe town's market sells salted fish and amber every Thursday.")


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    """A server with an index (DOCS added over /v1/documents), on a second engine over the served engine's weights."""
    from types import SimpleNamespace

    from orthrus_rag import Engine
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread
    from orthrus_rag.retrievers import EngineEmbedder, LiveIndex

    src = served.engine
    engine = Engine(src.config, src.runner.model, src.tokenizer, encoder=src.runner.encoder,
                    encoder_tokenizer=src.inputs.encoder_tokenizer, encoder_pooling=src.encoder_pooling)
    aengine = AsyncEngine(engine)
    folder = tmp_path_factory.mktemp("responses") / "index"
    index = LiveIndex.create(folder, EngineEmbedder(aengine))
    thread = ServerThread(aengine, index=index, default_max_tokens=8)
    r = httpx.post(f"{thread.url}/documents", json={"documents": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=thread.url, api_key="none", max_retries=0)
    yield SimpleNamespace(client=client, url=thread.url, thread=thread, folder=folder, model=served.model)
    client.close()
    thread.stop()


def test_file_search_lists_the_documents_added_over_v1_documents(server) -> None:
    resp = server.client.responses.create(
        model=server.model, input="Which planet is red and dusty?", max_output_tokens=8,
        tools=[{"type": "file_search", "vector_store_ids": ["vs_index"], "max_num_results": 2}],
        include=["file_search_call.results"])
    call, message = resp.output
    assert call.type == "file_search_call" and call.status == "completed"
    assert call.queries == ["Which planet is red and dusty?"]
    assert [r.file_id for r in call.results][0] == "mars" and len(call.results) == 2
    assert call.results[0].filename == "Mars" and "fourth planet" in call.results[0].text
    assert message.type == "message" and message.role == "assistant"
    text = message.content[0]
    assert text.type == "output_text" and resp.output_text == text.text
    assert {a.file_id for a in text.annotations} == {r.file_id for r in call.results}
    assert all(a.type == "file_citation" and a.index == len(text.text) for a in text.annotations)
    assert resp.usage.output_tokens == 8 and resp.usage.input_tokens > 0 and resp.status == "incomplete"
    # without include, the call names its query but not its results (OpenAI's default)
    plain = server.client.responses.create(model=server.model, input="Who composed the Brandenburg Concertos?",
                                           tools=[{"type": "file_search", "vector_store_ids": []}],
                                           max_output_tokens=4)
    assert plain.output[0].results is None and plain.output[1].content[0].annotations[0].file_id == "bach"


def test_the_stream_sends_the_search_then_the_text(server) -> None:
    stream = server.client.responses.create(
        model=server.model, input="Where does the Nile flow?", max_output_tokens=6, stream=True,
        instructions="Answer briefly.", tools=[{"type": "file_search", "vector_store_ids": ["vs_index"],
                                                "max_num_results": 1}], include=["file_search_call.results"])
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    order = ["response.file_search_call.in_progress", "response.file_search_call.searching",
             "response.file_search_call.completed", "response.output_text.delta", "response.output_text.done"]
    assert [k for k in kinds if k in order] == [k for k in order for _ in range(kinds.count(k))]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas and final.output[0].results[0].file_id == "nile"


def test_files_in_a_vector_store_are_searched_apart_from_the_rest(server) -> None:
    c = server.client
    uploaded = c.files.create(file=("velmora.txt", NOTES.encode(), "text/plain"), purpose="assistants")
    assert uploaded.filename == "velmora.txt" and uploaded.bytes == len(NOTES.encode())
    store = c.vector_stores.create(name="notes", file_ids=[uploaded.id])
    assert store.file_counts.completed == 1 and store.status == "completed"
    assert [s.id for s in c.vector_stores.list().data][:1] == ["vs_index"] and store.id in \
        [s.id for s in c.vector_stores.list().data]
    assert c.vector_stores.files.retrieve(uploaded.id, vector_store_id=store.id).status == "completed"
    page = c.vector_stores.search(store.id, query="Who built the lighthouse?", max_num_results=5)
    assert page.data and {d.file_id for d in page.data} == {uploaded.id}  # never DOCS' documents
    assert "Tamsin Oake" in " ".join(part.text for d in page.data for part in d.content)
    resp = c.responses.create(model=server.model, input="Who built the lighthouse of Velmora?", max_output_tokens=4,
                              tools=[{"type": "file_search", "vector_store_ids": [store.id]}],
                              include=["file_search_call.results"])
    assert {r.file_id for r in resp.output[0].results} == {uploaded.id}
    # the registry is on disk beside the index
    assert (server.folder / "vector_stores.json").exists()


@pytest.mark.parametrize("body, status, words", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tool type 'web_search' is not supported"),
    ({"input": "  "}, 400, "input holds no user text"),
    ({"input": "hi", "tools": [{"type": "file_search", "max_num_results": 0}]}, 400, "max_num_results"),
    ({"input": "hi", "tools": [{"type": "file_search", "max_num_results": 51}]}, 400, "from 1 to 50"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_nope"]}]}, 404,
     "no vector store with id 'vs_nope'"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input_image"),
    ({"input": "hi", "model": "nope"}, 404, "nope"),
])
def test_bad_responses_requests_are_named(server, body: dict, status: int, words: str) -> None:
    r = httpx.post(f"{server.url}/responses", json=body, timeout=60)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_bad_vector_store_requests_are_named(server) -> None:
    r = httpx.post(f"{server.url}/vector_stores", json={"name": "x", "file_ids": ["file-nope"]}, timeout=60)
    assert r.status_code == 404 and "file-nope" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/files", files={"file": ("bin.txt", b"\xff\xfe\x00", "text/plain")},
                   data={"purpose": "assistants"}, timeout=60)
    assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/vector_stores/vs_index/files", json={"file_id": "x"}, timeout=60)
    assert r.status_code == 400 and "/v1/documents" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/vector_stores/vs_index/search", json={"query": ""}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty_query"


def test_a_failed_search_is_a_failed_tool_call_and_the_model_still_answers(server) -> None:
    stores = server.thread.app.state.vector_stores

    async def broken(*args, **kwargs):
        raise RuntimeError("the index is unreachable")

    stores.search, original = broken, stores.search
    try:
        resp = server.client.responses.create(model=server.model, input="Which planet is red?", max_output_tokens=3,
                                              tools=[{"type": "file_search", "vector_store_ids": ["vs_index"]}])
    finally:
        stores.search = original
    assert resp.output[0].status == "failed" and resp.output[1].content[0].text
    assert resp.output[1].content[0].annotations == []
