"""Reasoning search (pipelines/search_r1.py) with a scripted engine and retriever: a search tag stops a round, its
query retrieves, the passages are appended and the round continued (or the text re-submitted); the answer tags end
it; the search limit forces an answer. Then the method end to end on the small models, its rounds written in the
protocol by the engine's grammar, with and without continuation (the prefill it saves)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthrus_rag.data.types import QAExample
from orthrus_rag.pipelines.search_r1 import TAGS, SearchR1, between, round_grammar
from tests.test_ircot import TitledRetriever

QUESTION = "Who is the mother of the director of Lake Film?"


class ScriptedEngine:
    """Answers the i-th round with `rounds[i]`; keeps each call: ("generate", prompt, params, request_id) or
    ("continue", request_id, appended, params)."""

    def __init__(self, rounds: list[str]) -> None:
        self.rounds, self.calls = rounds, []

    def _out(self, prompt_len: int) -> SimpleNamespace:
        text = self.rounds[len(self.calls) - 1]
        return SimpleNamespace(text=text, token_ids=text.split(), prompt_token_ids=[0] * prompt_len,
                               num_cached_tokens=0)

    async def generate(self, prompt, params=None, request_id=None):
        self.calls.append(("generate", prompt, params, request_id))
        await asyncio.sleep(0)
        return self._out(len(prompt.split()))

    async def continue_(self, request_id, appended, params=None):
        self.calls.append(("continue", request_id, appended, params))
        await asyncio.sleep(0)
        return self._out(len(appended.split()))


class ResubmittingEngine(ScriptedEngine):
    continue_ = None  # a client that cannot continue (a remote server, a peer)


ROUNDS = ["<think>I need the director.</think>\n<search> director of Lake Film </search>",
          "<think>Edda directed it; now her mother.</think>\n<search>mother of Edda Maralt</search>",
          "<think>Found it.</think>\n<answer> Ilse Maralt </answer>", "never asked"]


def _example() -> QAExample:
    return QAExample("q1", QUESTION, ["Ilse Maralt"], supporting_titles=["director-0", "mother-1"])


def test_a_search_tag_retrieves_and_the_round_continues_until_the_answer() -> None:
    engine, retriever = ScriptedEngine(ROUNDS), TitledRetriever()
    rec = asyncio.run(SearchR1(engine, retriever, k=2).answer(_example()))
    assert retriever.queries == ["director of Lake Film", "mother of Edda Maralt"]
    assert rec.prediction == "Ilse Maralt" and rec.em == 1.0 and rec.iterations[-1].answer_found
    assert [it.query for it in rec.iterations] == [*retriever.queries, ""]
    assert [r["id"] for r in rec.iterations[0].retrieved] == ["director-0", "director-1"]
    # one generation, then continuations of it under the same id, each appending the passages it retrieved
    kinds = [c[0] for c in engine.calls]
    assert kinds == ["generate", "continue", "continue"]
    rid = engine.calls[0][3]
    assert rid and all(c[1] == rid for c in engine.calls[1:])
    appended = engine.calls[1][2]
    assert appended.startswith("\n\n<information>\nDoc 1 (Title: director-0)") and "Doc 2 (Title: director-1)" in appended
    assert appended.endswith("</information>\n\n") and rec.iterations[1].prompt == appended
    first = engine.calls[0][2]
    assert first.stop[-2:] == ["</search>", "</answer>"] and first.include_stop_str_in_output and first.hold_kv_s > 0
    assert first.max_tokens == 128 and first.structured_outputs is None
    # the records keep each round's tokens, and the question its totals
    assert [it.generated_tokens for it in rec.iterations] == [len(r.split()) for r in ROUNDS[:3]]
    assert rec.generated_tokens == sum(len(r.split()) for r in ROUNDS[:3])
    assert rec.prefilled_tokens == sum(it.prefilled_tokens for it in rec.iterations) > 0
    assert rec.recall["recall@2"] == 0.5 and rec.recall["recall@used"] == 1.0  # mother-1 came from the second search


def test_without_continuation_each_round_resubmits_the_whole_text() -> None:
    for engine, options in ((ResubmittingEngine(ROUNDS), {}), (ScriptedEngine(ROUNDS), {"continuation": False})):
        rec = asyncio.run(SearchR1(engine, TitledRetriever(), k=1, **options).answer(_example()))
        assert [c[0] for c in engine.calls] == ["generate"] * 3 and rec.prediction == "Ilse Maralt"
        prompt = engine.calls[0][1]
        second = engine.calls[1][1]
        assert second.startswith(prompt + ROUNDS[0] + "\n\n<information>") and engine.calls[1][3] is None
        assert engine.calls[2][1].startswith(second + ROUNDS[1] + "\n\n<information>")
        assert all(c[2].hold_kv_s == 0 for c in engine.calls)


def test_the_search_limit_makes_the_last_round_answer() -> None:
    engine, retriever = ScriptedEngine([ROUNDS[0], ROUNDS[1], "<search>more</search> no answer"]), TitledRetriever()
    method = SearchR1(engine, retriever, k=1, max_searches=2, constrain_format=True)
    rec = asyncio.run(method.answer(_example()))
    assert len(retriever.queries) == 2 and len(rec.iterations) == 3  # the third round's search is not run
    last = engine.calls[-1][3]
    assert last.hold_kv_s == 0 and "<search>" not in last.structured_outputs.regex
    assert "<search>" in engine.calls[0][2].structured_outputs.regex
    assert not rec.iterations[-1].answer_found
    # no search at all: the first round's answer
    rec = asyncio.run(SearchR1(ScriptedEngine([ROUNDS[2]]), TitledRetriever(), max_searches=0).answer(_example()))
    assert rec.prediction == "Ilse Maralt" and len(rec.iterations) == 1 and rec.iterations[0].query == ""


def test_a_round_cut_inside_its_search_searches_what_it_wrote_and_closes_the_tag() -> None:
    engine, retriever = ScriptedEngine(["<think>a</think>\n<search> director of Lake", "<think>b</think>\n<answer> Ilse Mar"]), \
        TitledRetriever()
    rec = asyncio.run(SearchR1(engine, retriever, k=1).answer(_example()))
    assert retriever.queries == ["director of Lake"] and engine.calls[1][2].startswith("</search>\n\n<information>")
    assert rec.prediction == "Ilse Mar" and not rec.iterations[-1].answer_found  # cut inside its answer
    engine = ResubmittingEngine(["<think>a</think>\n<search> director of Lake", ROUNDS[2]])
    asyncio.run(SearchR1(engine, TitledRetriever(), k=1).answer(_example()))
    assert engine.calls[1][1].endswith("<search> director of Lake</search>\n\n<information>\n"
                                       "Doc 1 (Title: director-0) text about director 0\n</information>\n\n")


def test_the_protocol_variants_parse_their_own_tags() -> None:
    r1 = SearchR1(ScriptedEngine([]), TitledRetriever(), tags="r1_searcher")
    assert r1.tags.search == ("<|begin_of_query|>", "<|end_of_query|>")
    assert r1.information([]).strip().startswith("<|begin_of_documents|>")
    research = SearchR1(ScriptedEngine([]), TitledRetriever(), tags="research")
    assert research.parse("<think>x</think><answer> \\boxed{Ilse Maralt} </answer>", QUESTION) == ("Ilse Maralt", True)
    assert research.parse("I think it is Ilse Maralt. So the answer is Ilse Maralt.", QUESTION) == ("Ilse Maralt",
                                                                                                    False)
    assert between("<search>a</search> then <search> b </search>", TAGS["search_r1"].search) == "b"
    assert between("<search>unclosed", TAGS["search_r1"].search) is None
    assert "\\boxed" in round_grammar(TAGS["research"], False).regex


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="needs a retriever"):
        SearchR1(ScriptedEngine([]), None)
    with pytest.raises(ValueError, match="unknown tags 'xml'; expected one of search_r1, r1_searcher, research"):
        SearchR1(ScriptedEngine([]), TitledRetriever(), tags="xml")
    with pytest.raises(ValueError, match="answer_format must be free"):
        SearchR1(ScriptedEngine([]), TitledRetriever(), answer_format="json")
    from orthrus_rag.entrypoints.checks import validate
    from tests.test_app_config import _compose

    with pytest.raises(ValueError, match=r"pipeline.max_searches must be at least 0, got -1"):
        validate(_compose("pipeline=search_r1", "pipeline.max_searches=-1"))


@pytest.mark.slow
def test_search_r1_runs_end_to_end_and_a_continued_round_computes_only_what_it_appends(tmp_path: Path) -> None:
    """SmolLM2 under the protocol's grammar searches (once at least), MiniLM embeds each query in the same loop. A
    continued round computes only the passages appended and the previous round's last partial block; re-submitting,
    each round computes what the prefix cache does not hold."""
    from transformers import AutoTokenizer

    from orthrus_rag.entrypoints import commands as app
    from orthrus_rag.models.registry import resolve_model_path
    from tests.test_app_config import _compose

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path("smollm2-135m-instruct")))
    records = {}
    for continuation in (True, False):
        run_dir = tmp_path / str(continuation)
        cfg = _compose("experiment=smoke", "pipeline=search_r1", "dataset.num_questions=3", "pipeline.max_searches=2",
                       "pipeline.min_searches=1", "pipeline.step_tokens=40", "pipeline.constrain_format=true",
                       "retriever.k=2", f"pipeline.continuation={str(continuation).lower()}", f"run_dir={run_dir}",
                       "progress=false")
        summary = app.run(cfg)
        assert summary["num_questions"] == 3 and summary["num_failed"] == 0
        assert summary["retrievals_per_question"] >= 1 and summary["prefilled_tokens_per_question"] > 0
        records[continuation] = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
        for r in records[continuation]:
            steps = r["iterations"]
            # the grammar: every round reasons, then searches (with passages appended) or answers
            assert len(steps) >= 2 and all(s["generation"].startswith("<think>") for s in steps)
            assert all(s["query"] and len(s["retrieved"]) == 2 and "</search>" in s["generation"] for s in steps[:-1])
            assert steps[-1]["answer_found"] and steps[-1]["generation"].rstrip().endswith("</answer>")
            assert r["prefilled_tokens"] == sum(s["prefilled_tokens"] for s in steps)
            if continuation:
                for s in steps[1:]:
                    appended = len(tok(s["prompt"], add_special_tokens=False)["input_ids"])
                    assert 0 < s["prefilled_tokens"] <= appended + 16
    # the first round is the same request either way
    first = {c: {r["id"]: r["iterations"][0]["generation"] for r in records[c]} for c in records}
    assert first[True] == first[False]
