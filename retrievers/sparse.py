"""Sparse retrieval: BM25 over the passages' words, through `bm25s` (a scipy-sparse BM25; saved as .npy arrays
and loaded memory-mapped). The same search surface as `DenseRetriever`: `search`, `batch_search`, `asearch`, hits
as (Passage, score), best first; passages sharing no word with the query are not hits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from orthrus_rag.data.types import Passage

logger = logging.getLogger(__name__)
Hit = tuple[Passage, float]
BM25_DIR = "bm25"
BM25_METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")


def _bm25s() -> Any:
    import bm25s  # noqa: F401 (a dependency; imported where used: it pulls scipy)
    from bm25s.tokenization import Tokenizer  # noqa: F401

    return bm25s


class BM25Retriever:
    """BM25 (`k1`, `b`, `method` as bm25s names them: Lucene's by default) over each passage's title and text,
    lower-cased, English stopwords removed."""

    def __init__(self, k1: float = 1.5, b: float = 0.75, method: str = "lucene") -> None:
        if method not in BM25_METHODS:
            raise ValueError(f"unknown BM25 method {method!r}; expected one of {', '.join(BM25_METHODS)}")
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b, self.method = k1, b, method
        self.passages: Sequence[Passage] = []
        self.model: Any = None
        self.tokenizer: Any = None

    def __len__(self) -> int:
        return len(self.passages)

    def build(self, passages: Sequence[Passage], texts: Iterable[str] | None = None) -> None:
        """Index `passages` (their `contents`, or `texts` in the same order: e.g. streamed from a store)."""
        bm25s = _bm25s()
        if len(passages) == 0:
            raise ValueError("cannot build a BM25 index over no passages")
        self.tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        contents = list(texts) if texts is not None else [p.contents for p in passages]
        tokens = self.tokenizer.tokenize(contents, return_as="tuple", show_progress=False)
        self.model = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
        self.model.index(tokens, show_progress=False)
        self.passages = passages
        logger.info("built a BM25 index over %d passages (%d words)", len(passages), len(tokens.vocab))

    # ---- search -----------------------------------------------------------------------------------------------
    def search(self, query: str, k: int = 5) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: list[str], k: int = 5) -> list[list[Hit]]:
        if self.model is None:
            raise RuntimeError("the BM25 retriever has no index yet; call build() or BM25Retriever.load() first")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if not queries:
            return []
        k = min(k, len(self.passages))
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        docs, scores = self.model.retrieve(ids, k=k, show_progress=False, n_threads=1)
        return [[(self.passages[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if s > 0]
                for row_ids, row_scores in zip(docs.tolist(), scores.tolist())]

    async def asearch(self, query: str, k: int = 5) -> list[Hit]:
        return await asyncio.to_thread(self.search, query, k)

    # ---- persistence ------------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """Write the index and its vocabulary into `folder` (the passages are saved beside it by their owner)."""
        if self.model is None:
            raise RuntimeError("nothing to save; call build() first")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save(str(folder), show_progress=False)
        self.tokenizer.save_vocab(str(folder))
        self.tokenizer.save_stopwords(str(folder))

    @classmethod
    def load(cls, folder: str | Path, passages: Sequence[Passage]) -> "BM25Retriever":
        """A saved index, memory-mapped, over `passages` (the ones it was built on, in order)."""
        bm25s = _bm25s()
        folder = Path(folder)
        if not (folder / "params.index.json").is_file():
            raise ValueError(f"no saved BM25 index at {folder} (build one with retriever=bm25 or retriever=hybrid)")
        model = bm25s.BM25.load(str(folder), mmap=True, show_progress=False)
        retriever = cls(k1=model.k1, b=model.b, method=model.method)
        retriever.model, retriever.passages = model, passages
        retriever.tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        retriever.tokenizer.load_vocab(str(folder))
        retriever.tokenizer.load_stopwords(str(folder))
        num_docs = int(getattr(model, "scores", {}).get("num_docs", len(passages)))
        if num_docs != len(passages):
            raise ValueError(f"{folder} indexes {num_docs} passages; the store beside it holds {len(passages)}")
        return retriever
