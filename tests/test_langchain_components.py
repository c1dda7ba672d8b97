"""The LangChain components on a shared in-process engine and against the server by base URL: an LCEL chain
(`retriever | prompt | chat`) whose retrieval and generation land in the same engine steps, streaming with usage,
Iter-RetGen as a Runnable (invoke, batch, per-iteration stream)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from orthrus_rag.integrations.langchain import (ChatOrthrus, IterRetGenRunnable, LocalOrthrus, OrthrusEmbeddings,
                                                OrthrusRetriever, RAGRunnable)
from tests.conftest import MINILM, SERVED_REFERENCE_TEXTS, embed_priorities

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

TITLES = ["Jane Austen", "Nile", "Mount Everest", "Marie Curie"]
TEXTS = ["Jane Austen wrote the novel Pride and Prejudice, published in 1813.",
         "The Nile is a river in Africa that flows north into the Mediterranean Sea.",
         "Mount Everest, on the border of Nepal and China, is the highest mountain on Earth.",
         "Marie Curie won Nobel Prizes in both physics and chemistry."]
QUESTIONS = ["Who wrote Pride and Prejudice?", "Which is the highest mountain?", "Where does the Nile flow?"]


def test_every_component_on_an_engine_shares_one_loop(local):
    assert LocalOrthrus.of(local.client.engine) is local


@pytest.fixture(scope="module")
def retriever(local):
    return OrthrusRetriever.from_texts(TEXTS, OrthrusEmbeddings(engine=local), titles=TITLES, k=1)


def test_in_process_embeddings_equal_the_engines(local, served):
    got = np.asarray(OrthrusEmbeddings(engine=local).embed_documents(SERVED_REFERENCE_TEXTS))
    np.testing.assert_allclose(got, np.stack([t.numpy() for t in served.reference]), atol=1e-6, rtol=0)


def test_retriever_finds_the_passage(retriever):
    docs = retriever.invoke("Who wrote Pride and Prejudice?")
    assert [d.metadata["title"] for d in docs] == ["Jane Austen"]
    assert docs[0].page_content == TEXTS[0] and docs[0].metadata["score"] > 0


def test_lcel_chain_puts_both_kinds_in_the_same_steps(local, retriever):
    engine = local.client.engine
    chat = ChatOrthrus(engine=local, max_tokens=6, temperature=0)
    prompt = ChatPromptTemplate.from_template("Context: {context}\nQuestion: {question}\nAnswer briefly.")
    chain = ({"context": retriever | (lambda docs: docs[0].page_content), "question": RunnablePassthrough()}
             | prompt | chat | StrOutputParser())
    first = engine.num_steps

    async def main() -> list[str]:
        # a generation already decoding while the chain's queries embed: the product's whole point
        long = asyncio.ensure_future(chat.ainvoke("Count from 1 to 50.", max_tokens=24))
        while not any(r.output_token_ids for r in list(engine.scheduler.requests.values())) and not long.done():
            await asyncio.sleep(0.01)
        answers = await chain.abatch(QUESTIONS)
        await long
        return answers

    answers = asyncio.run(main())
    assert len(answers) == 3 and all(isinstance(a, str) and a for a in answers)
    steps = [s for s in engine.step_stats if s.step >= first]
    assert any(s.is_mixed for s in steps), "no step carried embedding and generation tokens together"


def test_in_process_streaming_with_usage(local):
    chat = ChatOrthrus(engine=local, max_tokens=6, temperature=0)
    whole = chat.invoke("Name a colour.")
    chunks = list(chat.stream("Name a colour."))
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.content == whole.content and len(chunks) > 2
    assert total.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"] > 0
    assert whole.response_metadata["finish_reason"] in ("stop", "length")


def test_iter_retgen_runnable_in_process(local, retriever):
    chat = ChatOrthrus(engine=local)
    rag = IterRetGenRunnable(retriever, chat, iterations=2, k=2, max_tokens=8)
    one = rag.invoke({"question": QUESTIONS[0], "answers": ["Jane Austen"]})
    assert len(one["iterations"]) == 2 and one["error"] is None
    assert one["iterations"][0]["retrieved"][0]["title"] == "Jane Austen"
    assert one["iterations"][1]["query"].endswith(QUESTIONS[0])  # y_1 || q
    first = local.client.engine.num_steps
    many = rag.batch(QUESTIONS)  # nothing else in flight: the batch's own hops meet in the engine's steps
    assert [r["question"] for r in many] == QUESTIONS
    steps = [s for s in local.client.engine.step_stats if s.step >= first]
    assert any(s.is_mixed for s in steps), "no step of the batch carried a query embedding beside a generation"
    events = list(rag.stream(QUESTIONS[1]))
    assert [e["event"] for e in events] == ["iteration", "iteration", "final"]
    assert [e["iteration"] for e in events[:2]] == [1, 2]
    assert events[-1]["prediction"] == events[-1]["iterations"][-1]["answer"]


@pytest.mark.parametrize("method, options", [("ircot", {"max_steps": 2, "step_tokens": 8}),
                                             ("flare", {"max_steps": 2, "step_tokens": 8, "threshold": 0.99}),
                                             ("self_ask", {"max_follow_ups": 1, "step_tokens": 8})])
def test_every_method_is_a_runnable(local, retriever, method, options):
    chat = ChatOrthrus(engine=local)
    rag = RAGRunnable(retriever, chat, method=method, k=2, max_tokens=8, **options)
    rec = rag.invoke({"question": QUESTIONS[0], "answers": ["Jane Austen"]})
    assert rec["error"] is None and 1 <= len(rec["iterations"]) <= 2
    assert rec["prediction"] == rec["iterations"][-1]["answer"]
    if method == "flare":  # at 0.99 some token is unsure: the chat response's logprobs made it retrieve
        assert any(it["retrieved"] for it in rec["iterations"])
    events = list(rag.stream(QUESTIONS[1]))
    assert events[-1]["event"] == "final" and all(e["event"] == "iteration" for e in events[:-1])


def test_components_against_the_server(served):
    emb = OrthrusEmbeddings(base_url=served.url, model=MINILM)
    got = np.asarray(emb.embed_documents(SERVED_REFERENCE_TEXTS))
    np.testing.assert_allclose(got, np.stack([t.numpy() for t in served.reference]), atol=1e-6, rtol=0)
    with embed_priorities(served.engine) as seen:  # bulk over HTTP: the server's `priority` field
        bulk = np.asarray(emb.embed_documents_bulk(SERVED_REFERENCE_TEXTS))
    from orthrus_rag.retrievers.embedder import BULK_PRIORITY

    assert [p for _, p in seen] == [BULK_PRIORITY] * 2
    np.testing.assert_allclose(bulk, got, atol=1e-6, rtol=0)
    retriever = OrthrusRetriever.from_texts(TEXTS, emb, titles=TITLES, k=1)
    chat = ChatOrthrus(base_url=served.url, max_tokens=6, temperature=0)
    rag = IterRetGenRunnable(retriever, chat, iterations=2, k=1, max_tokens=6)
    rec = asyncio.run(rag.ainvoke(QUESTIONS[1]))  # (batch, abatch and stream: in-process above; same code)
    assert rec["iterations"][0]["retrieved"][0]["title"] == "Mount Everest"
    assert len(rec["iterations"]) == 2 and rec["error"] is None


def test_where_the_engine_is_must_be_said():
    with pytest.raises(ValueError, match="not both"):
        ChatOrthrus(engine=object(), base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="no engine"):
        ChatOrthrus(base_url=None).invoke("hi")


def test_the_retriever_takes_documents_and_deletions_as_a_vector_store_does(local, tmp_path):
    from langchain_core.documents import Document

    from orthrus_rag.integrations.langchain.retrievers import LangChainEmbedder
    from orthrus_rag.retrievers import DocumentError, LiveIndex
    from orthrus_rag.retrievers.embedder import BULK_PRIORITY

    emb = OrthrusEmbeddings(engine=local)
    retriever = OrthrusRetriever.from_texts(TEXTS, emb, titles=TITLES, k=1)
    question = "Which composer wrote the Brandenburg Concertos?"
    assert retriever.invoke(question)[0].metadata["title"] != "Bach"
    bach = Document("Johann Sebastian Bach composed the Brandenburg Concertos.", id="bach",
                    metadata={"title": "Bach"})
    with embed_priorities(local.client.engine) as seen:
        assert retriever.add_documents([bach]) == ["bach"]
        assert retriever.invoke(question)[0].metadata["title"] == "Bach"
    assert [p for _, p in seen] == [BULK_PRIORITY, 0]  # the add as bulk work, the query as serving work
    with pytest.raises(DocumentError, match="'bach' is present already"):
        retriever.add_documents([Document("again", id="bach")])
    assert retriever.delete(["bach"]) == ["bach"]
    assert retriever.invoke(question)[0].metadata["title"] != "Bach"
    with embed_priorities(local.client.engine) as seen:
        assert asyncio.run(retriever.aadd_documents([bach])) == ["bach"]
    assert [p for _, p in seen] == [BULK_PRIORITY]
    assert asyncio.run(retriever.ainvoke(question))[0].id == "bach"

    # a saved index: what LangChain adds is in its folder for the next process
    retriever.retriever.base.save(tmp_path / "index")
    saved = OrthrusRetriever(retriever=LiveIndex.open(tmp_path / "index", LangChainEmbedder(emb)), k=1)
    saved.add_documents([Document("Ada Lovelace wrote the first computer program.", metadata={"id": "ada"})])
    reopened = OrthrusRetriever(retriever=LiveIndex.open(tmp_path / "index", LangChainEmbedder(emb)), k=1)
    assert reopened.invoke("Who wrote the first computer program?")[0].id == "ada"
    with pytest.raises(ValueError, match="has no id"):
        saved.add_documents([Document("no id here")])
