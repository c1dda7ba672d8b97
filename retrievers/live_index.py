"""`LiveIndex`: a dense index that takes documents and deletions while it serves searches.

A saved (trained) index stays as it was built; documents added later go into a growing flat segment beside it
(as Milvus keeps a growing segment beside its sealed ones), and deletions are tombstones over both. A search asks
both parts, drops the tombstoned rows and merges by score, so a passage is searchable as soon as its `add` returns
and gone as soon as its `delete` returns.

Durability (`folder` given; the files are live_segments.py's): every add writes its passages (an Arrow shard) and
vectors (`.npy`) as new files, atomically, then the live manifest `live/live.json` (the segments and the
tombstones), atomically; only then does the add change what searches see. A process killed at any point leaves
the old manifest or the new one, never a torn one, and files the manifest does not name are removed at the next
open. Small segments are merged as they accumulate (each merge writes one new segment, then the manifest), so they
stay at most ~log2(added) in number.

Positions: the saved index's passages are 0..N-1 (its FAISS ids); the live passages follow in the order they
were added. Ids are the passages' own: an id can be present once; deleting it frees it for a new add.

BM25 (bm25s) takes no incremental adds, so only the dense kind is live; documents embed through an
`EngineEmbedder` as bulk work (`PoolingParams.priority > 0`), below queries and generations in every step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orthrus_rag.data.types import Passage
from orthrus_rag.engine.clients.protocol import RequestFailed
from orthrus_rag.retrievers import store
from orthrus_rag.retrievers.dense import DenseRetriever, Hit
from orthrus_rag.retrievers.embedder import Embedder, EngineEmbedder
from orthrus_rag.retrievers.faiss_index import build_index, import_faiss, search_params
from orthrus_rag.retrievers.live_segments import LiveState, SegmentFiles
from orthrus_rag.retrievers.passage_store import PassageStore

logger = logging.getLogger(__name__)


class DocumentError(ValueError):
    """Documents refused as a whole (nothing of the batch is kept): `problems` names each bad one, `status` is
    the HTTP status it answers (400 bad input, 404 unknown id, 409 an id already present)."""

    def __init__(self, problems: list[str], status: int = 400) -> None:
        shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        super().__init__(shown)
        self.problems, self.status = problems, status


class LiveIndex:
    """Search, add and delete over one dense index (see the module's docstring). `base`: a loaded or built
    `DenseRetriever`; `folder`: the saved index it was loaded from (adds and deletes are kept there), or None
    (in memory: gone with the process). Use `open`, `create` or `in_memory`."""

    def __init__(self, base: DenseRetriever, folder: str | Path | None = None) -> None:
        if base.index is None or base.dimension is None:
            raise ValueError("a live index needs a built or loaded dense index")
        self.base, self.embedder, self.spec = base, base.embedder, base.spec
        self.folder = Path(folder) if folder is not None else None
        self._files = SegmentFiles(self.folder)
        self.dimension = int(base.dimension)
        self._lock = threading.Lock()  # what a search reads: the segment index, passages, tombstones
        self._write_lock = threading.Lock()  # one writer at a time: its checks, files and manifest
        n_base = len(base.passages)
        self._state = LiveState(n_base)
        self._live_passages: list[Passage] = []
        self._segment = self._flat()
        self._deleted: set[int] = set()
        self._positions: dict[str, int] = {}  # id -> its present position
        for pos, pid in enumerate(_ids_of(base.passages)):
            self._positions.setdefault(pid, pos)
        if self.folder is not None:
            self._load_live()

    # ---- opening ----------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, folder: str | Path, embedder: Embedder, search: Mapping[str, int] | None = None,
             use_gpu: bool | None = None) -> "LiveIndex":
        """A saved dense index (`orthrus-rag index`, a run's `index/`, or `create`) with the documents added to and
        deleted from it since."""
        return cls(DenseRetriever.load(folder, embedder, use_gpu=use_gpu, search=search), folder)

    @classmethod
    def create(cls, folder: str | Path, embedder: Embedder, metric: str = "ip") -> "LiveIndex":
        """A new, empty index saved in `folder` (which must not hold one), that documents are then added to."""
        folder = Path(folder)
        if (folder / store.MANIFEST_FILE).exists():
            raise ValueError(f"{folder} holds an index already; open it instead")
        dimension = embedder.identity.get("dimension")
        if dimension is None:
            dimension = int(np.asarray(embedder.embed_query("dimension probe")).reshape(-1).shape[0])
        base = DenseRetriever(embedder, "flat", metric)
        base.index = build_index(np.zeros((0, int(dimension)), dtype=np.float32), base.spec)
        base.dimension, base.passages = int(dimension), []
        base.save(folder)
        return cls.open(folder, embedder)

    @classmethod
    def in_memory(cls, base: DenseRetriever) -> "LiveIndex":
        return cls(base, None)

    # ---- what it holds ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Passages present (added, not deleted)."""
        with self._lock:
            return len(self._positions)

    @property
    def passages(self) -> Sequence[Passage]:
        """Every passage ever held, by position (deleted ones too: a search never returns those)."""
        return _Concat(self.base.passages, self._live_passages)

    def get(self, passage_id: str) -> Passage | None:
        with self._lock:
            pos = self._positions.get(passage_id)
        return None if pos is None else self._passage(pos)

    def _passage(self, pos: int) -> Passage:
        n_base = self._state.base_passages
        return self.base.passages[pos] if pos < n_base else self._live_passages[pos - n_base]

    # ---- search (the retrievers' surface: (Passage, score) hits, best first) -----------------------------------
    def search(self, query: str, k: int = 5) -> list[Hit]:
        return self._search(self._vectors([self.embedder.embed_query(query)]), self._check_k(k))[0]

    def batch_search(self, queries: list[str], k: int = 5) -> list[list[Hit]]:
        k = self._check_k(k)
        if not queries:
            return []
        many = getattr(self.embedder, "embed_queries", None)
        vectors = many(list(queries)) if many is not None else [self.embedder.embed_query(q) for q in queries]
        return self._search(self._vectors(vectors), k)

    async def asearch(self, query: str, k: int = 5) -> list[Hit]:
        k = self._check_k(k)
        matrix = self._vectors([await self.embedder.aembed_query(query)])
        return (await asyncio.to_thread(self._search, matrix, k))[0]

    async def abatch_search(self, queries: list[str], k: int = 5) -> list[list[Hit]]:
        """Many queries embedded together (they share engine steps) and searched in one index call."""
        k = self._check_k(k)
        if not queries:
            return []
        many = getattr(self.embedder, "aembed_queries", None)
        vectors = (await many(list(queries)) if many is not None
                   else [await self.embedder.aembed_query(q) for q in queries])
        return await asyncio.to_thread(self._search, self._vectors(vectors), k)

    @staticmethod
    def _check_k(k: int) -> int:
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        return k

    def _vectors(self, vectors: Any) -> np.ndarray:
        matrix = np.ascontiguousarray(np.stack([np.asarray(v, dtype=np.float32).reshape(-1) for v in vectors]))
        if matrix.shape[1] != self.dimension:
            raise ValueError(f"query vectors have dimension {matrix.shape[1]}; the index has {self.dimension}")
        return matrix

    def _search(self, matrix: np.ndarray, k: int) -> list[list[Hit]]:
        """Both parts, each asked for k plus its tombstones (so k present rows survive the filter), merged."""
        with self._lock:
            n_base = self._state.base_passages
            dead_base = sum(1 for p in self._deleted if p < n_base)
            parts = []
            if self.base.index.ntotal:
                kb = min(k + dead_base, self.base.index.ntotal)
                params = search_params(self.spec, kb)
                scores, ids = (self.base.index.search(matrix, kb, params=params) if params
                               else self.base.index.search(matrix, kb))
                parts.append((scores, ids))
            if self._segment.ntotal:
                kl = min(k + len(self._deleted) - dead_base, self._segment.ntotal)
                scores, ids = self._segment.search(matrix, kl)
                parts.append((scores, np.where(ids >= 0, ids + n_base, ids)))
            if not parts:
                return [[] for _ in range(len(matrix))]
            scores = np.concatenate([s for s, _ in parts], axis=1)
            ids = np.concatenate([i for _, i in parts], axis=1)
            best_first = np.argsort(scores if self.spec.metric == "l2" else -scores, axis=1, kind="stable")
            hits = []
            for row in range(len(matrix)):
                found: list[Hit] = []
                for col in best_first[row]:
                    pos = int(ids[row, col])
                    if pos < 0 or pos in self._deleted:  # NOTE: ivf / hnsw pad with -1 when they find fewer
                        continue
                    found.append((self._passage(pos), float(scores[row, col])))
                    if len(found) == k:
                        break
                hits.append(found)
            return hits

    # ---- add and delete ---------------------------------------------------------------------------------------
    async def aadd(self, passages: Sequence[Passage], truncate: bool = False) -> list[str]:
        """Embed `passages` (bulk work) and add them; searchable when this returns. Refused whole (DocumentError,
        nothing kept) when any is empty, longer than the embedding model takes (unless `truncate`), or has an id
        that is present already or repeated in the batch."""
        passages = list(passages)
        self._check_new(passages)
        texts = [p.contents for p in passages]
        if isinstance(self.embedder, EngineEmbedder):
            vectors = self._vectors_of(passages, await self.embedder.aembed_bulk(texts, truncate=truncate))
        else:
            embed = getattr(self.embedder, "aembed_documents_bulk", self.embedder.aembed_documents)
            vectors = self._checked(await embed(texts), len(texts))
        await asyncio.to_thread(self._commit_add, passages, vectors)
        return [p.id for p in passages]

    def add(self, passages: Sequence[Passage], truncate: bool = False) -> list[str]:
        """`aadd` from code outside any event loop (the embedder's blocking path)."""
        passages = list(passages)
        self._check_new(passages)
        texts = [p.contents for p in passages]
        if isinstance(self.embedder, EngineEmbedder):
            vectors = self._vectors_of(passages, self.embedder.embed_bulk(texts, truncate=truncate))
        else:
            embed = getattr(self.embedder, "embed_documents_bulk", self.embedder.embed_documents)
            vectors = self._checked(embed(texts), len(texts))
        self._commit_add(passages, vectors)
        return [p.id for p in passages]

    def delete(self, ids: Sequence[str]) -> list[str]:
        """Tombstone the passages of `ids`; refused whole (DocumentError 404, nothing deleted) when any is not
        present. Durable when this returns."""
        ids = list(dict.fromkeys(ids))
        if not ids:
            raise DocumentError(["no ids to delete"])
        with self._write_lock:
            with self._lock:
                missing = [i for i in ids if i not in self._positions]
                if missing:
                    raise DocumentError([f"no document with id {i!r}" for i in missing], status=404)
                positions = [self._positions[i] for i in ids]
            state = self._state.copy()
            state.deleted = sorted(set(state.deleted) | set(positions))
            self._files.write_state(state)
            with self._lock:
                self._state = state
                self._deleted.update(positions)
                for i in ids:
                    del self._positions[i]
        logger.info("deleted %d document(s); %d present", len(ids), len(self._positions))
        return ids

    def _check_new(self, passages: list[Passage]) -> None:
        if not passages:
            raise DocumentError(["no documents to add"])
        problems, seen = [], set()
        for i, p in enumerate(passages):
            if not isinstance(p.id, str) or not p.id:
                problems.append(f"documents[{i}]: the id must be a non-empty string")
            if not isinstance(p.text, str) or not p.text.strip():
                problems.append(f"documents[{i}] (id {p.id!r}): the text is empty")
            if p.id in seen:
                problems.append(f"documents[{i}]: the id {p.id!r} is repeated in this batch")
            seen.add(p.id)
        if problems:
            raise DocumentError(problems)
        self._check_absent(passages)

    def _check_absent(self, passages: list[Passage]) -> None:
        with self._lock:
            present = [(i, p.id) for i, p in enumerate(passages) if p.id in self._positions]
        if present:
            raise DocumentError([f"documents[{i}]: a document with id {pid!r} is present already (delete it first)"
                                 for i, pid in present], status=409)

    def _vectors_of(self, passages: list[Passage], results: list[np.ndarray | Exception]) -> np.ndarray:
        """The vectors of a bulk embedding, or a DocumentError naming every document the engine refused."""
        problems = []
        for i, (p, out) in enumerate(zip(passages, results)):
            if isinstance(out, (ValueError, RequestFailed)):  # NOTE: this document's own fault (too long, ...)
                hint = " (truncate=true cuts it to the model's window)" if "maximum" in str(out) else ""
                problems.append(f"documents[{i}] (id {p.id!r}): {out}{hint}")
            elif isinstance(out, Exception):  # NOTE: the serving system's (a full queue, a shutdown)
                raise out
        if problems:
            raise DocumentError(problems)
        return self._checked(np.stack(results), len(passages))  # type: ignore[arg-type]

    def _checked(self, vectors: Any, n: int) -> np.ndarray:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (n, self.dimension):
            raise ValueError(f"the embedder returned shape {vectors.shape} for {n} documents; the index holds "
                             f"[n, {self.dimension}]")
        return vectors

    def _commit_add(self, passages: list[Passage], vectors: np.ndarray) -> None:
        """Files first, then the manifest, then what searches see (module docstring)."""
        with self._write_lock:
            self._check_absent(passages)  # NOTE: again: another add of the same id may have finished meanwhile
            state = self._state.copy()
            live = self._live_passages + passages  # NOTE: a new list: searches keep reading the old one
            state.segments.append(self._files.new_segment(state, passages, vectors))
            # NOTE: while the newest segment is at least as large as the one before it, the two become one (a
            # binary counter: ~log2(added) segments on disk, each passage rewritten ~log2(added) times)
            segs = state.segments  # NOTE: merged in place (slice assignment): the state's own list
            while self._files.dir is not None and len(segs) >= 2 and segs[-1].n >= segs[-2].n:
                n = segs[-2].n + segs[-1].n
                first = sum(s.n for s in segs[:-2])
                segs[-2:] = [self._files.new_segment(state, live[first:first + n], self._live_rows(first, n, vectors))]
            self._files.write_state(state)
            with self._lock:
                start = self._state.base_passages + len(self._live_passages)
                self._segment.add(vectors)
                self._live_passages = live
                for offset, p in enumerate(passages):
                    self._positions[p.id] = start + offset
                self._state = state
            self._files.remove_unlisted(state)
        logger.info("added %d document(s); %d present", len(passages), len(self._positions))

    def _live_rows(self, first: int, n: int, pending: np.ndarray) -> np.ndarray:
        """Vectors of live rows first..first+n: those in the segment index, then the batch being added."""
        held = self._segment.ntotal
        parts = [self._segment.reconstruct_n(first, min(n, held - first))] if first < held else []
        if first + n > held:
            parts.append(pending[max(0, first - held):first + n - held])
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    # ---- files (live_segments.py) ------------------------------------------------------------------------------
    def _load_live(self) -> None:
        state = self._files.read_state(len(self.base.passages))
        if state is None:
            return
        for passages, vectors in self._files.read_segments(state, self.dimension):
            self._segment.add(vectors)
            start = state.base_passages + len(self._live_passages)
            self._live_passages.extend(passages)
            for offset, p in enumerate(passages):
                self._positions[p.id] = start + offset
        self._deleted = set(state.deleted)
        for pid, pos in list(self._positions.items()):
            if pos in self._deleted:
                del self._positions[pid]
        # NOTE: a base id deleted and added again is present at its live position, found by the pass above
        self._state = state
        self._files.remove_unlisted(state)
        logger.info("live index %s: %d added, %d deleted since it was built", self.folder,
                    len(self._live_passages), len(self._deleted))

    def _flat(self) -> Any:
        faiss = import_faiss()
        return faiss.IndexFlatL2(self.dimension) if self.spec.metric == "l2" else faiss.IndexFlatIP(self.dimension)


def _ids_of(passages: Sequence[Passage]) -> list[str]:
    if isinstance(passages, PassageStore):
        return passages.ids()
    return [p.id for p in passages]


class _Concat(Sequence[Passage]):
    def __init__(self, a: Sequence[Passage], b: Sequence[Passage]) -> None:
        self.a, self.b = a, b

    def __len__(self) -> int:
        return len(self.a) + len(self.b)

    def __getitem__(self, i: int) -> Passage:  # type: ignore[override]
        if i < 0:
            i += len(self)
        return self.a[i] if i < len(self.a) else self.b[i - len(self.a)]


