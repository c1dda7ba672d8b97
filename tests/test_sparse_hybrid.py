"""BM25 (bm25s) and the hybrid retriever (reciprocal-rank fusion), in memory and built into an index folder, and
through the LangChain retriever; the hash embedder of test_retriever.py stands in for a model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import DenseRetriever
from orthrus_rag.retrievers.faiss_index import IndexSpec
from orthrus_rag.retrievers.hybrid import HybridRetriever, fuse
from orthrus_rag.retrievers.index_build import IndexBuilder
from orthrus_rag.retrievers.kinds import SparseSettings, build_in_memory, open_retriever
from orthrus_rag.retrievers.sparse import BM25Retriever
from tests.test_retriever import HashEmbedder, make_corpus

CORPUS = make_corpus(300)


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    retriever = BM25Retriever()
    retriever.build(CORPUS)
    return retriever


def ids(hits: list) -> list[str]:
    return [p.id for p, _ in hits]


def test_bm25_ranks_the_passage_sharing_the_rare_words_first(bm25: BM25Retriever) -> None:
    hits = bm25.search("alpha17 gamma17 common3", k=5)
    assert ids(hits)[0] == "17" and [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    assert bm25.search("words nobody wrote", k=5) == []  # no shared word: no hit, not a zero-score filler
    assert [ids(h)[0] for h in bm25.batch_search(["beta5", "alpha250 beta250"], k=2)] == ["5", "250"]
    assert asyncio.run(bm25.asearch("alpha17 gamma17", k=3)) == bm25.search("alpha17 gamma17", k=3)
    with pytest.raises(ValueError, match="k must be positive"):
        bm25.search("alpha1", k=0)


def test_bm25_checks_its_parameters_and_state() -> None:
    with pytest.raises(ValueError, match="unknown BM25 method 'okapi'"):
        BM25Retriever(method="okapi")
    with pytest.raises(ValueError, match="0 <= b <= 1"):
        BM25Retriever(b=1.5)
    with pytest.raises(RuntimeError, match="no index yet"):
        BM25Retriever().search("x")
    with pytest.raises(ValueError, match="no passages"):
        BM25Retriever().build([])


def test_bm25_saved_and_loaded_memory_mapped_answers_the_same(bm25: BM25Retriever, tmp_path: Path) -> None:
    bm25.save(tmp_path / "bm25")
    loaded = BM25Retriever.load(tmp_path / "bm25", CORPUS)
    queries = ["alpha17 gamma17 common3", "beta42", "common1 common2 alpha9"]
    assert loaded.batch_search(queries, k=5) == bm25.batch_search(queries, k=5)
    with pytest.raises(ValueError, match="indexes 300 passages; the store beside it holds 10"):
        BM25Retriever.load(tmp_path / "bm25", CORPUS[:10])
    with pytest.raises(ValueError, match="no saved BM25 index"):
        BM25Retriever.load(tmp_path, CORPUS)


def test_reciprocal_rank_fusion() -> None:
    a, b, c, d = (Passage(x, x, x) for x in "abcd")
    fused = fuse(([(a, 9.0), (b, 8.0), (c, 7.0)], [(c, 0.5), (d, 0.4)]), (1.0, 1.0), k=4, rrf_k=60)
    assert ids(fused) == ["c", "a", "b", "d"]  # in both lists beats first in one
    assert fused[0][1] == pytest.approx(1 / 63 + 1 / 61) and fused[1][1] == pytest.approx(1 / 61)
    assert ids(fuse(([(a, 1), (b, 1)], [(b, 1), (a, 1)]), (1.0, 1.0), k=2)) == ["a", "b"]  # a tie: first seen
    assert ids(fuse(([(a, 1)], [(d, 1)]), (1.0, 3.0), k=2)) == ["d", "a"]  # the weights decide
    assert ids(fuse(([(a, 1)], [(d, 1)]), (0.0, 1.0), k=2)) == ["d", "a"]


def test_hybrid_fuses_dense_and_bm25(bm25: BM25Retriever) -> None:
    dense = DenseRetriever(HashEmbedder())
    dense.build(CORPUS)
    hybrid = build_in_memory(CORPUS, "hybrid", dense, SparseSettings(candidates=10))
    assert isinstance(hybrid, HybridRetriever) and len(hybrid) == 300
    query = "alpha17 beta17 gamma17"
    hits = hybrid.search(query, k=5)
    assert ids(hits)[0] == "17" and len(hits) == 5
    union = set(ids(dense.search(query, k=10))) | set(ids(bm25.search(query, k=10)))
    assert set(ids(hits)) <= union
    assert asyncio.run(hybrid.asearch(query, k=5)) == hits
    with pytest.raises(ValueError, match="not both 0"):
        SparseSettings(dense_weight=0, bm25_weight=0)
    with pytest.raises(ValueError, match="the dense index holds 300 passages and the BM25 index 10"):
        small = BM25Retriever()
        small.build(CORPUS[:10])
        HybridRetriever(dense, small)


def test_an_index_folder_built_for_bm25_only_and_for_hybrid(tmp_path: Path) -> None:
    IndexBuilder(tmp_path / "bm25", None, IndexSpec(), {"kind": "t"}, shard_size=64,
                 sparse=BM25Retriever()).build(CORPUS)
    assert not list((tmp_path / "bm25" / "vectors").glob("*.npy")) and not (tmp_path / "bm25" / "index.faiss").exists()
    sparse = open_retriever(tmp_path / "bm25", "bm25", None)
    assert isinstance(sparse, BM25Retriever) and ids(sparse.search("alpha17 gamma17", k=1)) == ["17"]
    with pytest.raises(ValueError, match="holds bm25 only; retriever.kind=hybrid needs dense"):
        open_retriever(tmp_path / "bm25", "hybrid", HashEmbedder())
    embedder = HashEmbedder()
    IndexBuilder(tmp_path / "both", embedder, IndexSpec(), {"kind": "t"}, shard_size=64,
                 sparse=BM25Retriever()).build(CORPUS)
    hybrid = open_retriever(tmp_path / "both", "hybrid", embedder)
    dense = open_retriever(tmp_path / "both", "dense", embedder)
    assert isinstance(hybrid, HybridRetriever) and isinstance(dense, DenseRetriever)
    assert ids(hybrid.search("alpha17 beta17 gamma17", k=3))[0] == "17"
    IndexBuilder(tmp_path / "dense", embedder, IndexSpec(), {"kind": "t"}, shard_size=64).build(CORPUS)
    with pytest.raises(ValueError, match="holds dense only; retriever.kind=bm25 needs bm25"):
        open_retriever(tmp_path / "dense", "bm25", None)
    with pytest.raises(ValueError, match="unknown retriever kind 'splade'"):
        open_retriever(tmp_path / "dense", "splade", embedder)


def test_the_langchain_retriever_takes_bm25_and_hybrid(bm25: BM25Retriever) -> None:
    from orthrus_rag.integrations.langchain import OrthrusRetriever

    docs = OrthrusRetriever(retriever=bm25, k=2).invoke("alpha17 gamma17")
    assert [d.id for d in docs][0] == "17" and docs[0].metadata["title"] == "Title 17"
    dense = DenseRetriever(HashEmbedder())
    dense.build(CORPUS)
    hybrid = HybridRetriever(dense, bm25)
    docs = asyncio.run(OrthrusRetriever(retriever=hybrid, k=3).ainvoke("alpha17 beta17 gamma17"))
    assert len(docs) == 3 and docs[0].id == "17"
