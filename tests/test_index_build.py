"""The sharded, resumable index builder (retrievers/index_build.py) and the passage store it writes, with the
deterministic hash embedder of test_retriever.py (no model): resume equality after an error and after a real
SIGKILL, refusals, factory strings, on-disk IVF merging, search-time settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import DenseRetriever
from orthrus_rag.retrievers.faiss_index import IndexSpec
from orthrus_rag.retrievers.index_build import IndexBuilder
from orthrus_rag.retrievers.passage_store import PassageStore, shard_name, write_shard

from tests.test_retriever import HashEmbedder, make_corpus

CORPUS = make_corpus(1000)
QUERIES = [f"alpha{i} beta{i} gamma{i}" for i in range(0, 1000, 37)] + ["common1 common2", "beta500 common7"]


def top5(retriever: DenseRetriever) -> list[list[str]]:
    return [[p.id for p, _ in hits] for hits in retriever.batch_search(QUERIES, k=5)]


def all_vectors(folder: Path) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted((folder / "vectors").glob("shard-*.npy"))])


class FailingEmbedder(HashEmbedder):
    """Raises on its `fail_at`-th call (a build killed part-way)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("killed")
        return super().embed_documents(texts)


def build(folder: Path, embedder: object = None, spec: IndexSpec | None = None, corpus: list | None = None,
          shard_size: int = 128, **kw: object) -> tuple[DenseRetriever, object]:
    embedder = embedder or HashEmbedder()
    builder = IndexBuilder(folder, embedder, spec or IndexSpec(), {"kind": "test", "n": 1000},
                           shard_size=shard_size, **kw)
    report = builder.build(corpus if corpus is not None else CORPUS, total=len(CORPUS))
    return DenseRetriever.load(folder, embedder), report


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DenseRetriever]:
    folder = tmp_path_factory.mktemp("whole")
    return folder, build(folder)[0]


def test_a_sharded_build_equals_the_in_memory_one(whole: tuple[Path, DenseRetriever]) -> None:
    folder, retriever = whole
    memory = DenseRetriever(HashEmbedder())
    memory.build(CORPUS)
    assert top5(retriever) == top5(memory)
    assert len(retriever) == 1000 and isinstance(retriever.passages, PassageStore)
    assert list(retriever.passages) == CORPUS
    state = json.loads((folder / "build.json").read_text())
    assert [s["n"] for s in state["shards"]] == [128] * 7 + [104]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["num_shards"] == 8 and manifest["corpus"] == {"kind": "test", "n": 1000}
    loaded = DenseRetriever.load(folder, HashEmbedder())
    assert top5(loaded) == top5(memory)


def test_an_interrupted_build_resumes_to_the_same_index(tmp_path: Path, whole: tuple[Path, DenseRetriever]) -> None:
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, FailingEmbedder(fail_at=4))
    assert len(json.loads((tmp_path / "build.json").read_text())["shards"]) == 3
    assert not (tmp_path / "manifest.json").exists()
    retriever, report = build(tmp_path)
    assert report.resumed_shards == 3 and report.resumed_passages == 384 and report.num_shards == 8
    assert np.array_equal(all_vectors(tmp_path), all_vectors(whole[0]))
    assert top5(retriever) == top5(whole[1])


KILLED = """
import sys, time
sys.path.insert(0, {root!r})
from tests.test_index_build import build, HashEmbedder
from pathlib import Path

class Slow(HashEmbedder):
    def embed_documents(self, texts):
        time.sleep(0.3)
        return super().embed_documents(texts)

build(Path({folder!r}), Slow())
"""


def test_a_sigkilled_build_resumes_to_the_same_index(tmp_path: Path, whole: tuple[Path, DenseRetriever]) -> None:
    folder = tmp_path / "idx"
    script = KILLED.format(root=str(Path(__file__).parent.parent), folder=str(folder))
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    state = folder / "build.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_file() and len(json.loads(state.read_text())["shards"]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = len(json.loads(state.read_text())["shards"])
    assert 3 <= done < 8, "the kill landed mid-build"
    retriever, report = build(folder)
    assert report.resumed_shards == done
    assert np.array_equal(all_vectors(folder), all_vectors(whole[0]))
    assert top5(retriever) == top5(whole[1]) and list(retriever.passages) == CORPUS


def test_a_folder_of_another_build_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, FailingEmbedder(fail_at=2))
    with pytest.raises(ValueError, match=r"another corpus or embedder; differing:\n  embedder:"):
        build(tmp_path, HashEmbedder(name="other"))
    with pytest.raises(ValueError, match="shard_size"):
        build(tmp_path, shard_size=64)
    with pytest.raises(ValueError, match="fewer than the 128"):
        build(tmp_path, corpus=CORPUS[:100])


def test_an_empty_corpus_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="corpus is empty"):
        build(tmp_path, corpus=[])


def test_a_factory_string_trained_on_a_sample(tmp_path: Path, whole: tuple[Path, DenseRetriever],
                                              caplog: pytest.LogCaptureFixture) -> None:
    spec = IndexSpec("factory", factory="IVF8,SQfp16", train_size=600, nprobe=8)
    with caplog.at_level("INFO"):
        retriever, _ = build(tmp_path, spec=spec)
    assert "training the IVF8,SQfp16 index on 600 vectors" in caplog.text
    import faiss

    ivf = faiss.extract_index_ivf(retriever.index)
    assert ivf.nlist == 8 and ivf.nprobe == 8 and retriever.index.ntotal == 1000
    exact = top5(whole[1])
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top5(retriever), exact)])
    assert recall >= 0.75  # NOTE: every list probed: exact, but the filler words make ties, broken otherwise
    best = [hits[0][1] for hits in retriever.batch_search(QUERIES, k=1)]
    assert np.allclose(best, [hits[0][1] for hits in whole[1].batch_search(QUERIES, k=1)], atol=2e-3)
    loaded = DenseRetriever.load(tmp_path, HashEmbedder(), search={"nprobe": 2})
    assert faiss.extract_index_ivf(loaded.index).nprobe == 2
    pq, _ = build(tmp_path / "pq", spec=IndexSpec("factory", factory="IVF4,PQ8x4", train_size=300))
    assert pq.index.ntotal == 1000 and len(pq.search("alpha3 beta3", k=5)) == 5


def test_a_bad_factory_string_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="index_factory cannot build 'IVF8,Nonsense'"):
        build(tmp_path, spec=IndexSpec("factory", factory="IVF8,Nonsense"))
    with pytest.raises(ValueError, match="goes with index_type=factory"):
        IndexSpec("flat", factory="IVF8,Flat")


def test_ivf_merged_on_disk_equals_the_in_memory_ivf(tmp_path: Path) -> None:
    spec = IndexSpec("ivf", nlist=16, nprobe=4)
    memory, _ = build(tmp_path / "mem", spec=IndexSpec("ivf", nlist=16, nprobe=4))
    disk, _ = build(tmp_path / "disk", spec=spec, on_disk=True)
    assert (tmp_path / "disk" / "lists.ivfdata").is_file() and not (tmp_path / "disk" / "ivf_blocks").exists()
    assert top5(disk) == top5(memory)
    moved = tmp_path / "moved"
    (tmp_path / "disk").rename(moved)  # NOTE: the lists are found beside the index, wherever it is
    assert top5(DenseRetriever.load(moved, HashEmbedder())) == top5(memory)
    with pytest.raises(ValueError, match="on_disk needs an inverted-file index"):
        build(tmp_path / "flat", on_disk=True)


def test_the_passage_store_reads_by_position(tmp_path: Path) -> None:
    write_shard(tmp_path / shard_name(0), CORPUS[:3])
    write_shard(tmp_path / shard_name(1), [Passage("x", "T", "ünïcode " * 50)])
    store = PassageStore(tmp_path)
    assert len(store) == 4 and store[1] == CORPUS[1] and store[-1].text.startswith("ünïcode")
    assert store[2:4] == [CORPUS[2], store[3]] and list(store)[:3] == CORPUS[:3]
    assert len(PassageStore(tmp_path, shards=1)) == 3
    with pytest.raises(IndexError, match="passage 4 is out of range"):
        store[4]
    (tmp_path / shard_name(2)).write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a passage shard"):
        PassageStore(tmp_path)


def test_a_graph_index_gets_every_shard_in_one_add_and_others_shard_by_shard() -> None:
    """FAISS's HNSW built from many adds found a quarter of flat's top-5 at 200k (docs/benchmarks/search.md)."""
    import faiss

    from orthrus_rag.retrievers.faiss_index import add_shards

    def counting(base):  # noqa: ANN001, ANN202 (a faiss index class)
        class Counting(base):
            adds = 0

            def add(self, x):  # noqa: ANN001, ANN202
                type(self).adds += 1
                return super().add(x)

        return Counting

    shards = [np.random.default_rng(i).standard_normal((50, 8)).astype(np.float32) for i in range(3)]
    graph = counting(faiss.IndexHNSWFlat)(8, 4)
    add_shards(graph, shards)
    flat = counting(faiss.IndexFlatIP)(8)
    add_shards(flat, shards)
    assert (type(graph).adds, graph.ntotal) == (1, 150)
    assert (type(flat).adds, flat.ntotal) == (3, 150)
    _, ids = graph.search(shards[2][:1], 1)
    assert ids[0, 0] == 100  # the shards keep their order
