"""How the final iteration of a pipeline writes its answer (`pipeline.answer_format`), and how it is read back.

- `free` (the default): the model writes as it likes; `answers.parse_answer` finds "So the answer is ..." or
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

from orthrus_rag.params import StructuredOutputsParams
from orthrus_rag.pipelines.answers import ParsedAnswer, parse_answer, reduce_yes_no
from orthrus_rag.pipelines.prompts import ANSWER_PHRASE

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
