"""Dense retrieval: embed passages through an `Embedder`, index them with FAISS, search, save and load."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import store
from orthrus_rag.retrievers.embedder import Embedder, batches
from orthrus_rag.retrievers.faiss_index import (IndexSpec, build_index, configure, import_faiss, search_params,
                                                to_cpu, to_device)
from orthrus_rag.retrievers.passage_store import PassageStore, shard_name, write_shard

logger = logging.getLogger(__name__)
Hit = tuple[Passage, float]


class DenseRetriever:
    """Top-k passages by inner product (or L2 distance) of embeddings.

    `index_type`: "flat" (exact), "ivf" (IndexIVFFlat; `nlist` lists, `nprobe` visited), "hnsw"
    (IndexHNSWFlat; `hnsw_m` neighbours) or "factory" (`factory`: any faiss.index_factory string, trained on
    `train_size` sampled vectors). `use_gpu`: None uses FAISS GPUs when present, False never, True must.
    Scores: inner product (higher is closer) or squared L2 distance (lower is closer), best first. `passages`
    is a list (built here) or a memory-mapped `PassageStore` (loaded, or built by index_build.py).
    """

    def __init__(self, embedder: Embedder, index_type: str = "flat", metric: str = "ip", nlist: int = 1024,
                 nprobe: int = 16, hnsw_m: int = 32, ef_search: int = 64, use_gpu: bool | None = None,
                 factory: str | None = None, train_size: int = 131072) -> None:
        self.embedder = embedder
        self.spec = IndexSpec(index_type, metric, nlist=nlist, nprobe=nprobe, hnsw_m=hnsw_m, ef_search=ef_search,
                              factory=factory, train_size=train_size)
        self.use_gpu = use_gpu
        self.passages: Sequence[Passage] = []
        self.index: Any = None
        self.on_gpu = False
        self.dimension: int | None = None

    def __len__(self) -> int:
        return len(self.passages)

    # ---- build ------------------------------------------------------------------------------------------
    def build(self, passages: list[Passage], batch_size: int = 64) -> None:
        """Embed every passage's `contents` and (re)build the index over them."""
        if not passages:
            raise ValueError("cannot build an index over no passages")
        parts = [self._check_vectors(self.embedder.embed_documents([p.contents for p in chunk]), len(chunk))
                 for chunk in batches(passages, batch_size, "embedding passages")]
        vectors = np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)
        self.dimension = int(vectors.shape[1])
        expected = self.embedder.identity.get("dimension")
        if expected is not None and int(expected) != self.dimension:
            raise ValueError(f"embedder identity says dimension {expected} but it returned {self.dimension}")
        cpu_index = build_index(vectors, self.spec)
        self.index, self.on_gpu = to_device(cpu_index, self.spec, self.use_gpu)
        self.passages = list(passages)
        logger.info("built a %s index over %d passages (d=%d)", self.spec.index_type, len(passages), self.dimension)

    @staticmethod
    def _check_vectors(vectors: Any, n: int) -> np.ndarray:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != n:
            raise ValueError(f"embed_documents returned shape {vectors.shape} for {n} texts; expected [{n}, d]")
        return vectors

    # ---- search -----------------------------------------------------------------------------------------
    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The top-k passages for `query`, best first (k is clipped to the corpus size)."""
        k = self._check_k(k)
        return self._search_vectors(self._query_matrix([self.embedder.embed_query(query)]), k)[0]

    def batch_search(self, queries: list[str], k: int = 5) -> list[list[Hit]]:
        """`search` for each query; an embedder with `embed_queries` embeds them together."""
        k = self._check_k(k)
        if not queries:
            return []
        many = getattr(self.embedder, "embed_queries", None)
        vectors = many(list(queries)) if many is not None else [self.embedder.embed_query(q) for q in queries]
        return self._search_vectors(self._query_matrix(vectors), k)

    async def asearch(self, query: str, k: int = 5) -> list[Hit]:
        """`search` with the embedder's async path; the FAISS search runs in a worker thread."""
        k = self._check_k(k)
        matrix = self._query_matrix([await self.embedder.aembed_query(query)])
        return (await asyncio.to_thread(self._search_vectors, matrix, k))[0]

    def _check_k(self, k: int) -> int:
        if self.index is None:
            raise RuntimeError("the retriever has no index yet; call build() or DenseRetriever.load() first")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        return min(k, len(self.passages))

    def _query_matrix(self, vectors: Any) -> np.ndarray:
        matrix = np.ascontiguousarray(np.stack([np.asarray(v, dtype=np.float32).reshape(-1) for v in vectors]))
        if matrix.shape[1] != self.dimension:
            raise ValueError(f"query vectors have dimension {matrix.shape[1]}; the index has {self.dimension}")
        return matrix

    def _search_vectors(self, matrix: np.ndarray, k: int) -> list[list[Hit]]:
        params = search_params(self.spec, k)
        scores, ids = self.index.search(matrix, k, params=params) if params else self.index.search(matrix, k)
        # NOTE: ivf / hnsw pad with id -1 when they find fewer than k
        return [[(self.passages[i], float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
                for row_ids, row_scores in zip(ids.tolist(), scores.tolist())]

    # ---- persistence ------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """Write `index.faiss`, the passages (`passages/`, one Arrow shard) and `manifest.json` into `folder`."""
        if self.index is None:
            raise RuntimeError("nothing to save; call build() first")
        folder = Path(folder)
        (folder / store.PASSAGES_DIR).mkdir(parents=True, exist_ok=True)
        faiss = import_faiss()
        faiss.write_index(to_cpu(self.index, self.on_gpu), str(folder / store.INDEX_FILE))
        if not (isinstance(self.passages, PassageStore) and self.passages.folder == folder / store.PASSAGES_DIR):
            for old in (folder / store.PASSAGES_DIR).glob("shard-*.arrow"):
                old.unlink()
            write_shard(folder / store.PASSAGES_DIR / shard_name(0), list(self.passages))
        store.write_manifest(folder / store.MANIFEST_FILE, store.manifest(
            self.embedder.identity, self.spec.to_dict(), self.dimension, len(self.passages),
            num_shards=len(list((folder / store.PASSAGES_DIR).glob("shard-*.arrow")))))
        logger.info("saved %d passages and a %s index to %s", len(self.passages), self.spec.index_type, folder)

    @classmethod
    def load(cls, folder: str | Path, embedder: Embedder, use_gpu: bool | None = None,
             search: Mapping[str, int] | None = None) -> "DenseRetriever":
        """Read a saved index; refuses (ValueError) missing or corrupt files and an embedder of another identity.

        `search`: search-time settings to use instead of the saved ones (`nprobe`, `ef_search`)."""
        folder = Path(folder)
        store.check_folder(folder)
        manifest = store.read_manifest(folder / store.MANIFEST_FILE)
        diff = store.identity_diff(manifest["embedder"], embedder.identity)
        if diff:
            raise ValueError(f"the index at {folder} was built by another embedder; differing fields:\n  "
                             + "\n  ".join(diff))
        try:
            spec = replace(IndexSpec(**manifest["index"]), **dict(search or {}))
        except TypeError as exc:
            raise ValueError(f"{folder / store.MANIFEST_FILE} is corrupt: bad index section ({exc})") from exc
        faiss = import_faiss()
        # NOTE: an index merged on disk keeps its lists in a file beside it, read through the page cache
        flags = faiss.IO_FLAG_ONDISK_SAME_DIR if manifest.get("on_disk") else 0
        try:
            cpu_index = faiss.read_index(str(folder / store.INDEX_FILE), flags)
        except RuntimeError as exc:
            raise ValueError(f"{folder / store.INDEX_FILE} is corrupt: {exc}") from exc
        passages = store.open_passages(folder, manifest)
        n, d = int(manifest["num_passages"]), int(manifest["dimension"])
        if not (cpu_index.ntotal == len(passages) == n) or cpu_index.d != d:
            raise ValueError(f"{folder} is inconsistent: manifest says {n} passages of dimension {d}, the index "
                             f"holds {cpu_index.ntotal} of dimension {cpu_index.d}, the passage store has "
                             f"{len(passages)}")
        configure(cpu_index, spec)
        retriever = cls(embedder, spec.index_type, spec.metric, use_gpu=use_gpu, factory=spec.factory)
        retriever.spec, retriever.passages, retriever.dimension = spec, passages, d
        retriever.index, retriever.on_gpu = to_device(cpu_index, spec, use_gpu)
        return retriever
