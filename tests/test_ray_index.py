"""`orthrus-rag index deploy=ray`: a local Ray with 2 engine actors builds the same index as one process (the same
shards and passages, vectors equal within fp32's tolerance, the same top-5), from JSONL and from parquet, and a
killed Ray build resumes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orthrus_rag.entrypoints import commands as app
from tests.test_app_config import _compose

pytestmark = pytest.mark.slow  # starts Ray and two engines


@pytest.fixture(scope="module", autouse=True)
def _own_ray(one_ray_at_a_time):
    """The module's Ray is the only one on the machine while it runs (tests/conftest.py)."""


TOPICS = ["river", "mountain", "composer", "planet", "novel", "painter", "city", "bridge", "island", "desert"]
COMMON = ["corpus=jsonl", "retriever.shard_size=16", "model.dtype=float32",
          "+model.kernel_overrides.linears=dense", "progress=false", "seed=0"]


def _corpus(path: Path, n: int = 70) -> Path:
    rows = [{"id": f"p{i}", "contents": f"Title {i}\nPassage {i} is about the {TOPICS[i % 10]} number {i // 10}."}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _vectors(index: Path) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted((index / "vectors").glob("shard-*.npy"))])


def _state(index: Path) -> list:
    return json.loads((index / "build.json").read_text())["shards"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray_index")
    corpus = _corpus(tmp / "corpus.jsonl")
    local = app.index(_compose(*COMMON, f"corpus.path={corpus}", f"run_dir={tmp / 'local'}"))
    ray = app.index(_compose(*COMMON, f"corpus.path={corpus}", f"run_dir={tmp / 'ray'}", "deploy=ray",
                             "deploy.replicas=2", "deploy.num_threads=1", "deploy.ray_num_cpus=2"))
    return corpus, local, ray


@pytest.fixture(scope="module")
def local_ray(builds):
    """One local Ray for the module's later builds, which join it (and leave it up) instead of each starting and
    stopping its own: `builds` above runs first and covers a build that starts its own Ray and stops it."""
    import ray

    from orthrus_rag.entrypoints.ray.app import _init_ray

    assert not ray.is_initialized()  # the build that started one stopped it
    _init_ray(None, 3)  # as a build of 2 one-CPU actors starts it: one CPU more than the actors hold
    yield
    ray.shutdown()


def test_two_ray_actors_build_the_index_one_process_builds(builds) -> None:
    corpus, local, ray = builds
    assert _state(ray) == _state(local) and len(_state(ray)) == 5  # 70 passages in shards of 16
    np.testing.assert_allclose(_vectors(ray), _vectors(local), atol=1e-5, rtol=0)
    assert json.loads((ray / "manifest.json").read_text())["embedder"] == \
        json.loads((local / "manifest.json").read_text())["embedder"]

    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.engine import Engine
    from orthrus_rag.config.build import engine_config_from
    from orthrus_rag.entrypoints.embedding import build_embedder
    from orthrus_rag.retrievers import DenseRetriever

    cfg = _compose(*COMMON, f"corpus.path={corpus}")
    client = AsyncEngine(Engine.from_config(engine_config_from(cfg)))
    try:
        embedder = build_embedder(cfg, client)
        a, b = DenseRetriever.load(local, embedder), DenseRetriever.load(ray, embedder)
        for topic in TOPICS:
            query = f"Which passage is about the {topic}?"
            assert [p.id for p, _ in a.search(query, 5)] == [p.id for p, _ in b.search(query, 5)]
    finally:
        import asyncio

        asyncio.run(client.aclose())


def test_a_ray_build_resumes_from_its_last_finished_shard(builds, local_ray, tmp_path: Path) -> None:
    corpus, local, _ = builds
    run = tmp_path / "resumed"
    # a build that finished 2 of 5 shards: its folder as a killed build leaves it
    index = run / "index"
    (index / "vectors").mkdir(parents=True)
    (index / "passages").mkdir()
    for name in ("shard-00000", "shard-00001"):
        (index / "vectors" / f"{name}.npy").write_bytes((local / "vectors" / f"{name}.npy").read_bytes())
        (index / "passages" / f"{name}.arrow").write_bytes((local / "passages" / f"{name}.arrow").read_bytes())
    state = json.loads((local / "build.json").read_text())
    state["shards"] = state["shards"][:2]
    (index / "build.json").write_text(json.dumps(state))
    args = [*COMMON, f"corpus.path={corpus}", f"run_dir={run}", "deploy=ray", "deploy.replicas=2",
            "deploy.num_threads=1", "deploy.ray_num_cpus=2"]
    (run / "config.yaml").write_text((local.parent / "config.yaml").read_text())
    out = app.index(_compose(*args))
    assert _state(out) == _state(local)
    np.testing.assert_allclose(_vectors(out), _vectors(local), atol=1e-5, rtol=0)


def test_a_ray_build_reads_a_parquet_corpus_as_one_process_reads_the_jsonl(builds, local_ray,
                                                                          tmp_path: Path) -> None:
    """`corpus=hf corpus.hub_id=parquet` enters through Ray Data's `read_parquet`: the same shards and vectors."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus, local, _ = builds
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    parquet = tmp_path / "corpus.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=25)  # NOTE: several blocks, kept in order
    args = [*COMMON[1:], "corpus=hf", "corpus.hub_id=parquet", f"corpus.data_files=[{parquet}]",
            f"run_dir={tmp_path / 'run'}", "deploy=ray", "deploy.replicas=1", "deploy.num_threads=1",
            "deploy.ray_num_cpus=2"]
    out = app.index(_compose(*args))
    assert _state(out) == _state(local)
    np.testing.assert_allclose(_vectors(out), _vectors(local), atol=1e-5, rtol=0)


def test_a_ray_build_needs_each_records_id(local_ray, tmp_path: Path) -> None:
    corpus = tmp_path / "noid.jsonl"
    corpus.write_text(json.dumps({"contents": "Title\nno id here"}) + "\n")
    with pytest.raises(Exception, match="needs every record's id"):
        app.index(_compose(*COMMON, f"corpus.path={corpus}", f"run_dir={tmp_path / 'r'}", "deploy=ray",
                           "deploy.replicas=1", "deploy.num_threads=1", "deploy.ray_num_cpus=2"))
