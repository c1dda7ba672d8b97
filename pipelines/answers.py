"""The final answer in a chain-of-thought generation, as the field parses it (Iter-RetGen / IRCoT / FlashRAG).

The prompt asks the model to reason and finish with "So the answer is <answer>." (prompts.ANSWER_PHRASE). The answer
is the text after the *first* such phrase (a small model often runs on into an invented next demonstration, whose
own "So the answer is" belongs to another question), up to the end of its sentence. Models that ignore the format
get a fallback: "the answer is ..." / "Answer: ..." anywhere, else the first sentence of the first line (direct
answers come first). Answers to yes/no questions are reduced to "yes" / "no", so "No, the two mosques are not in
the same neighbourhood." scores as "no"; for any other question only a bare "yes" / "no" is.

How the final iteration of a pipeline writes its answer (`pipeline.answer_format`), and how it is read back.

- `free` (the default): the model writes as it likes; `parse_answer` finds "So the answer is ..." or
  falls back to other rules (the default model follows the phrase in under a tenth of its final answers on 2Wiki).
- `constrained`: the final generation is held to one line of reasoning that must end in "So the answer is
  <answer>." (a regex constraint: the end of text is refused until that sentence is written, and a reasoning
  longer than the budget allows is cut short: it ends its sentence, then the phrase follows), so every answer is
  found by the phrase.
- `json`: the final generation is `{"answer": "..."}` and nothing else (a direct answer, no written reasoning).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from orthrus_rag.params import StructuredOutputsParams
from orthrus_rag.pipelines.prompts import ANSWER_PHRASE

_PHRASE = re.compile(r"\b" + r"\s+".join(ANSWER_PHRASE.lower().split()) + r"\b", re.IGNORECASE)
# NOTE: fallbacks for models that drop the prompt's phrase; "answer:" alone would also catch an echoed "Answer:" label
_FALLBACKS = (re.compile(r"\b(?:the\s+)?(?:final\s+|correct\s+)?answer\s+(?:is|would\s+be)\b", re.IGNORECASE),
              re.compile(r"\banswer\s*:", re.IGNORECASE))
_ABBREVIATIONS = {"dr", "mr", "mrs", "ms", "st", "jr", "sr", "mt", "ft", "vs", "gen", "col", "lt", "sgt", "prof",
                  "rev", "hon", "co", "inc", "ltd", "no", "vol", "ca", "c"}
_AUXILIARIES = {"is", "are", "was", "were", "do", "does", "did", "can", "could", "has", "have", "had", "will",
                "would", "should", "shall", "may", "might", "must"}
_EDGE = " \t\"'“”‘’*_`:"  # quotes and markdown emphasis around an answer


@dataclass(frozen=True)
class ParsedAnswer:
    answer: str
    found: bool  # the prompt's phrase was there (False: a fallback rule gave the answer)


def parse_answer(generation: str, question: str | None = None) -> ParsedAnswer:
    """The final answer of `generation`; `question` lets "No they are not" reduce to "no" for yes/no questions."""
    match = _PHRASE.search(generation)
    found = match is not None
    if match is None:
        match = next((m for m in (p.search(generation) for p in _FALLBACKS) if m is not None), None)
    if match is not None:
        text = generation[match.end():]
    else:
        text = next((line for line in generation.splitlines() if line.strip(_EDGE + "#-")), "")
    answer = _first_sentence(_first_line(text.lstrip(_EDGE + "\n")))
    return ParsedAnswer(reduce_yes_no(answer, question), found)


def extract_answer(generation: str, question: str | None = None) -> str:
    return parse_answer(generation, question).answer


def is_yes_no_question(question: str) -> bool:
    """2Wiki / HotpotQA comparison questions that start with an auxiliary ("Are both films ...?")."""
    words = question.strip().split(maxsplit=1)
    return bool(words) and words[0].lower() in _AUXILIARIES


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def _first_sentence(text: str) -> str:
    """Cut at the first full stop that ends a sentence, keeping the dots of initials ("J. R. R. Tolkien"),
    acronyms ("U.S. Army"), abbreviations ("Dr. No") and numbers ("3.5")."""
    for end in re.finditer(r"\.(?=\s|$)", text):
        word = re.search(r"(\S+)$", text[:end.start()])
        token = word.group(1) if word else ""
        if re.fullmatch(r"[A-Z]|(?:[A-Za-z]\.)+[A-Za-z]", token) or token.lower().strip(_EDGE) in _ABBREVIATIONS:
            continue
        text = text[:end.start()]
        break
    return text.strip(_EDGE).rstrip(".").strip(_EDGE)


def reduce_yes_no(answer: str, question: str | None) -> str:
    """A bare "Yes" / "No." -> "yes" / "no" for any question; "No, they are not ..." / "Yes. Both ..." only when the
    question is a yes/no question (for another, "No. 1 Ladies' Detective Agency" or "No Way Out" is a title), and
    never "No." followed by a number ("No. 1 ..."), which is a title or a rank even there."""
    match = re.match(r"(yes|no)\b(.*)", answer, re.IGNORECASE | re.DOTALL)
    if match is None:
        return answer
    word, rest = match.group(1).lower(), match.group(2)
    if not rest.strip(_EDGE + ".,;!-— "):
        return word
    if question is None or not is_yes_no_question(question) or re.match(r"\.\s*\d", rest):
        return answer
    return word


# ---- how the final iteration writes its answer (pipeline.answer_format) --------------------------------------
ANSWER_FORMATS = ("free", "constrained", "json")
MAX_ANSWER_CHARS = 100
# NOTE: tokens kept for the answer sentence (the phrase, up to MAX_ANSWER_CHARS of answer, the full stop), and the
# characters a reasoning token is budgeted at: English text runs ~4 characters a token here, so at 3 the
# reasoning's character limit is reached (and the sentence forced) before the token budget in all but odd texts
ANSWER_TOKENS = 32
CHARS_PER_TOKEN = 3
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": MAX_ANSWER_CHARS}},
               "required": ["answer"], "additionalProperties": False}


def check_answer_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer_format {answer_format!r}; expected one of {', '.join(ANSWER_FORMATS)}")


def final_constraint(answer_format: str, max_tokens: int) -> StructuredOutputsParams | None:
    """The constraint of the final iteration's generation (None for `free`)."""
    check_answer_format(answer_format)
    if answer_format == "free":
        return None
    if answer_format == "json":
        return StructuredOutputsParams(json=JSON_SCHEMA)
    reasoning_chars = max(0, (max_tokens - ANSWER_TOKENS) * CHARS_PER_TOKEN)
    # NOTE: the reasoning, if any, ends a sentence before the phrase: cut short, it closes its sentence first
    return StructuredOutputsParams(
        regex=rf"(?:[^\n]{{0,{reasoning_chars}}}[.!?] )?{ANSWER_PHRASE} [^\n]{{1,{MAX_ANSWER_CHARS}}}\.")


def parse_final(generation: str, answer_format: str, question: str | None = None) -> ParsedAnswer:
    """The answer of a final generation written under `answer_format`. Constrained: the sentence after the last
    phrase (the one the grammar forced; the model may write on past its full stop); JSON: the object's answer.
    Either falls back to `parse_answer` when the text is not what the constraint makes (a generation cut by its token budget)."""
    check_answer_format(answer_format)
    if answer_format == "constrained":
        spans = list(re.finditer(re.escape(ANSWER_PHRASE) + r" ", generation))
        if spans:
            return parse_answer(generation[spans[-1].start():], question)
    elif answer_format == "json":
        try:
            value = json.loads(generation)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("answer"), str) and value["answer"].strip():
            return ParsedAnswer(reduce_yes_no(value["answer"].strip(), question), True)
    return parse_answer(generation, question)
