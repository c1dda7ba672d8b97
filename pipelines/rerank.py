"""A reranking stage between a method's retriever and its prompts (`pipeline.reranker`): each retrieval asks the
retriever for `candidates` passages (`retriever.k`), scores every one against the query with a reranker the engine
serves (engine/rerankers.py; a client with `score`), and keeps the best `k` (`pipeline.top_k`), best first, each
with its reranker score (what the run's records keep for every iteration)."""

from __future__ import annotations

from typing import Any

from orthrus_rag.data.types import Passage
from orthrus_rag.params import RerankParams

Hits = list[tuple[Passage, float]]


DEFAULT = "default"  # `pipeline.reranker`: the first of model.rerankers


def check_reranking(reranker: str | None, top_k: int, candidates: int, loaded: list[str]) -> None:
    """The rules of `pipeline.reranker` / `pipeline.top_k` against `retriever.k` and `model.rerankers` (the CLI's
    `validate` asks them before anything loads)."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if reranker is None:
        return
    if not loaded:
        raise ValueError("reranker must name a loaded reranker, and model.rerankers is empty: set it (a "
                         "cross-encoder, or backbone)")
    if reranker != DEFAULT and reranker not in loaded:
        raise ValueError(f"reranker must be one of model.rerankers ({', '.join(loaded)}) or default, got "
                         f"{reranker!r}")
    if top_k > candidates:
        raise ValueError(f"top_k must be at most retriever.k ({candidates}), the candidates it keeps the best of, "
                         f"got {top_k}")


class Reranking:
    """`reranker`: a loaded reranker's name (None or "default": the engine's first); `candidates`: passages scored per
    retrieval. The scoring requests are latency-critical (priority -1), as a hop's query embedding is: the chain
    waits on them."""

    def __init__(self, client: Any, reranker: str | None, candidates: int) -> None:
        if not callable(getattr(client, "score", None)):
            raise ValueError(f"{getattr(client, 'name', type(client).__name__)} cannot score passages: a reranker runs "
                             "with deploy=engine, dedicated, disagg_pd or ray, or against a server")
        names = getattr(client, "reranker_names", None)
        if names is not None and not names:
            raise ValueError("pipeline.reranker needs a reranker loaded: set model.rerankers (a cross-encoder, or "
                             "backbone)")
        if names is not None and reranker not in (None, DEFAULT) and reranker not in names:
            raise ValueError(f"pipeline.reranker={reranker!r} is not loaded; model.rerankers: {', '.join(names)}")
        if candidates < 1:
            raise ValueError("a reranker needs at least one candidate (retriever.k)")
        self.client = client
        self.name = None if reranker == DEFAULT else reranker
        self.candidates = candidates
        self.params = RerankParams(reranker=self.name, priority=-1)

    async def rerank(self, query: str, hits: Hits, k: int) -> Hits:
        """The best `k` of `hits` for `query` by the reranker's score (ties keep the retriever's order)."""
        if not hits:
            return []
        scores = await self.client.score(query, [p.contents for p, _ in hits], self.params)
        order = sorted(range(len(hits)), key=lambda i: -scores[i])[:k]
        return [(hits[i][0], float(scores[i])) for i in order]
