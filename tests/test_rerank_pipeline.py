"""`pipeline.reranker`: every method's retrievals score retriever.k candidates and keep the best top_k, recorded
per iteration; the settings are checked before anything loads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from orthrus_rag.data import make_synthetic
from orthrus_rag.pipelines.registry import make_method
from orthrus_rag.pipelines.rerank import Reranking, check_reranking
from tests.test_app_config import _compose
from tests.test_pipeline import FakeEngine, FakeRetriever


class FakeScorer(FakeEngine):
    """Scores a passage by its number: the retriever's last is the reranker's best."""

    reranker_names = ["backbone"]

    def __init__(self) -> None:
        super().__init__()
        self.scored: list[tuple[str, int]] = []

    async def score(self, query, documents, params=None):
        self.scored.append((query, len(documents)))
        assert params.priority == -1  # the chain waits on it
        return [int(d.split()[-1]) / 10 for d in documents]


@pytest.mark.parametrize("name", ["iter_retgen", "standard_rag", "ircot"])
def test_each_method_reranks_its_candidates(name):
    ex = make_synthetic(num_questions=1)[0]
    client, retriever = FakeScorer(), FakeRetriever()
    method = make_method(name, client, retriever, k=2, reranker=Reranking(client, "default", candidates=6))
    rec = asyncio.run(method.answer(ex))
    assert client.scored and all(n == 6 for _, n in client.scored)
    for it in rec.iterations:
        if it.retrieved:  # the best two of six, best first, with the reranker's scores
            assert [p["id"] for p in it.retrieved] == ["p5", "p4"]
            assert [p["score"] for p in it.retrieved] == [0.5, 0.4]


def test_a_client_without_scoring_or_rerankers_is_refused():
    with pytest.raises(ValueError, match="cannot score passages"):
        Reranking(FakeEngine(), None, 5)
    client = FakeScorer()
    client.reranker_names = []
    with pytest.raises(ValueError, match="set model.rerankers"):
        Reranking(client, None, 5)
    with pytest.raises(ValueError, match="'other' is not loaded"):
        Reranking(FakeScorer(), "other", 5)


@pytest.mark.parametrize("reranker, top_k, k, loaded, match", [
    ("default", 0, 5, ["backbone"], "top_k must be at least 1"),
    ("default", 5, 5, [], "model.rerankers is empty"),
    ("x", 5, 50, ["backbone"], r"one of model.rerankers \(backbone\) or default, got 'x'"),
    ("backbone", 10, 5, ["backbone"], r"at most retriever.k \(5\)"),
])
def test_settings_are_checked(reranker, top_k, k, loaded, match):
    with pytest.raises(ValueError, match=match):
        check_reranking(reranker, top_k, k, loaded)


def test_validate_names_the_setting():
    from orthrus_rag.entrypoints.checks import validate

    cfg = _compose("experiment=smoke", "pipeline.reranker=default")
    with pytest.raises(ValueError, match="pipeline.reranker must name a loaded reranker"):
        validate(cfg)


@pytest.mark.slow
def test_a_run_reranks_with_the_backbone(tmp_path: Path):
    """`orthrus-rag run` with the backbone's yes/no reranker: each iteration records the top_k of retriever.k, by the
    reranker's score, and the scoring requests ran in the engine's steps."""
    from orthrus_rag.entrypoints import commands as app

    cfg = _compose("experiment=smoke", "dataset.num_questions=3", "pipeline.max_tokens=16", "retriever.k=6",
                   "pipeline.top_k=2", "model.rerankers=[backbone]", "pipeline.reranker=default",
                   f"run_dir={tmp_path}", "progress=false")
    summary = app.run(cfg)
    assert summary["num_questions"] == 3 and summary["num_failed"] == 0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    for rec in records:
        for it in rec["iterations"]:
            scores = [p["score"] for p in it["retrieved"]]
            assert len(scores) == 2 and scores == sorted(scores, reverse=True)
            assert all(0.0 <= s <= 1.0 for s in scores)
    assert "rerankers:\n  - backbone" in (tmp_path / "config.yaml").read_text() or \
        "- backbone" in (tmp_path / "config.yaml").read_text()
