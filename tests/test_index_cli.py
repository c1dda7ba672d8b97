"""`orthrus-rag index` over a corpus of its own (FlashRAG JSONL), with the real models: the index a run then
searches, a bare `resume=` of the index folder, the embedder identity refused with exit 2, and a bad corpus line
named with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orthrus_rag.data import build_corpus, make_synthetic
from orthrus_rag.entrypoints.cli import main

pytestmark = pytest.mark.slow  # loads the models

SMALL = ["progress=false", "cache.kv_cache_gib=0.05", "scheduler.max_num_batched_tokens=256"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic set's paragraphs as FlashRAG JSONL ("title\\ntext" contents), gzipped."""
    import gzip

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for p in build_corpus(make_synthetic(num_questions=8)):
            f.write(json.dumps({"id": p.id, "contents": f"{p.title}\n{p.text}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def built(corpus_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("index")
    assert main(["index", "corpus=jsonl", f"corpus.path={corpus_file}", "retriever.shard_size=16",
                 f"run_dir={run_dir}", *SMALL]) == 0
    return run_dir


def test_index_builds_the_corpus_in_shards(built: Path, corpus_file: Path) -> None:
    manifest = json.loads((built / "index" / "manifest.json").read_text())
    n = len(build_corpus(make_synthetic(num_questions=8)))
    assert manifest["num_passages"] == n and manifest["num_shards"] == -(-n // 16)
    assert manifest["corpus"]["kind"] == "jsonl" and manifest["corpus"]["path"] == str(corpus_file)
    assert manifest["embedder"]["embedding_model"] == "all-minilm-l6-v2" and manifest["dimension"] == 384
    assert (built / "config.yaml").is_file()


def test_a_run_searches_the_built_index(built: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["run", "dataset.num_questions=8", "dataset.limit=2", "pipeline.max_tokens=4",
                 f"retriever.index_dir={built / 'index'}", f"run_dir={run_dir}", *SMALL]) == 0
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["iterations"][0]["retrieved"] for r in records)
    assert not (run_dir / "index").exists()  # nothing re-embedded: the prebuilt index was searched


def test_a_bare_resume_finishes_the_same_build(built: Path, capsys: pytest.CaptureFixture) -> None:
    before = json.loads((built / "index" / "build.json").read_text())
    assert main(["index", f"resume={built}", "progress=false"]) == 0
    assert json.loads((built / "index" / "build.json").read_text()) == before  # every shard was done already
    assert "index saved to" in capsys.readouterr().out


def test_a_finished_build_resumed_as_hybrid_adds_bm25_and_embeds_nothing(built: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(built, folder)
    vectors = {p.name: p.stat().st_mtime_ns for p in (folder / "index" / "vectors").iterdir()}
    state = (folder / "index" / "build.json").read_text()
    # NOTE: the corpus comes from the folder's config.yaml; the new retriever group's shard size is given again
    assert main(["index", f"resume={folder}", "retriever=hybrid", "retriever.shard_size=16", *SMALL]) == 0
    manifest = json.loads((folder / "index" / "manifest.json").read_text())
    assert manifest["retrievers"] == ["dense", "bm25"] and manifest["num_passages"] > 0
    assert {p.name: p.stat().st_mtime_ns for p in (folder / "index" / "vectors").iterdir()} == vectors
    assert (folder / "index" / "build.json").read_text() == state  # no shard embedded again
    assert "kind: hybrid" in (folder / "config.yaml").read_text()  # the next bare resume= builds the same
    assert main(["index", f"resume={folder}", "retriever.shard_size=8", *SMALL]) == 2  # shards of 16 stay 16


def test_another_query_embedder_is_refused_with_exit_2(built: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    code = main(["run", "dataset.limit=1", "retriever.query_instruction=query: ",
                 f"retriever.index_dir={built / 'index'}",
                 f"run_dir={tmp_path / 'run'}", *SMALL])
    assert code == 2
    assert "built by another embedder" in capsys.readouterr().err


def test_a_bad_corpus_line_is_named_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "0", "contents": "T\\nfine"}\n{"id": "1", "contents": ""}\n', encoding="utf-8")
    assert main(["index", "corpus=jsonl", f"corpus.path={path}", f"run_dir={tmp_path / 'run'}", *SMALL]) == 2
    assert f"{path}:2: empty passage" in capsys.readouterr().err


def test_hybrid_index_then_bm25_and_hybrid_runs(corpus_file: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "index"
    assert main(["index", "corpus=jsonl", f"corpus.path={corpus_file}", "retriever=hybrid", f"run_dir={run_dir}",
                 *SMALL]) == 0
    manifest = json.loads((run_dir / "index" / "manifest.json").read_text())
    assert manifest["retrievers"] == ["dense", "bm25"] and (run_dir / "index" / "bm25").is_dir()
    run = tmp_path / "run"
    assert main(["run", "dataset.num_questions=8", "dataset.limit=1", "pipeline.max_tokens=4", "retriever=bm25",
                 f"retriever.index_dir={run_dir / 'index'}", f"run_dir={run}", *SMALL]) == 0
    record = json.loads((run / "records.jsonl").read_text().splitlines()[0])
    assert record["iterations"][0]["retrieved"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["retriever"] == "bm25"
    run2 = tmp_path / "run2"  # the dataset's own paragraphs, fused in memory
    assert main(["run", "dataset.num_questions=8", "dataset.limit=1", "pipeline.max_tokens=4", "retriever=hybrid",
                 f"run_dir={run2}", *SMALL]) == 0
    assert json.loads((run2 / "summary.json").read_text())["config"]["retriever"] == "hybrid"
