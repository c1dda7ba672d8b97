"""FAISS index construction, search parameters and CPU/GPU placement for the dense retriever."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "ivf", "hnsw", "factory")
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
    # factory: any faiss.index_factory string ("IVF4096,PQ64", "OPQ64,IVF65536_HNSW32,PQ64", "HNSW32,Flat")
    factory: str | None = None
    # vectors an index that trains (ivf, or a factory string with IVF / PQ / OPQ) is trained on: a seeded sample,
    # not the whole corpus (FAISS's guidance: 30 to 256 points per IVF list)
    train_size: int = 131072

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"unknown index_type {self.index_type!r}; expected one of {', '.join(INDEX_TYPES)}")
        if (self.index_type == "factory") != bool(self.factory):
            raise ValueError("retriever.factory (a faiss.index_factory string) goes with index_type=factory, and "
                             f"only with it; got index_type={self.index_type!r}, factory={self.factory!r}")
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; expected one of {', '.join(METRICS)}")
        for name in ("nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "train_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def factory_string(self, n: int) -> str:
        """The faiss.index_factory string of this spec for `n` vectors (ivf's nlist clipped to what `n` allows)."""
        if self.index_type == "factory":
            return str(self.factory)
        if self.index_type == "flat":
            return "Flat"
        if self.index_type == "hnsw":
            return f"HNSW{self.hnsw_m},Flat"
        return f"IVF{clip_nlist(self, n)},Flat"


def clip_nlist(spec: IndexSpec, n: int) -> int:
    """ivf: at most one list per MIN_POINTS_PER_CENTROID vectors (FAISS k-means warns below); clips `spec` too."""
    allowed = max(1, n // MIN_POINTS_PER_CENTROID)
    if spec.nlist > allowed:
        logger.warning("ivf: nlist %d is too many for %d passages; using %d (>= %d points per list)",
                       spec.nlist, n, allowed, MIN_POINTS_PER_CENTROID)
        spec.nlist = allowed
    return spec.nlist


def empty_index(spec: IndexSpec, d: int, n: int) -> Any:
    """An untrained, empty CPU index for `n` vectors of width `d` (any spec, by its factory string)."""
    faiss = import_faiss()
    metric = faiss.METRIC_INNER_PRODUCT if spec.metric == "ip" else faiss.METRIC_L2
    text = spec.factory_string(n)
    try:
        index = faiss.index_factory(d, text, metric)
    except RuntimeError as exc:
        raise ValueError(f"faiss.index_factory cannot build {text!r} for dimension {d}: "
                         f"{str(exc).strip().splitlines()[-1]}") from exc
    if spec.index_type == "hnsw":
        index.hnsw.efConstruction = spec.ef_construction
    return index


def train(index: Any, sample: np.ndarray, spec: IndexSpec) -> None:
    """Train `index` (when it needs it) on `sample`, at most `spec.train_size` vectors of the corpus."""
    if index.is_trained:
        return
    n, name = len(sample), spec.factory or spec.index_type
    logger.info("training the %s index on %d vectors", name, n)
    try:
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
    except RuntimeError as exc:  # NOTE: e.g. PQ64 on 100 vectors: FAISS says how many it needs
        raise ValueError(f"cannot train the {name} index on {n} vectors: "
                         f"{str(exc).strip().splitlines()[-1]}") from exc


def sample_rows(n: int, size: int, seed: int = 0) -> np.ndarray:
    """Sorted row numbers of a seeded uniform sample of min(size, n) rows out of n."""
    if size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def sample_shards(shards: Sequence[np.ndarray], size: int, seed: int = 0) -> np.ndarray:
    """`sample_rows` of the shards' rows taken as one corpus, gathered shard by shard (never all in memory)."""
    counts = [len(s) for s in shards]
    rows, starts = sample_rows(sum(counts), size, seed), np.cumsum([0, *counts])
    return np.concatenate([np.asarray(s[rows[(rows >= a) & (rows < b)] - a])
                           for s, a, b in zip(shards, starts[:-1], starts[1:])])


def build_index(vectors: np.ndarray, spec: IndexSpec) -> Any:
    """A CPU index holding `vectors` (float32 [n, d]), trained on a sample of them. May clip `spec.nlist`."""
    n, d = vectors.shape
    index = empty_index(spec, d, n)
    train(index, vectors[sample_rows(n, spec.train_size)], spec)
    index.add(vectors)
    configure(index, spec)
    return index


def add_shards(index: Any, shards: Sequence[np.ndarray]) -> None:
    """Add the shards' vectors (in order) to a trained `index`. A graph index (HNSW) gets them in one call: FAISS's
    HNSW built by 50 adds of 4,096 vectors found 0.26 of flat's top-5 at 200k where one add of the same vectors
    found 0.93 (docs/benchmarks/search.md); an index that holds every vector anyway costs the concatenation only."""
    if isinstance(import_faiss().downcast_index(index), import_faiss().IndexHNSW):
        index.add(np.ascontiguousarray(np.concatenate([np.asarray(s) for s in shards]), dtype=np.float32))
        return
    for shard in shards:
        index.add(np.ascontiguousarray(shard, dtype=np.float32))


SEARCH_KNOBS = (("nprobe", "nprobe"), ("efSearch", "ef_search"), ("quantizer_efSearch", "ef_search"))


def configure(index: Any, spec: IndexSpec) -> None:
    """Set the search-time knobs stored on a CPU index (before any GPU copy, which inherits them): nprobe of an
    inverted file, efSearch of an HNSW graph (also the one over IVF centroids), for any factory string."""
    faiss = import_faiss()
    space = faiss.ParameterSpace()
    ivf = faiss.try_extract_index_ivf(index)
    for knob, field_name in SEARCH_KNOBS:
        value = getattr(spec, field_name)
        if knob == "nprobe":
            if ivf is None:
                continue
            value = min(value, ivf.nlist)
        try:
            space.set_index_parameter(index, knob, value)
        except RuntimeError:  # NOTE: the index has no such knob (a flat index has none)
            continue


def search_params(spec: IndexSpec, k: int) -> Any | None:
    """Per-call parameters: HNSW needs efSearch >= k. None keeps the index's own settings."""
    if (spec.index_type == "hnsw" or (spec.factory or "").startswith("HNSW")) and k > spec.ef_search:
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
    try:
        return faiss.index_cpu_to_all_gpus(index), True
    except RuntimeError as exc:  # NOTE: a factory string with a part FAISS has no GPU version of (HNSW, OPQ ...)
        logger.warning("the %s index stays on the CPU: FAISS cannot copy it to a GPU (%s)",
                       spec.factory or spec.index_type, str(exc).strip().splitlines()[-1])
        return index, False


def to_cpu(index: Any, on_gpu: bool) -> Any:
    return import_faiss().index_gpu_to_cpu(index) if on_gpu else index
