"""Iter-RetGen prompts: 3-shot chain-of-thought demonstrations ending in "So the answer is ...".

The final answer is parsed back out of a generation by `answers.parse_answer`.

The demonstrations are written for this project (a fictional world, 2Wiki's question types) so that no
benchmark question leaks into the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from orthrus_rag.data.types import Passage

ANSWER_PHRASE = "So the answer is"  # what answers.parse_answer looks for
INSTRUCTION = ("Answer the question using the passages. Think step by step, then finish with "
               f"\"{ANSWER_PHRASE} <answer>.\"")

DEMOS: list[tuple[str, str, str]] = [
    (
        "Lake Vorin Story: Lake Vorin Story is a 1961 drama film directed by Edda Maralt.\n"
        "Edda Maralt: Edda Maralt (born 3 May 1920) was a film director. Her mother was the painter Ilse Maralt.",
        "Who is the mother of the director of film Lake Vorin Story?",
        "Lake Vorin Story was directed by Edda Maralt. The mother of Edda Maralt is Ilse Maralt. "
        "So the answer is Ilse Maralt.",
    ),
    (
        "The Copper Gate: The Copper Gate is a 1978 film by Tomas Reld.\n"
        "Night Over Salden: Night Over Salden is a 1972 thriller film.",
        "Which film came out first, The Copper Gate or Night Over Salden?",
        "The Copper Gate came out in 1978. Night Over Salden came out in 1972. 1972 is earlier than 1978. "
        "So the answer is Night Over Salden.",
    ),
    (
        "Arno Velt: Arno Velt was a merchant born in Kessaly. His father was Bruno Velt.\n"
        "Bruno Velt: Bruno Velt was a shipbuilder. He was the son of Oskar Velt.",
        "Who is the paternal grandfather of Arno Velt?",
        "The father of Arno Velt is Bruno Velt. The father of Bruno Velt is Oskar Velt. "
        "So the answer is Oskar Velt.",
    ),
]

def format_passages(passages: Sequence[Passage]) -> str:
    return "\n".join(f"{p.title}: {p.text}" for p in passages)


def build_prompt(question: str, passages: Sequence[Passage] | None) -> str:
    """The plain-text prompt: instruction, 3 demonstrations, then the retrieved passages and the question.
    `passages=None` gives the no-retrieval prompt (demonstrations keep their passages as examples)."""
    parts = [INSTRUCTION, ""]
    for ctx, q, a in DEMOS:
        parts += [f"Passages:\n{ctx}", f"Question: {q}", f"Answer: {a}", ""]
    if passages is not None:
        parts.append(f"Passages:\n{format_passages(passages)}")
    parts += [f"Question: {question}", "Answer:"]
    return "\n".join(parts)
