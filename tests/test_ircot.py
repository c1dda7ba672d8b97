"""IRCoT's loop (pipelines/ircot.py) with a scripted engine and retriever: what it retrieves with, how passages
gather, when it stops; and one run of it on the real small models through the CLI's `run`."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthrus_rag.data.types import Passage, QAExample
from orthrus_rag.pipelines import IRCoT
from orthrus_rag.pipelines.chain import first_sentence

QUESTION = "Who is the mother of the director of Lake Film?"


class ScriptedEngine:
    """Answers the i-th generation with `lines[i]` and keeps each prompt and its parameters."""

    def __init__(self, lines: list[str]) -> None:
        self.lines, self.prompts, self.params = lines, [], []

    async def generate(self, prompt, params=None):
        self.prompts.append(prompt)
        self.params.append(params)
        await asyncio.sleep(0)
        return SimpleNamespace(text=self.lines[len(self.prompts) - 1])


class TitledRetriever:
    """Passages named after the query's first word and their rank: "director-0", "director-1", ..."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    async def asearch(self, query: str, k: int = 5):
        self.queries.append(query)
        word = query.split()[0].lower().strip(".,")
        return [(Passage(f"{word}-{i}", f"{word}-{i}", f"text about {word} {i}"), 1.0 - i / 10) for i in range(k)]


def _example() -> QAExample:
    return QAExample("q1", QUESTION, ["Ilse Maralt"], supporting_titles=["director-0", "mother-1"])


def test_each_sentence_retrieves_until_the_answer_phrase():
    engine = ScriptedEngine([" Director of Lake Film is Edda. She was born in 1920.\nMore",
                             "Mother of Edda is Ilse Maralt.",
                             "So the answer is Ilse Maralt.", "never asked"])
    retriever = TitledRetriever()
    rec = asyncio.run(IRCoT(engine, retriever, k=2, max_steps=5).answer(_example()))
    # the question first, then each sentence but the last (the answer ends the chain)
    assert retriever.queries == [QUESTION, "Director of Lake Film is Edda.", "Mother of Edda is Ilse Maralt."]
    assert [it.generation for it in rec.iterations] == ["Director of Lake Film is Edda.",
                                                        "Mother of Edda is Ilse Maralt.", "So the answer is Ilse Maralt."]
    assert [it.query for it in rec.iterations] == retriever.queries
    assert rec.prediction == "Ilse Maralt" and rec.em == 1.0 and rec.iterations[-1].answer_found
    # the chain so far continues the answer, and passages gather (who-, director-, mother-: 2 each)
    assert engine.prompts[2].endswith("Answer: Director of Lake Film is Edda. Mother of Edda is Ilse Maralt.")
    assert all(f"{w}-{i}:" in engine.prompts[2] for w in ("who", "director", "mother") for i in (0, 1))
    assert "director-0:" not in engine.prompts[0]
    # steps generate one sentence under a small budget, stopped at a new line
    assert engine.params[0].max_tokens == 48 and "\n" in engine.params[0].stop
    assert rec.recall["recall@2"] == 0.0 and rec.recall["recall@used"] == 1.0  # found by the later retrievals


def test_the_step_limit_ends_with_a_free_answer_and_passages_are_capped():
    engine = ScriptedEngine(["Alpha is one.", "Beta is two.", "Gamma is three. So the answer is Gamma."])
    retriever = TitledRetriever()
    rec = asyncio.run(IRCoT(engine, retriever, k=3, max_steps=3, max_passages=5).answer(_example()))
    assert len(rec.iterations) == 3 and len(retriever.queries) == 3
    # the last step is not cut to a sentence: it writes on to the answer, with the run's own budget
    assert rec.iterations[-1].generation == "Gamma is three. So the answer is Gamma." and rec.prediction == "Gamma"
    assert engine.params[-1].max_tokens == 96
    # each step's record keeps the hits of its own retrieval (step 2: the first sentence's)
    assert [r["id"] for r in rec.iterations[1].retrieved] == ["alpha-0", "alpha-1", "alpha-2"]
    # 3 (question) + 2 of alpha's 3 = the cap of 5; beta's are never shown
    assert "alpha-1:" in engine.prompts[2] and "alpha-2:" not in engine.prompts[2] and "beta-0:" not in engine.prompts[2]


def test_first_sentence_and_bad_settings():
    assert first_sentence(" It was 1920. Then more.") == "It was 1920."
    assert first_sentence("No full stop here") == "No full stop here"
    assert first_sentence("Version 2.5 is out! Yes.") == "Version 2.5 is out!"
    with pytest.raises(ValueError, match="needs a retriever"):
        IRCoT(ScriptedEngine([]), None)
    with pytest.raises(ValueError, match="max_steps must be at least 1"):
        IRCoT(ScriptedEngine([]), TitledRetriever(), max_steps=0)


def test_the_cli_names_a_bad_ircot_setting():
    from orthrus_rag.entrypoints.checks import validate
    from tests.test_app_config import _compose

    with pytest.raises(ValueError, match=r"pipeline.max_passages must be at least 1, got 0"):
        validate(_compose("pipeline=ircot", "pipeline.max_passages=0"))


@pytest.mark.slow
def test_ircot_runs_end_to_end_on_the_small_models(tmp_path: Path):
    """SmolLM2 reasons, MiniLM embeds each sentence's query in the same loop; every step is in records.jsonl."""
    from orthrus_rag.entrypoints import commands as app
    from tests.test_app_config import _compose

    cfg = _compose("experiment=smoke", "pipeline=ircot", "dataset.num_questions=3", "pipeline.max_steps=3",
                   "pipeline.max_tokens=24", "pipeline.step_tokens=16", "retriever.k=2", f"run_dir={tmp_path}",
                   "progress=false")
    summary = app.run(cfg)
    assert summary["num_questions"] == 3 and summary["num_failed"] == 0
    assert summary["engine"]["num_mixed_steps"] > 0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    for r in records:
        steps = r["iterations"]
        assert 1 <= len(steps) <= 3 and steps[0]["query"] == r["question"]
        assert all(s["query"] == prev["generation"] for prev, s in itertools.pairwise(steps))
        assert r["prediction"] == steps[-1]["answer"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["config"]["pipeline"] == "ircot"
    steps = sum(len(r["iterations"]) for r in records) / 3
    retrievals = sum(sum(1 for s in r["iterations"] if s["retrieved"]) for r in records) / 3
    assert saved["steps_per_question"] == pytest.approx(steps) and saved["retrievals_per_question"] == pytest.approx(retrievals)
    assert saved["retrievals_per_question"] >= 1  # the question's own, at least
    # every generation of a question's chain counts its tokens (a step: a sentence of <= 16, the last <= 24)
    assert all(1 <= r["generated_tokens"] <= 24 * len(r["iterations"]) for r in records)
    assert saved["generated_tokens_per_question"] == pytest.approx(sum(r["generated_tokens"] for r in records) / 3)
