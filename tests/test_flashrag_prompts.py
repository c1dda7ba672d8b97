"""`pipeline.prompt_style=flashrag` (pipelines/flashrag_prompts.py): the exact prompts each styled method sends for a
fixed question and two passages, plain and through a tiny chat template; Iter-RetGen's query order under both
styles; IRCoT's answer parsing, stopping rule and passage merging; and the validation of the setting. Scripted
engine and retriever, no model."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest

from orthrus_rag.data.types import Passage, QAExample
from orthrus_rag.pipelines import FLARE, IRCoT, IterRetGen, SelfAsk
from orthrus_rag.pipelines import flashrag_prompts as fr
from orthrus_rag.pipelines.flashrag_prompts import check_prompt_style, ircot_answer
from orthrus_rag.pipelines.registry import make_method
from tests.test_flare_self_ask import LogprobEngine, WordTokenizer, _said
from tests.test_ircot import ScriptedEngine

QUESTION = "Who directed Lake Film?"
PASSAGES = [Passage("a", "Lake Film", "Lake Film is a 1961 drama."), Passage("b", "Edda Maralt", "Edda directed it.")]
DOCS = "Doc 1(Title: Lake Film) Lake Film is a 1961 drama.\nDoc 2(Title: Edda Maralt) Edda directed it.\n"
SYSTEM = ("Answer the question based on the given document.Only give me the answer and do not output any other "
          "words.\nThe following are given documents.\n\n")
IRCOT_HEAD = f"{fr.IRCOT_INSTRUCTION}\n\n{fr.IRCOT_EXAMPLE}\n\n"
IRCOT_DOCS = ("Wikipedia Title: Lake Film\nLake Film is a 1961 drama.\n\n"
              "Wikipedia Title: Edda Maralt\nEdda directed it.\n\n")


class FixedRetriever:
    """`PASSAGES` (scores 0.9, 0.8) for the question; for any other query, "b" again (at 0.95) and a new "c"."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    async def asearch(self, query: str, k: int = 5):
        self.queries.append(query)
        if query == QUESTION:
            return [(PASSAGES[0], 0.9), (PASSAGES[1], 0.8)][:k]
        return [(PASSAGES[1], 0.95), (Passage("c", "Ilse", "Ilse is Edda's mother."), 0.85)][:k]


class TinyChat:
    """A tokenizer's chat template, spelled out: each message in role tags, then the assistant's turn."""

    chat_template = "tiny"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def _example() -> QAExample:
    return QAExample("q1", QUESTION, ["Edda Maralt"], supporting_titles=["Edda Maralt"])


def _run(method, ex: QAExample | None = None):
    return asyncio.run(method.answer(ex or _example()))


def test_the_templates_are_flashrags_character_for_character():
    """Checksums of FlashRAG 0.1.2's strings (prompt/base_prompt.py, pipeline/active_pipeline.py)."""
    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    assert digest(fr.DEFAULT_SYSTEM) == "c8df79231134dfdaf54a22f437015e6ad34fe2e59af4492f1f94f57bbe66433f"
    assert digest(fr.DEFAULT_USER) == "b6f9739c2a651441320a36e444c6c6555e988db27bf7bce3cdf57bbd5a44e4f3"
    assert digest(fr.IRCOT_INSTRUCTION) == "8087a518470195295a481887c0f1b8d91379698b8825e953c3978314d0b9cd7e"
    assert digest(fr.IRCOT_EXAMPLE) == "528153f8218dd6f4f60acbd70a710c97569f220014763e9eed179fdac81a86f7"


# ---- standard RAG / Iter-RetGen / no retrieval -------------------------------------------------------------------
def test_standard_rag_sends_flashrags_default_template_as_plain_text_and_keeps_the_answer_whole():
    engine = ScriptedEngine([" Edda Maralt. So the answer is Ilse.\n"])
    rec = _run(IterRetGen(engine, FixedRetriever(), iterations=1, k=2, prompt_style="flashrag"))
    assert engine.prompts == [f"{SYSTEM}{DOCS}\n\nQuestion: {QUESTION}"]
    assert rec.iterations[0].prompt == engine.prompts[0]  # the record keeps the prompt as sent
    # the generation as is (stripped): no "So the answer is" parsing
    assert rec.prediction == "Edda Maralt. So the answer is Ilse." and rec.iterations[0].answer_found


def test_standard_rag_through_the_chat_template_has_a_system_and_a_user_turn():
    engine = ScriptedEngine(["Edda Maralt"])
    rec = _run(IterRetGen(engine, FixedRetriever(), iterations=1, k=2, chat_template=TinyChat(),
                          prompt_style="flashrag"))
    assert engine.prompts == [f"<|system|>{SYSTEM}{DOCS}<|end|><|user|>Question: {QUESTION}<|end|><|assistant|>"]
    assert rec.prediction == "Edda Maralt" and rec.em == 1.0


def test_no_retrieval_leaves_the_reference_empty_as_flashrags_naive_run():
    engine = ScriptedEngine(["Edda"])
    _run(IterRetGen(engine, None, prompt_style="flashrag"))
    assert engine.prompts == [f"{SYSTEM}\n\nQuestion: {QUESTION}"]


def test_iter_retgen_query_order_under_each_style():
    lines = [" Edda Maralt.\n", "Edda Maralt"]
    native, flashrag = FixedRetriever(), FixedRetriever()
    _run(IterRetGen(ScriptedEngine(lines), native, iterations=2, k=2))
    _run(IterRetGen(ScriptedEngine(lines), flashrag, iterations=2, k=2, prompt_style="flashrag"))
    assert native.queries == [QUESTION, f"Edda Maralt. {QUESTION}"]  # y_{t-1} || q, stripped
    assert flashrag.queries == [QUESTION, f"{QUESTION}  Edda Maralt.\n"]  # FlashRAG's q || y_{t-1}, unstripped


# ---- IRCoT ---------------------------------------------------------------------------------------------------------
def test_ircot_sends_flashrags_plain_prompt_with_the_thoughts_appended_even_with_a_chat_template():
    engine = ScriptedEngine([" Edda directed Lake Film.", " So the answer is: Edda Maralt.\nQuestion: next"])
    retriever = FixedRetriever()
    rec = _run(IRCoT(engine, retriever, k=2, max_steps=5, chat_template=TinyChat(), prompt_style="flashrag"))
    # the first prompt: the question's hits in the retriever's order, no thought yet
    assert engine.prompts[0] == f"{IRCOT_HEAD}{IRCOT_DOCS}Question: {QUESTION}\nThought:"
    # then merged at their best score ("b" 0.95 now), ascending, and the thought appended with nothing between
    merged = ("Wikipedia Title: Ilse\nIlse is Edda's mother.\n\nWikipedia Title: Lake Film\nLake Film is a 1961 "
              "drama.\n\nWikipedia Title: Edda Maralt\nEdda directed it.\n\n")
    assert engine.prompts[1] == f"{IRCOT_HEAD}{merged}Question: {QUESTION}\nThought: Edda directed Lake Film."
    # each thought is a whole generation under the run's budget; it retrieves with the thought as written
    assert retriever.queries == [QUESTION, " Edda directed Lake Film."]
    assert all(p.max_tokens == 96 and not p.stop for p in engine.params)
    # it stopped at "So the answer is:"; the answer is the text after it in the joined thoughts
    assert len(rec.iterations) == 2 and rec.prediction == "Edda Maralt.\nQuestion: next"
    assert [it.answer_found for it in rec.iterations] == [False, True]
    assert [it.prompt for it in rec.iterations] == engine.prompts
    assert rec.recall["recall@used"] == 1.0  # the three passages shown


def test_ircot_stops_only_at_flashrags_phrase_or_the_step_limit():
    engine = ScriptedEngine(["Edda. So the answer is Edda.", "Still going.", "Never asked."])
    rec = _run(IRCoT(engine, FixedRetriever(), k=2, max_steps=2, prompt_style="flashrag"))
    assert len(engine.prompts) == 2  # "So the answer is" without the colon does not end the chain
    assert engine.prompts[1].endswith("Thought:Edda. So the answer is Edda.")
    assert rec.prediction == "Edda. So the answer is Edda. Still going." and not rec.iterations[-1].answer_found


def test_ircot_answer_parsing_is_flashrags():
    assert ircot_answer("A is B. So the answer is: Edda. ") == "Edda."
    assert ircot_answer("x So the answer is: one So the answer is: two") == "one"  # up to the next phrase
    assert ircot_answer(" No phrase here\n") == " No phrase here\n"  # the whole text as is


def test_ircot_caps_the_passages_it_shows_keeping_the_best_scored():
    engine = ScriptedEngine(["Edda directed it.", "So the answer is: Edda"])
    _run(IRCoT(engine, FixedRetriever(), k=2, max_passages=2, prompt_style="flashrag"))
    # held: a 0.9, b 0.95 (seen again), c 0.85: the lowest goes, the rest ascending
    assert engine.prompts[1] == f"{IRCOT_HEAD}{IRCOT_DOCS}Question: {QUESTION}\nThought:Edda directed it."


# ---- FLARE ---------------------------------------------------------------------------------------------------------
def test_flare_writes_from_the_default_template_with_the_sentences_so_far_appended():
    tok = WordTokenizer()
    engine = LogprobEngine([
        _said(tok, "Lake Film was directed by Edda. More"),  # sure: kept, no retrieval
        _said(tok, "Edda's mother is Greta Maralt.", unsure={"Greta"}),  # unsure: retrieve, write again
        _said(tok, "Edda is the director."),
        _said(tok, "The answer is Edda Maralt."),  # the step limit: written on as is
    ])
    rec = _run(FLARE(engine, FixedRetriever(), k=2, max_steps=3, tokenizer=tok, chat_template=TinyChat(),
                     prompt_style="flashrag"))
    head = f"<|system|>{SYSTEM}<|end|><|user|>Question: {QUESTION}<|end|><|assistant|>"
    assert engine.prompts[0] == head  # no passages yet: the reference is empty, no previous generation
    assert engine.prompts[1] == head + "Lake Film was directed by Edda."
    with_docs = (f"<|system|>{SYSTEM}Doc 1(Title: Edda Maralt) Edda directed it.\nDoc 2(Title: Ilse) Ilse is "
                 f"Edda's mother.\n<|end|><|user|>Question: {QUESTION}<|end|><|assistant|>")
    assert engine.prompts[2] == with_docs + "Lake Film was directed by Edda."
    assert engine.prompts[3] == with_docs + "Lake Film was directed by Edda. Edda is the director."
    # the answer is what was written, unparsed
    assert rec.prediction == "Lake Film was directed by Edda. Edda is the director. The answer is Edda Maralt."


# ---- the methods it leaves alone, and the setting's rules -----------------------------------------------------------
def test_self_ask_keeps_its_own_prompt():
    prompts = []
    for style in ("native", "flashrag"):
        engine = ScriptedEngine(["So the answer is Edda."])
        _run(SelfAsk(engine, FixedRetriever(), k=2, prompt_style=style))
        prompts.append(engine.prompts[0])
    assert prompts[0] == prompts[1]


def test_make_method_passes_the_style_to_every_method():
    client = SimpleNamespace(generate=None, tokenizer=None)
    for name in ("iter_retgen", "standard_rag", "no_retrieval", "ircot", "flare", "self_ask", "search_r1"):
        assert make_method(name, client, FixedRetriever(), prompt_style="flashrag").prompt_style == "flashrag"


def test_an_unknown_style_or_a_constrained_answer_is_refused():
    with pytest.raises(ValueError, match=r"unknown prompt_style 'fashrag'; expected one of native, flashrag"):
        check_prompt_style("fashrag")
    with pytest.raises(ValueError, match="prompt_style=flashrag .* answer_format must be free, got 'json'"):
        IterRetGen(ScriptedEngine([]), FixedRetriever(), prompt_style="flashrag", answer_format="json")
    check_prompt_style("native", "constrained")  # the native prompts compose with every format


def test_the_cli_refuses_a_bad_style_before_anything_loads(tmp_path, monkeypatch, capsys):
    from orthrus_rag.entrypoints import commands as app
    from orthrus_rag.entrypoints.checks import validate
    from orthrus_rag.entrypoints.cli import main
    from tests.test_app_config import _compose

    with pytest.raises(ValueError, match=r"^pipeline: unknown prompt_style 'x'; expected one of native, flashrag"):
        validate(_compose("pipeline.prompt_style=x", f"run_dir={tmp_path}"))
    with pytest.raises(ValueError, match="answer_format must be free, got 'constrained'"):
        validate(_compose("pipeline.prompt_style=flashrag", "pipeline.answer_format=constrained",
                          f"run_dir={tmp_path}"))
    validate(_compose("pipeline=ircot", "pipeline.prompt_style=flashrag", f"run_dir={tmp_path}"))

    def refuse(cfg):  # noqa: ANN001
        raise AssertionError("a model would have loaded")

    monkeypatch.setattr(app, "build_client", refuse)
    assert main(["run", "pipeline.prompt_style=x", f"run_dir={tmp_path / 'run'}", "progress=false"]) == 2
    assert "unknown prompt_style 'x'" in capsys.readouterr().err


def test_the_style_is_a_label_of_the_run():
    from orthrus_rag.entrypoints.commands import run_labels
    from tests.test_app_config import _compose

    labels = run_labels(_compose("pipeline.prompt_style=flashrag"), SimpleNamespace(name="engine"), 4)
    assert labels["prompt_style"] == "flashrag"
