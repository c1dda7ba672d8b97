"""FAISS index construction, search parameters and CPU/GPU placement for the dense retriever."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "ivf", "hnsw")
METRICS = ("ip", "l2")
MIN_POINTS_PER_CENTROID = 39  # NOTE: FAISS k-means warns below this many training points per list


class FaissMissing(ImportError):
    """FAISS is not installed (an extra of this package); the message says how to install it."""


FAISS_MISSING = ("dense retrieval needs FAISS, and orthrus-rag installs it only as an extra: pip install "
                 "'orthrus-rag[cpu]' (faiss-cpu), or 'orthrus-rag[gpu]' (faiss-gpu-cu12) on a CUDA 12 machine; one "
                 "of the two, never both (they install the same faiss module)")


def import_faiss() -> Any:
    try:
        import faiss
    except ImportError as exc:
        raise FaissMissing(FAISS_MISSING) from exc
    return faiss


@dataclass
class IndexSpec:
    """Which FAISS index to build, and how to search it."""

    index_type: str = "flat"
    metric: str = "ip"
    nlist: int = 1024  # ivf: inverted lists (clipped to what the corpus allows)
    nprobe: int = 16  # ivf: lists visited per query
    hnsw_m: int = 32  # hnsw: neighbours per node
    ef_construction: int = 40  # hnsw: candidate list while building
    ef_search: int = 64  # hnsw: candidate list while searching (raised to k when k is larger)

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"unknown index_type {self.index_type!r}; expected one of {', '.join(INDEX_TYPES)}")
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; expected one of {', '.join(METRICS)}")
        for name in ("nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_index(vectors: np.ndarray, spec: IndexSpec) -> Any:
    """A CPU index holding `vectors` (float32 [n, d]); trains IVF on them. May clip `spec.nlist` in place."""
    faiss = import_faiss()
    n, d = vectors.shape
    metric = faiss.METRIC_INNER_PRODUCT if spec.metric == "ip" else faiss.METRIC_L2
    if spec.index_type == "flat":
        index = faiss.IndexFlatIP(d) if spec.metric == "ip" else faiss.IndexFlatL2(d)
    elif spec.index_type == "ivf":
        allowed = max(1, n // MIN_POINTS_PER_CENTROID)
        if spec.nlist > allowed:
            logger.warning("ivf: nlist %d is too many for %d passages; using %d (>= %d points per list)",
                           spec.nlist, n, allowed, MIN_POINTS_PER_CENTROID)
            spec.nlist = allowed
        quantizer = faiss.IndexFlatIP(d) if spec.metric == "ip" else faiss.IndexFlatL2(d)
        index = faiss.IndexIVFFlat(quantizer, d, spec.nlist, metric)
        index.train(vectors)
    else:
        index = faiss.IndexHNSWFlat(d, spec.hnsw_m, metric)
        index.hnsw.efConstruction = spec.ef_construction
    index.add(vectors)
    configure(index, spec)
    return index


def configure(index: Any, spec: IndexSpec) -> None:
    """Set the search-time knobs stored on a CPU index (before any GPU copy, which inherits them)."""
    if spec.index_type == "ivf":
        index.nprobe = min(spec.nprobe, spec.nlist)
    elif spec.index_type == "hnsw":
        index.hnsw.efSearch = spec.ef_search


def search_params(spec: IndexSpec, k: int) -> Any | None:
    """Per-call parameters: HNSW needs efSearch >= k. None keeps the index's own settings."""
    if spec.index_type == "hnsw" and k > spec.ef_search:
        return import_faiss().SearchParametersHNSW(efSearch=k)
    return None


def wants_gpu(use_gpu: bool | None) -> bool:
    """GPU when FAISS sees one and the caller did not say no; `use_gpu=True` without one is an error."""
    if use_gpu is False:
        return False
    faiss = import_faiss()
    num_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if use_gpu and num_gpus == 0:
        raise ValueError("use_gpu=True but the installed FAISS sees no GPU (install faiss-gpu, or use_gpu=None)")
    return num_gpus > 0


def to_device(index: Any, spec: IndexSpec, use_gpu: bool | None) -> tuple[Any, bool]:
    """Move a CPU index to all GPUs when wanted; returns (index, on_gpu)."""
    if not wants_gpu(use_gpu):
        return index, False
    if spec.index_type == "hnsw":  # NOTE: FAISS has no GPU HNSW
        logger.info("hnsw index stays on the CPU (FAISS has no GPU HNSW)")
        return index, False
    faiss = import_faiss()
    logger.info("moving the %s index to %d GPU(s)", spec.index_type, faiss.get_num_gpus())
    return faiss.index_cpu_to_all_gpus(index), True


def to_cpu(index: Any, on_gpu: bool) -> Any:
    return import_faiss().index_gpu_to_cpu(index) if on_gpu else index
