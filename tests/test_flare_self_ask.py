"""FLARE's trigger on the sampler's logprobs and Self-Ask's follow-ups (pipelines/flare.py, self_ask.py), with a
scripted engine and retriever; then each once on the real small models through the CLI's `run`."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthrus_rag.outputs import TokenLogprob
from orthrus_rag.pipelines import FLARE, SelfAsk
from orthrus_rag.pipelines.self_ask import follow_up_of, self_ask_prompt
from tests.test_ircot import QUESTION, ScriptedEngine, TitledRetriever, _example


class WordTokenizer:
    """One token per word: id i is `WORDS[i]`."""

    def __init__(self) -> None:
        self.words: list[str] = []

    def ids(self, text: str) -> list[int]:
        out = []
        for w in text.split():
            if w not in self.words:
                self.words.append(w)
            out.append(self.words.index(w))
        return out

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(" " + self.words[i] for i in ids)  # a word's token carries its space (byte-level BPE)


def _said(tok: WordTokenizer, text: str, unsure: set[str] = frozenset()):
    """A generation of `text` whose words in `unsure` had probability 0.1, the rest 0.9."""
    ids = tok.ids(text)
    probs = [0.1 if tok.words[i] in unsure else 0.9 for i in ids]
    return SimpleNamespace(text=text, token_ids=ids,
                           logprobs=[TokenLogprob(i, math.log(p), []) for i, p in zip(ids, probs)])


class LogprobEngine(ScriptedEngine):
    async def generate(self, prompt, params=None):
        self.prompts.append(prompt)
        self.params.append(params)
        await asyncio.sleep(0)
        return self.lines[len(self.prompts) - 1]


def test_flare_retrieves_only_for_an_unsure_sentence_with_its_confident_words():
    tok = WordTokenizer()
    engine = LogprobEngine([
        _said(tok, "Lake Film was directed by Edda. Extra words"),  # sure: kept as is, no retrieval
        _said(tok, "Edda's mother is Greta Maralt.", unsure={"Greta"}),  # unsure: retrieve, write again
        _said(tok, "Edda's mother is Ilse Maralt."),
        _said(tok, "So the answer is Ilse Maralt."),
    ])
    retriever = TitledRetriever()
    rec = asyncio.run(FLARE(engine, retriever, k=2, threshold=0.4, tokenizer=tok).answer(_example()))
    assert retriever.queries == ["Edda's mother is Maralt."]  # "Greta" (p 0.1) masked out of the query
    assert [it.generation for it in rec.iterations] == ["Lake Film was directed by Edda.",
                                                        "Edda's mother is Ilse Maralt.", "So the answer is Ilse Maralt."]
    assert [it.query for it in rec.iterations] == ["", "Edda's mother is Maralt.", ""]
    assert rec.prediction == "Ilse Maralt" and rec.em == 1.0
    # no passages until the first retrieval; the sentence written again, and the next, read edda's
    assert "edda's-0:" not in engine.prompts[1] and "edda's-0:" in engine.prompts[2] and "edda's-1:" in engine.prompts[3]
    assert engine.params[0].logprobs == 0 and engine.params[2].logprobs is None  # logprobs for look-aheads only
    assert rec.recall["recall@2"] == 0.0  # the passages it read (edda's-0, -1) are not the supporting ones


def test_flare_without_logprobs_or_a_tokenizer_fails_clearly():
    tok = WordTokenizer()
    with pytest.raises(RuntimeError, match="needs the generation model's tokenizer"):
        asyncio.run(FLARE(LogprobEngine([_said(tok, "A sentence.")]), TitledRetriever()).answer(_example()))
    engine = ScriptedEngine(["A sentence."])
    with pytest.raises(RuntimeError, match="needs each sampled token's logprob"):
        asyncio.run(FLARE(engine, TitledRetriever(), tokenizer=WordTokenizer()).answer(_example()))
    with pytest.raises(ValueError, match="threshold must be a probability"):
        FLARE(engine, TitledRetriever(), tokenizer=WordTokenizer(), threshold=1.5)


def test_self_ask_answers_each_follow_up_from_its_own_retrieval():
    engine = ScriptedEngine([
        " Yes.\nFollow up: Director of Lake Film?\n",  # stops before "Intermediate answer:"
        "Lake Film was directed by Edda Maralt.",  # the follow-up answered from its passages
        "Follow up: Mother of Edda Maralt?\n",
        "So the answer is Ilse Maralt.",  # answered with the phrase: the short form goes back
        "So the answer is Ilse Maralt.",
    ])
    retriever = TitledRetriever()
    rec = asyncio.run(SelfAsk(engine, retriever, k=2, force_follow_up=False).answer(_example()))
    assert retriever.queries == ["Director of Lake Film?", "Mother of Edda Maralt?"]
    assert [it.query for it in rec.iterations] == ["Director of Lake Film?", "Mother of Edda Maralt?", ""]
    assert rec.prediction == "Ilse Maralt" and rec.em == 1.0
    # the transcript carries each intermediate answer; each follow-up's prompt holds its own passages
    assert engine.prompts[2].endswith("Follow up: Director of Lake Film?\nIntermediate answer: "
                                      "Lake Film was directed by Edda Maralt.\n")
    assert engine.prompts[4].endswith("Intermediate answer: Ilse Maralt.\n")
    assert "director-0:" in engine.prompts[1] and "mother-0:" in engine.prompts[3]
    assert "Intermediate answer:" in engine.params[0].stop and "\n" in engine.params[1].stop
    assert rec.recall["recall@2"] == 0.5 and rec.recall["recall@used"] == 1.0  # director-0, mother-1 both read


def test_self_ask_asks_for_the_answer_after_its_follow_up_limit():
    engine = ScriptedEngine(["Yes.\nFollow up: Who?\n", "Someone.", "So the answer is Nobody."])
    rec = asyncio.run(SelfAsk(engine, TitledRetriever(), max_follow_ups=1, force_follow_up=False)
                      .answer(_example()))
    assert len(rec.iterations) == 2 and rec.prediction == "Nobody"
    assert engine.params[-1].max_tokens == 96  # the last generation has the run's own budget


def test_self_ask_forces_its_first_follow_up_by_default():
    """A model that would answer at once (SmolLM2-135M on every 2Wiki question) still asks one follow-up: its turn
    starts "Yes. Follow up:", and the question it writes there is retrieved for; off, it answers at once."""
    lines = [" Director of Lake Film?\n", "Lake Film was directed by Edda Maralt.", " So the answer is Edda Maralt."]
    engine, retriever = ScriptedEngine(lines), TitledRetriever()
    rec = asyncio.run(SelfAsk(engine, retriever, k=2).answer(_example()))
    assert engine.prompts[0].endswith("Are follow up questions needed here: Yes.\nFollow up:")
    assert retriever.queries == ["Director of Lake Film?"]
    assert engine.prompts[2].endswith("Follow up: Director of Lake Film?\nIntermediate answer: "
                                      "Lake Film was directed by Edda Maralt.\n")
    assert [it.query for it in rec.iterations] == ["Director of Lake Film?", ""]
    assert rec.prediction == "Edda Maralt"
    # the model's own turn, unforced: it answered, nothing was retrieved
    engine, retriever = ScriptedEngine([" The answer is yes.\n\nSo the answer is yes."]), TitledRetriever()
    rec = asyncio.run(SelfAsk(engine, retriever, k=2, force_follow_up=False).answer(_example()))
    assert retriever.queries == [] and len(rec.iterations) == 1 and rec.prediction == "yes"
    assert engine.prompts[0].endswith("Are follow up questions needed here:")


def test_self_ask_prompt_and_follow_up_parsing():
    prompt = self_ask_prompt(QUESTION)
    assert prompt.endswith(f"Question: {QUESTION}\nAre follow up questions needed here:")
    assert prompt.count("Follow up:") == 6 and prompt.count("So the answer is") >= 3
    assert follow_up_of(" Yes.\nFollow up: A?\nFollow up: B?") == "B?"
    assert follow_up_of("No.") is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["flare", "self_ask"])
def test_each_method_runs_end_to_end_on_the_small_models(tmp_path: Path, method):
    from orthrus_rag.entrypoints import commands as app
    from tests.test_app_config import _compose

    cfg = _compose("experiment=smoke", f"pipeline={method}", "dataset.num_questions=3", "pipeline.max_steps=3",
                   "pipeline.max_follow_ups=2", "pipeline.max_tokens=24", "pipeline.step_tokens=16",
                   "retriever.k=2", f"run_dir={tmp_path}", "progress=false")
    summary = app.run(cfg)
    assert summary["num_questions"] == 3 and summary["num_failed"] == 0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert all(1 <= len(r["iterations"]) <= 3 for r in records)
    assert all(r["prediction"] == r["iterations"][-1]["answer"] for r in records)
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["pipeline"] == method
