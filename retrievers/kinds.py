"""The retriever kinds (`retriever.kind`: dense, bm25, hybrid) and the one way a saved index folder is opened as
one of them. Every pipeline and the LangChain retriever search any kind through the same surface (`search`,
`batch_search`, `asearch`: (Passage, score) hits, best first)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import store
from orthrus_rag.retrievers.dense import DenseRetriever
from orthrus_rag.retrievers.embedder import Embedder
from orthrus_rag.retrievers.hybrid import HybridRetriever, check_fusion
from orthrus_rag.retrievers.sparse import BM25_DIR, BM25Retriever

RETRIEVER_KINDS = ("dense", "bm25", "hybrid")
Retriever = DenseRetriever | BM25Retriever | HybridRetriever  # what a pipeline searches


@dataclass(frozen=True)
class SparseSettings:
    """BM25's parameters and how a hybrid fuses (retrievers/sparse.py, hybrid.py)."""

    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"
    dense_weight: float = 1.0
    bm25_weight: float = 1.0
    rrf_k: float = 60.0
    candidates: int = 20

    def __post_init__(self) -> None:
        BM25Retriever(self.k1, self.b, self.method)  # NOTE: its own checks, before anything is indexed
        check_fusion(self.dense_weight, self.bm25_weight, self.rrf_k, self.candidates)

    def bm25(self) -> BM25Retriever:
        return BM25Retriever(self.k1, self.b, self.method)

    def hybrid(self, dense: DenseRetriever, sparse: BM25Retriever) -> HybridRetriever:
        return HybridRetriever(dense, sparse, self.dense_weight, self.bm25_weight, self.rrf_k, self.candidates)


def check_kind(kind: str) -> None:
    if kind not in RETRIEVER_KINDS:
        raise ValueError(f"unknown retriever kind {kind!r}; expected one of {', '.join(RETRIEVER_KINDS)}")


def open_retriever(folder: str | Path, kind: str, embedder: Embedder | None, settings: SparseSettings | None = None,
                   search: dict[str, int] | None = None) -> Retriever:
    """A saved index folder (`orthrus-rag index`, or a run's `index/`) as a `kind` retriever; a folder built
    without that kind is refused, naming what it holds."""
    check_kind(kind)
    folder, settings = Path(folder), settings or SparseSettings()
    manifest = store.read_manifest(folder / store.MANIFEST_FILE) if (folder / store.MANIFEST_FILE).is_file() else {}
    held = manifest.get("retrievers", ["dense"])
    missing = [k for k in (("dense", "bm25") if kind == "hybrid" else (kind,)) if k not in held]
    if manifest and missing:
        raise ValueError(f"the index at {folder} holds {' and '.join(held)} only; retriever.kind={kind} needs "
                         f"{' and '.join(missing)}: build it with `orthrus-rag index retriever.kind={kind}`")
    dense = None
    if kind != "bm25":
        if embedder is None:
            raise ValueError(f"retriever.kind={kind} needs an embedder for its queries")
        dense = DenseRetriever.load(folder, embedder, search=search)
    if kind == "dense":
        return dense  # type: ignore[return-value]
    store.check_folder(folder, dense=kind != "bm25")
    passages: Sequence[Passage] = dense.passages if dense is not None else store.open_passages(folder, manifest)
    sparse = BM25Retriever.load(folder / BM25_DIR, passages)
    return sparse if dense is None else settings.hybrid(dense, sparse)


def build_in_memory(passages: list[Passage], kind: str, dense: DenseRetriever | None,
                    settings: SparseSettings | None = None) -> Retriever:
    """A small corpus (the dataset's own paragraphs) indexed in memory: `dense` built already where the kind
    needs it."""
    check_kind(kind)
    settings = settings or SparseSettings()
    if kind == "dense":
        assert dense is not None
        return dense
    sparse = settings.bm25()
    sparse.build(passages)
    return sparse if kind == "bm25" else settings.hybrid(dense, sparse)  # type: ignore[arg-type]
