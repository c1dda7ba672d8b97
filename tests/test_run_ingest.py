"""`orthrus-rag run ingest.path=F`: documents streamed into a running run's index while it answers (the real small
models), kept in the index folder; and the ingest loop itself on a fake embedder (batches, ids present already,
repeated ids)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from orthrus_rag.data.types import Passage
from orthrus_rag.entrypoints import commands as app
from orthrus_rag.entrypoints.ingest import IngestReport, ingest
from orthrus_rag.retrievers import DenseRetriever, LiveIndex

from tests.test_app_config import _compose
from tests.test_retriever import HashEmbedder, make_corpus

ARGS = ["experiment=smoke", "dataset.num_questions=3", "pipeline.max_tokens=8", "retriever.k=2", "progress=false"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_ingest_loop_adds_in_batches_and_skips_what_is_present() -> None:
    base = DenseRetriever(HashEmbedder())
    base.build(make_corpus(10))
    live = LiveIndex.in_memory(base)
    docs = [Passage(f"d{i}", "T", f"delta{i} word") for i in range(7)]
    stream = iter([Passage("3", "T", "a saved id"), *docs[:4], Passage("d1", "T", "a repeat"), *docs[4:]])
    report = asyncio.run(ingest(live, stream, 3, False, IngestReport()))
    assert (report.added, report.skipped, report.finished) == (7, 2, True)
    assert len(live) == 17 and live.get("d1").text == "delta1 word" and live.get("3").text != "a saved id"
    again = asyncio.run(ingest(live, iter(docs), 3, False, IngestReport()))  # a resumed run: all present
    assert (again.added, again.skipped) == (0, 7)


@pytest.mark.slow  # loads the real models
def test_a_run_ingests_while_it_answers_and_keeps_the_documents(tmp_path: Path) -> None:
    rows = [{"id": f"doc-{i}", "title": f"Ingested {i}", "text": f"Ingested passage number {i} about topic{i}."}
            for i in range(40)]
    rows.append({"id": "marker", "title": "Quokka", "text": "The quokka is a small wallaby found on Rottnest Island."})
    docs = _jsonl(tmp_path / "docs.jsonl", rows)
    run = tmp_path / "run"
    summary = app.run(_compose(*ARGS, f"run_dir={run}", f"ingest.path={docs}", "ingest.batch_size=16"))
    assert summary["ingest"]["added"] == 41 and summary["ingest"]["finished"]
    assert summary["num_questions"] == 3 and summary["num_failed"] == 0
    assert json.loads((run / "summary.json").read_text())["ingest"]["added"] == 41

    # the run's index folder holds them for the next process
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.engine import Engine
    from orthrus_rag.config.build import engine_config_from
    from orthrus_rag.entrypoints.embedding import build_embedder

    cfg = _compose(*ARGS, f"run_dir={run}")
    client = AsyncEngine(Engine.from_config(engine_config_from(cfg)))
    try:
        index = LiveIndex.open(run / "index", build_embedder(cfg, client))
        assert index.search("Where do quokkas live?", 1)[0][0].id == "marker"
        assert index.get("doc-39").title == "Ingested 39"
    finally:
        asyncio.run(client.aclose())


def test_ingest_settings_are_checked_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ingest.path: no such file"):
        app.run(_compose(*ARGS, f"run_dir={tmp_path / 'a'}", f"ingest.path={tmp_path / 'missing.jsonl'}"))
    docs = _jsonl(tmp_path / "d.jsonl", [{"id": "x", "text": "y"}])
    with pytest.raises(ValueError, match="retriever.kind=bm25 cannot take adds"):
        app.run(_compose(*ARGS, f"run_dir={tmp_path / 'b'}", f"ingest.path={docs}", "retriever=bm25"))
