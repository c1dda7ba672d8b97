"""A chain of reasoning sentences, written one step at a time (IRCoT, FLARE): what a step generates (one sentence
under a small budget), how the chain so far continues the answer in the next prompt, and when it ends."""

from __future__ import annotations

import dataclasses
import re

from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.answers import ParsedAnswer, parse_answer, parse_final

# a sentence ends at . ! or ? followed by a space or the end (a reasoning step of the demonstrations' kind)
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def first_sentence(text: str) -> str:
    """The first sentence of a generation (all of it when it has no full stop: cut by the token budget)."""
    text = text.strip()
    match = _SENTENCE_END.search(text)
    return text[: match.end()] if match else text


def sentence_params(params: SamplingParams, step_tokens: int, **changes: object) -> SamplingParams:
    """`params` for one step's sentence: `step_tokens` at most, and a new line ends it early (the demonstrations'
    answers are one line; what follows the first sentence is dropped)."""
    return dataclasses.replace(params, max_tokens=step_tokens, stop=[*(params.stop or []), "\n"], **changes)


def continued(head: str, thoughts: list[str]) -> str:
    """The rendered prompt `head` with the chain so far as the start of the answer."""
    if not thoughts:
        return head
    return head + ("" if head.endswith(("\n", " ")) else " ") + " ".join(thoughts)


def chain_answer(thoughts: list[str], final: bool, answer_format: str, question: str) -> tuple[ParsedAnswer, bool]:
    """The answer so far and whether the chain ends here: at the step limit (`final`: its generation was written
    under `answer_format`), at the sentence that gives the answer, or at an empty one."""
    sentence = thoughts[-1]
    if final and answer_format != "free":
        return parse_final(sentence, answer_format, question), True
    ends = final or not sentence or parse_answer(sentence, question).found
    return parse_answer(" ".join(thoughts), question), ends
