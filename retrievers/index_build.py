"""Build a dense index over a corpus of any size: streaming, in shards, resumable, in bounded memory.

The passages stream in; every `shard_size` of them are embedded together (one batch to the engine, so its steps
are embedding-only and full), then written as one Arrow shard of passages and one `.npy` of float32 vectors, and
recorded as finished in `build.json`; only then does the next shard start. A killed build resumes from the last
finished shard: the corpus is read again from the start and the finished shards' passages skipped (reading is
cheap next to embedding). Once every shard is in, the index is trained on a seeded sample of `train_size` vectors
and the shards are added (`add_shards`: a graph index in one call), or, with `on_disk`, each shard becomes an inverted-file block merged on
disk (`faiss.contrib.ondisk.merge_ondisk`) and searched memory-mapped. With `sparse` (an unbuilt BM25Retriever:
its parameters), a BM25 index is built over the stored passages too (`bm25/`); with no embedder, only that (no
vectors, no FAISS index).

Memory: one shard's passages and vectors, the training sample (train_size x d x 4 bytes), and the index itself
(with `on_disk`: its coarse quantizer only); BM25: the corpus's token ids while it indexes. The C heap's free
pages are handed back after every shard (orthrus_rag/memory.py). The vectors stay in
`vectors/`, so another FAISS index over the same corpus needs no embedding.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from orthrus_rag.atomic import atomic_write
from orthrus_rag.memory import release_free_memory
from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import store
from orthrus_rag.retrievers.embedder import Embedder
from orthrus_rag.retrievers.faiss_index import (
    IndexSpec,
    add_shards,
    configure,
    empty_index,
    import_faiss,
    sample_shards,
    train,
)
from orthrus_rag.retrievers.passage_store import PassageStore, shard_name, write_shard
from orthrus_rag.retrievers.sparse import BM25_DIR, BM25Retriever

logger = logging.getLogger(__name__)

STATE_FILE = "build.json"
VECTORS_DIR = "vectors"
BLOCKS_DIR = "ivf_blocks"
IVF_DATA = "lists.ivfdata"


# given the passages done, each later shard's passages and vectors (None: BM25 only), in corpus order
EmbeddedShards = Callable[[int], Iterator[tuple[list[Passage], Any]]]


@dataclass
class BuildReport:
    num_passages: int
    num_shards: int
    resumed_shards: int  # finished by an earlier, interrupted build
    resumed_passages: int
    embed_seconds: float  # this build's embedding time (resumed shards not counted)
    index_seconds: float

    @property
    def passages_per_s(self) -> float:
        embedded = self.num_passages - self.resumed_passages
        return embedded / self.embed_seconds if self.embed_seconds > 0 else 0.0


def _vector_name(number: int) -> str:
    return f"shard-{number:05d}.npy"


class IndexBuilder:
    """Builds (or resumes building) the index of one corpus with one embedder into `folder`.

    `corpus`: what the passages are (the `corpus` config's identity), checked on resume with the embedder's
    identity, the shard size and the index spec: a folder started for another corpus or embedder is refused."""

    def __init__(self, folder: str | Path, embedder: Embedder | None, spec: IndexSpec, corpus: dict[str, Any],
                 shard_size: int = 4096, on_disk: bool = False, seed: int = 0, progress: bool = True,
                 sparse: BM25Retriever | None = None) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        if embedder is None and sparse is None:
            raise ValueError("an index build needs an embedder (dense), a BM25Retriever to build (sparse), or both")
        self.folder = Path(folder)
        self.embedder, self.spec, self.on_disk, self.seed = embedder, spec, on_disk, seed
        self.shard_size, self.progress, self.sparse = shard_size, progress, sparse
        identity = embedder.identity if embedder is not None else None
        self.settings = store.canonical({"corpus": corpus, "embedder": identity, "shard_size": shard_size})

    # ---- state --------------------------------------------------------------------------------------------------
    def _state_path(self) -> Path:
        return self.folder / STATE_FILE

    def _read_state(self) -> dict[str, Any]:
        path = self._state_path()
        if not path.is_file():
            return {**self.settings, "shards": []}
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is corrupt ({exc}); remove the folder to build from scratch") from exc
        diff = [f"{key}: the folder's build has {state.get(key)!r}, this one {value!r}"
                for key, value in self.settings.items() if state.get(key) != value]
        if diff:
            raise ValueError(f"{self.folder} holds a build of another corpus or embedder; differing:\n  "
                             + "\n  ".join(diff))
        return state

    def _commit(self, state: dict[str, Any]) -> None:
        with atomic_write(self._state_path(), "w") as f:
            f.write(json.dumps(state, indent=1, sort_keys=True) + "\n")

    # ---- build --------------------------------------------------------------------------------------------------
    def build(self, passages: Iterable[Passage] | None, total: int | None = None,
              embedded: EmbeddedShards | None = None) -> BuildReport:
        """Embed what is not embedded yet, then (re)build the index (open it with retrievers/kinds.py).

        `embedded`: where the shards come from embedded already (a Ray Data pipeline, entrypoints/ray/): called
        with the number of passages done, it yields each later shard's passages (`shard_size` of them, the last
        fewer) and their vectors, in corpus order; `passages` is then unused."""
        for sub in (store.PASSAGES_DIR, VECTORS_DIR):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        state = self._read_state()
        done = [int(s["n"]) for s in state["shards"]]
        skip = sum(done)
        if done:
            logger.info("resuming: %d shards (%d passages) are embedded already", len(done), skip)
        shards = embedded(skip) if embedded is not None else self._embedded_here(iter(passages or ()), skip)
        embed_s = 0.0
        quiet = not self.progress or not sys.stderr.isatty()
        with tqdm(total=total, initial=skip, desc="indexing", unit="passage", disable=quiet, smoothing=0.1) as bar:
            while True:
                started = time.perf_counter()
                item = next(shards, None)
                if item is None:
                    break
                embed_s += time.perf_counter() - started
                chunk, vectors = item
                number = len(state["shards"])
                if vectors is not None:
                    vectors = self._checked(vectors, len(chunk))
                    with atomic_write(self.folder / VECTORS_DIR / _vector_name(number)) as f:
                        np.save(f, vectors)
                    state["dimension"] = int(vectors.shape[1])
                write_shard(self.folder / store.PASSAGES_DIR / shard_name(number), chunk)
                state["shards"].append({"n": len(chunk), "first_id": chunk[0].id, "last_id": chunk[-1].id})
                self._commit(state)  # NOTE: the shard counts as finished only from here
                release_free_memory()  # NOTE: else the freed step tensors of every shard stay resident
                bar.update(len(chunk))
                if quiet:  # NOTE: a disabled bar counts nothing; the state does
                    logger.info("indexing: %d passages done (%d shards)", sum(int(s["n"]) for s in state["shards"]),
                                number + 1)
        if not state["shards"]:
            raise ValueError("the corpus is empty: no passages to index")
        started = time.perf_counter()
        num_passages = self._assemble(state)
        report = BuildReport(num_passages, len(state["shards"]), len(done), skip, embed_s,
                             time.perf_counter() - started)
        logger.info("indexed %d passages in %d shards (%.1f passages/s embedding; index %.1f s)",
                    report.num_passages, report.num_shards, report.passages_per_s, report.index_seconds)
        return report

    def _embedded_here(self, stream: Iterator[Passage], skip: int) -> Iterator[tuple[list[Passage], Any]]:
        """The corpus past its first `skip` passages, a shard at a time, embedded in this process."""
        skipped = sum(1 for _ in islice(stream, skip))
        if skipped < skip:
            raise ValueError(f"the corpus now holds {skipped} passages, fewer than the {skip} a previous build of "
                             f"{self.folder} embedded: it changed; remove the folder to build from scratch")
        for chunk in _chunks(stream, self.shard_size):
            yield chunk, (self._embed(chunk) if self.embedder is not None else None)

    def _embed(self, chunk: list[Passage]) -> np.ndarray:
        assert self.embedder is not None
        return np.asarray(self.embedder.embed_documents([p.contents for p in chunk]), dtype=np.float32)

    def _checked(self, vectors: Any, n: int) -> np.ndarray:
        assert self.embedder is not None
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != n:
            raise ValueError(f"embed_documents returned shape {vectors.shape} for {n} texts")
        expected = self.embedder.identity.get("dimension")
        if expected is not None and int(expected) != vectors.shape[1]:
            raise ValueError(f"embedder identity says dimension {expected} but it returned {vectors.shape[1]}")
        return np.ascontiguousarray(vectors)

    # ---- index --------------------------------------------------------------------------------------------------
    def vectors(self, number: int) -> np.ndarray:
        """Shard `number`'s vectors, memory-mapped."""
        return np.load(self.folder / VECTORS_DIR / _vector_name(number), mmap_mode="r")

    def _assemble(self, state: dict[str, Any]) -> int:
        """The indexes over the finished shards, and the manifest last (a folder with a manifest is complete)."""
        counts = [int(s["n"]) for s in state["shards"]]
        n = sum(counts)
        (self.folder / store.MANIFEST_FILE).unlink(missing_ok=True)
        kinds = []
        if self.embedder is not None:
            self._assemble_dense(counts, int(state["dimension"]))
            kinds.append("dense")
        if self.sparse is not None:
            passages = PassageStore(self.folder / store.PASSAGES_DIR, shards=len(counts))
            self.sparse.build(passages, (p.contents for p in passages))
            self.sparse.save(self.folder / BM25_DIR)
            kinds.append("bm25")
        store.write_manifest(self.folder / store.MANIFEST_FILE, store.manifest(
            self.settings["embedder"], self.spec.to_dict() if self.embedder is not None else None,
            state.get("dimension"), n, num_shards=len(counts), on_disk=self.on_disk, corpus=self.settings["corpus"],
            shard_size=self.shard_size, retrievers=kinds))
        return n

    def _assemble_dense(self, counts: list[int], d: int) -> None:
        n = sum(counts)
        index = empty_index(self.spec, d, n)
        train(index, sample_shards([self.vectors(i) for i in range(len(counts))], self.spec.train_size, self.seed),
              self.spec)
        if self.on_disk:
            index = self._merge_on_disk(index, counts)
        else:
            add_shards(index, [self.vectors(number) for number in range(len(counts))])
        configure(index, self.spec)
        import_faiss().write_index(index, str(self.folder / store.INDEX_FILE))

    def _merge_on_disk(self, trained: Any, counts: list[int]) -> Any:
        """Each shard added to a copy of the trained index, written as a block; the blocks' inverted lists merged
        into one file on disk (`lists.ivfdata`), which the index reads memory-mapped."""
        from faiss.contrib.ondisk import merge_ondisk

        faiss = import_faiss()
        if faiss.try_extract_index_ivf(trained) is None:
            raise ValueError(f"retriever.on_disk needs an inverted-file index (ivf, or a factory string with IVF); "
                             f"got {self.spec.factory or self.spec.index_type}")
        blocks = self.folder / BLOCKS_DIR
        shutil.rmtree(blocks, ignore_errors=True)
        blocks.mkdir()
        names, start = [], 0
        for number, count in enumerate(counts):
            block = faiss.clone_index(trained)
            block.add_with_ids(np.ascontiguousarray(self.vectors(number)), np.arange(start, start + count))
            names.append(str(blocks / f"block-{number:05d}.index"))
            faiss.write_index(block, names[-1])
            start += count
        data = self.folder / IVF_DATA
        data.unlink(missing_ok=True)
        # NOTE: merge_ondisk records the data file's path; the index is read back with IO_FLAG_ONDISK_SAME_DIR
        merge_ondisk(trained, names, str(data))
        shutil.rmtree(blocks)
        return trained


def _chunks(stream: Iterator[Passage], size: int) -> Iterator[list[Passage]]:
    while chunk := list(islice(stream, size)):
        yield chunk
