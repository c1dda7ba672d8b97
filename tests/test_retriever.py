"""DenseRetriever over FAISS with a deterministic fake embedder (no model), plus one check on the real engine."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import INDEX_TYPES, DenseRetriever, Embedder, EngineEmbedder

DIM = 1024


class HashEmbedder:
    """Hashed bag of words, L2-normalised: texts sharing words get high inner products."""

    def __init__(self, dim: int = DIM, name: str = "hash-bow") -> None:
        self.dim = dim
        self.identity = {"kind": "fake", "model": name, "pooling": "sum", "normalize": True, "dimension": dim,
                         "query_instruction": None}

    def _vec(self, text: str) -> np.ndarray:
        v = np.zeros(self.dim, dtype=np.float32)
        for word in re.findall(r"\w+", text.lower()):
            h = zlib.crc32(word.encode())
            v[h % self.dim] += 1.0 if (h >> 16) & 1 else -1.0
        return v / max(float(np.linalg.norm(v)), 1e-12)

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        return np.stack([self._vec(t) for t in texts])

    def embed_query(self, text: str) -> np.ndarray:
        return self._vec(text)

    async def aembed_documents(self, texts: list[str]) -> np.ndarray:
        return self.embed_documents(texts)

    async def aembed_query(self, text: str) -> np.ndarray:
        return self._vec(text)


def make_corpus(n: int = 200, seed: int = 0) -> list[Passage]:
    """Each passage: three words of its own plus five shared filler words."""
    rng = random.Random(seed)
    filler = [f"common{j}" for j in range(30)]
    return [Passage(str(i), f"Title {i}", " ".join([f"alpha{i}", f"beta{i}", f"gamma{i}"] + rng.sample(filler, 5)))
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus() -> list[Passage]:
    return make_corpus()


@pytest.fixture(scope="module")
def flat(corpus: list[Passage]) -> DenseRetriever:
    retriever = DenseRetriever(HashEmbedder())
    retriever.build(corpus, batch_size=64)
    return retriever


def test_fake_embedder_is_an_embedder() -> None:
    assert isinstance(HashEmbedder(), Embedder)


def test_flat_finds_the_passage_sharing_the_query_words(flat: DenseRetriever) -> None:
    hits = flat.search("alpha17 beta17 gamma17", k=5)
    assert [p.id for p, _ in hits][0] == "17"
    scores = [s for _, s in hits]
    assert len(hits) == 5 and scores == sorted(scores, reverse=True)
    assert scores[0] > scores[1]


@pytest.mark.parametrize("index_type", ["ivf", "hnsw"])
def test_approximate_indexes_agree_with_flat_at_top1(index_type: str, corpus: list[Passage],
                                                     flat: DenseRetriever) -> None:
    retriever = DenseRetriever(HashEmbedder(), index_type=index_type, nlist=4, nprobe=4, hnsw_m=16)
    retriever.build(corpus)
    queries = [f"alpha{i} beta{i} gamma{i}" for i in range(0, 200, 10)]
    ours = [hits[0][0].id for hits in retriever.batch_search(queries, k=3)]
    assert ours == [hits[0][0].id for hits in flat.batch_search(queries, k=3)]
    assert ours == [str(i) for i in range(0, 200, 10)]


def test_ivf_clips_nlist_to_the_corpus(corpus: list[Passage], caplog: pytest.LogCaptureFixture) -> None:
    retriever = DenseRetriever(HashEmbedder(), index_type="ivf", nlist=1024)
    with caplog.at_level("WARNING"):
        retriever.build(corpus[:100])
    assert retriever.spec.nlist == 100 // 39 and "nlist" in caplog.text
    assert retriever.search("alpha5 beta5", k=1)[0][0].id == "5"


def test_unknown_index_type_lists_the_types() -> None:
    with pytest.raises(ValueError, match="flat, ivf, hnsw, factory"):
        DenseRetriever(HashEmbedder(), index_type="annoy")
    assert INDEX_TYPES == ("flat", "ivf", "hnsw", "factory")


def test_k_checks(flat: DenseRetriever) -> None:
    for k in (0, -3):
        with pytest.raises(ValueError, match="k must be positive"):
            flat.search("alpha1", k=k)
    small = DenseRetriever(HashEmbedder())
    small.build(make_corpus(3))
    assert len(small.search("alpha1", k=50)) == 3
    with pytest.raises(RuntimeError, match="build"):
        DenseRetriever(HashEmbedder()).search("x")


@pytest.mark.parametrize("index_type", ["flat", "hnsw"])
def test_save_load_round_trip(index_type: str, corpus: list[Passage], tmp_path: Path) -> None:
    retriever = DenseRetriever(HashEmbedder(), index_type=index_type)
    retriever.build(corpus)
    retriever.save(tmp_path / "idx")
    loaded = DenseRetriever.load(tmp_path / "idx", HashEmbedder())
    queries = ["alpha3 beta3", "common1 common2 gamma42", "beta199"]
    assert loaded.batch_search(queries, k=4) == retriever.batch_search(queries, k=4)
    assert loaded.spec == retriever.spec and list(loaded.passages) == corpus
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["num_passages"] == 200 and manifest["dimension"] == DIM
    assert manifest["embedder"]["model"] == "hash-bow" and manifest["index"]["index_type"] == index_type


def test_load_refuses_another_identity(flat: DenseRetriever, tmp_path: Path) -> None:
    flat.save(tmp_path)
    with pytest.raises(ValueError, match=r"model: index has 'hash-bow', embedder has 'other'"):
        DenseRetriever.load(tmp_path, HashEmbedder(name="other"))
    with pytest.raises(ValueError, match="dimension"):
        DenseRetriever.load(tmp_path, HashEmbedder(dim=256))


def test_load_refuses_missing_or_corrupt_files(flat: DenseRetriever, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no saved index"):
        DenseRetriever.load(tmp_path / "nowhere", HashEmbedder())
    flat.save(tmp_path)
    (tmp_path / "index.faiss").write_bytes(b"not an index")
    with pytest.raises(ValueError, match="corrupt"):
        DenseRetriever.load(tmp_path, HashEmbedder())
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="corrupt"):
        DenseRetriever.load(tmp_path, HashEmbedder())
    shutil.rmtree(tmp_path / "passages")
    with pytest.raises(ValueError, match="missing passages/"):
        DenseRetriever.load(tmp_path, HashEmbedder())


def test_asearch_equals_search(flat: DenseRetriever) -> None:
    queries = ["alpha8 beta8", "gamma100 common3"]

    async def main() -> list:
        return list(await asyncio.gather(*(flat.asearch(q, k=3) for q in queries)))

    assert asyncio.run(main()) == [flat.search(q, k=3) for q in queries]


TOPICS = ["The Eiffel Tower is a wrought-iron lattice tower in Paris, France.",
          "Photosynthesis lets green plants turn sunlight, water and carbon dioxide into sugar.",
          "The Pacific Ocean is the largest and deepest ocean on Earth.",
          "Mount Everest is the highest mountain above sea level, in the Himalayas.",
          "The violin is a wooden string instrument played with a bow.",
          "Python is a programming language created by Guido van Rossum.",
          "The Great Wall of China was built to protect against invasions from the north.",
          "Honey bees live in colonies with a queen, workers and drones.",
          "The Moon orbits the Earth roughly once every 27 days.",
          "Chess is a board game for two players on a checkered board of 64 squares.",
          "Coffee is brewed from roasted beans of the Coffea plant.",
          "The Amazon rainforest covers much of the Amazon basin in South America.",
          "Penguins are flightless seabirds that live mostly in the Southern Hemisphere.",
          "The piano has 88 keys and was invented in Italy around 1700.",
          "Volcanoes erupt when molten rock called magma reaches the surface.",
          "The Sahara is the largest hot desert in the world.",
          "Basketball was invented by James Naismith in 1891.",
          "Tea originated in China and is made from the leaves of Camellia sinensis.",
          "The human heart pumps blood through the circulatory system.",
          "Saturn is the sixth planet from the Sun and has prominent rings."]


def test_engine_embedder_retrieves_with_smollm2(smol_engine) -> None:
    """The real engine: SmolLM2 mean pooling finds a passage from its own text and from a key phrase of it."""
    passages = [Passage(str(i), f"Fact {i}", t) for i, t in enumerate(TOPICS)]
    embedder = EngineEmbedder(smol_engine, batch_size=8)
    assert embedder.identity["model"] == "smollm2-135m-instruct"
    assert embedder.identity["dimension"] == 576 and embedder.identity["pooling"] == "mean"
    retriever = DenseRetriever(embedder)
    retriever.build(passages, batch_size=8)
    hits = retriever.search(passages[5].contents, k=3)
    assert hits[0][0].id == "5" and hits[0][1] == pytest.approx(1.0, abs=1e-3)
    key_phrases = ["The Eiffel Tower is a wrought-iron lattice tower", "Basketball was invented by James Naismith"]
    assert [hits[0][0].id for hits in retriever.batch_search(key_phrases, k=1)] == ["0", "16"]
    assert not smol_engine.has_unfinished()
