"""Hybrid retrieval: dense and BM25 hits fused by reciprocal rank (Cormack et al., 2009): a passage scores
sum(weight / (rrf_k + rank)) over the lists it is in (rank from 1), so neither side's score scale matters. Each
side is asked for `candidates` hits (at least k); the fused score is the hit's score."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers.dense import DenseRetriever
from orthrus_rag.retrievers.sparse import BM25Retriever

Hit = tuple[Passage, float]


def fuse(ranked: Sequence[list[Hit]], weights: Sequence[float], k: int, rrf_k: float = 60.0) -> list[Hit]:
    """Reciprocal-rank fusion of ranked hit lists (passages matched by id), the top `k`, best first; ties keep
    the order in which passages were first seen (the first list's order first)."""
    scores: dict[str, float] = {}
    passages: dict[str, Passage] = {}
    for hits, weight in zip(ranked, weights):
        for rank, (passage, _) in enumerate(hits, start=1):
            passages.setdefault(passage.id, passage)
            scores[passage.id] = scores.get(passage.id, 0.0) + weight / (rrf_k + rank)
    order = sorted(scores, key=lambda pid: -scores[pid])  # NOTE: stable: dict order breaks ties
    return [(passages[pid], scores[pid]) for pid in order[:k]]


def check_fusion(dense_weight: float, bm25_weight: float, rrf_k: float, candidates: int) -> None:
    if dense_weight < 0 or bm25_weight < 0 or dense_weight + bm25_weight == 0:
        raise ValueError(f"hybrid weights must be non-negative and not both 0, got dense {dense_weight}, "
                         f"bm25 {bm25_weight}")
    if rrf_k < 0 or candidates < 1:
        raise ValueError(f"hybrid needs rrf_k >= 0 and candidates >= 1, got {rrf_k} and {candidates}")


class HybridRetriever:
    """Dense + BM25 over the same passages, fused by reciprocal rank."""

    def __init__(self, dense: DenseRetriever, sparse: BM25Retriever, dense_weight: float = 1.0,
                 bm25_weight: float = 1.0, rrf_k: float = 60.0, candidates: int = 20) -> None:
        check_fusion(dense_weight, bm25_weight, rrf_k, candidates)
        if len(dense) != len(sparse):
            raise ValueError(f"the dense index holds {len(dense)} passages and the BM25 index {len(sparse)}")
        self.dense, self.sparse = dense, sparse
        self.weights = (dense_weight, bm25_weight)
        self.rrf_k, self.candidates = rrf_k, candidates

    @property
    def passages(self) -> Sequence[Passage]:
        return self.dense.passages

    def __len__(self) -> int:
        return len(self.dense)

    def search(self, query: str, k: int = 5) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: list[str], k: int = 5) -> list[list[Hit]]:
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        n = max(k, self.candidates)
        dense, sparse = self.dense.batch_search(queries, n), self.sparse.batch_search(queries, n)
        return [fuse((d, s), self.weights, k, self.rrf_k) for d, s in zip(dense, sparse)]

    async def asearch(self, query: str, k: int = 5) -> list[Hit]:
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        n = max(k, self.candidates)
        dense, sparse = await asyncio.gather(self.dense.asearch(query, n), self.sparse.asearch(query, n))
        return fuse((dense, sparse), self.weights, k, self.rrf_k)
