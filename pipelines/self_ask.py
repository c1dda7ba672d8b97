"""Self-Ask (Press et al., 2023) with retrieval: the model asks itself follow-up questions; each is answered from
passages retrieved for it, and the answers lead to the final one.

The prompt shows worked decompositions (written for this project, in the fictional world of prompts.py). The
model writes "Follow up: <question>" (its generation stops where it would write the intermediate answer itself);
the follow-up is retrieved for and answered in a short retrieval-augmented generation of its own, whose answer
goes back into the transcript as "Intermediate answer: ...". The chain ends when the model writes the answer
("So the answer is ...") or after `max_follow_ups`, when a last generation writes the answer under the run's
`answer_format`.

`force_follow_up` (the default) starts the model's turn with "Yes." and "Follow up:", so it asks at least one
follow-up: every question of a multi-hop set needs one, and a small model answers at once otherwise (SmolLM2-135M
wrote "The answer is yes." for all 40 2Wiki questions and retrieved for none; docs/benchmarks/methods.md). Off, the
model decides after "Are follow up questions needed here:", as in Press et al.

`prompt_style=flashrag` leaves Self-Ask as it is: it keeps this module's prompts and answer parsing, since FlashRAG's
Self-Ask exemplars are not reproduced here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.answers import parse_answer, parse_final
from orthrus_rag.pipelines.chain import sentence_params
from orthrus_rag.pipelines.method import Hits, Method, add_new, passage_refs
from orthrus_rag.pipelines.prompts import ANSWER_PHRASE, build_prompt
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.kinds import Retriever

FOLLOW_UP, INTERMEDIATE = "Follow up:", "Intermediate answer:"
FORCED = f" Yes.\n{FOLLOW_UP}"  # the start of the model's turn under force_follow_up
INSTRUCTION = ("Answer the question by asking follow-up questions, one at a time, each answered before the next. "
               f"Finish with \"{ANSWER_PHRASE} <answer>.\"")
DEMOS: list[tuple[str, list[tuple[str, str]], str]] = [
    ("Who is the mother of the director of film Lake Vorin Story?",
     [("Who directed Lake Vorin Story?", "Lake Vorin Story was directed by Edda Maralt."),
      ("Who is the mother of Edda Maralt?", "The mother of Edda Maralt is Ilse Maralt.")], "Ilse Maralt"),
    ("Which film came out first, The Copper Gate or Night Over Salden?",
     [("When did The Copper Gate come out?", "The Copper Gate came out in 1978."),
      ("When did Night Over Salden come out?", "Night Over Salden came out in 1972.")], "Night Over Salden"),
    ("Who is the paternal grandfather of Arno Velt?",
     [("Who is the father of Arno Velt?", "The father of Arno Velt is Bruno Velt."),
      ("Who is the father of Bruno Velt?", "The father of Bruno Velt is Oskar Velt.")], "Oskar Velt"),
]
_FOLLOW_UP = re.compile(re.escape(FOLLOW_UP) + r"\s*(.+)")


def self_ask_prompt(question: str) -> str:
    """The instruction, the worked decompositions, then the question and the first line of the model's turn."""
    parts = [INSTRUCTION, ""]
    for q, steps, answer in DEMOS:
        parts += [f"Question: {q}", "Are follow up questions needed here: Yes."]
        for follow_up, intermediate in steps:
            parts += [f"{FOLLOW_UP} {follow_up}", f"{INTERMEDIATE} {intermediate}"]
        parts += [f"{ANSWER_PHRASE} {answer}.", ""]
    parts += [f"Question: {question}", "Are follow up questions needed here:"]
    return "\n".join(parts)


def follow_up_of(generation: str) -> str | None:
    """The last follow-up question the model asked in `generation` (None: it asked none)."""
    found = _FOLLOW_UP.findall(generation)
    return found[-1].strip() if found else None


def check_self_ask(max_follow_ups: int, step_tokens: int) -> None:
    if max_follow_ups < 1:
        raise ValueError(f"max_follow_ups must be at least 1, got {max_follow_ups}")
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be at least 1, got {step_tokens}")


class SelfAsk(Method):
    """`max_follow_ups`: follow-up questions at most before the answer is asked for; `step_tokens`: the token
    budget of a follow-up question and of its intermediate answer; `force_follow_up`: the first follow-up is asked
    whatever the model would say (see the module). Needs a retriever."""

    name = "self_ask"

    def __init__(self, client: EngineClient, retriever: Retriever, k: int = 5, max_follow_ups: int = 4,
                 step_tokens: int = 48, sampling_params: SamplingParams | None = None, chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free",
                 force_follow_up: bool = True, prompt_style: str = "native") -> None:
        if retriever is None:
            raise ValueError("self_ask answers its follow-ups from retrieved passages: it needs a retriever")
        check_self_ask(max_follow_ups, step_tokens)
        super().__init__(client, retriever, k, sampling_params, chat_template, max_concurrency, recall_ks,
                         question_timeout_s, answer_format, prompt_style)
        self.max_follow_ups = max_follow_ups
        self.force_follow_up = force_follow_up
        stop = list(self.sampling_params.stop or [])
        # NOTE: the model would answer its own follow-up from memory next: stop there, retrieve and answer it
        self.ask_params = dataclasses.replace(self.sampling_params, max_tokens=step_tokens,
                                              stop=[*stop, INTERMEDIATE])
        self.answer_params = sentence_params(self.sampling_params, step_tokens)

    def _transcript_prompt(self, question: str, transcript: str) -> str:
        head = self.render(self_ask_prompt(question))
        return head + transcript

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        # the model's turn so far, after "Are follow up questions needed here:"
        transcript = FORCED if self.force_follow_up else ""
        used: Hits = []
        for t in range(1, self.max_follow_ups + 2):
            final = t == self.max_follow_ups + 1
            prompt = self._transcript_prompt(ex.question, transcript)
            out, generate_s = await self.generate(prompt, self.final_params if final else self.ask_params)
            asked = out.text
            # NOTE: the first step's question may begin in the forced "Follow up:" before the generation
            follow_up = None if final else follow_up_of((transcript if t == 1 else "") + asked)
            if final or follow_up is None or parse_answer(asked, ex.question).found:
                # the answer (or no further question): the chain ends with this generation
                transcript += asked
                parsed = (parse_final(asked, self.answer_format, ex.question) if final and self.answer_format != "free"
                          else parse_answer(transcript, ex.question))
                await emit(IterationRecord(t, "", [], prompt, asked.strip(), parsed.answer, 0.0, generate_s,
                                           parsed.found))
                return used
            hits, retrieve_s = await self.retrieve(follow_up)
            used = add_new(used, hits)
            answer_prompt = self.render(build_prompt(follow_up, [p for p, _ in hits]))
            reply, seconds = await self.generate(answer_prompt, self.answer_params)
            intermediate = parse_answer(reply.text, follow_up)
            # NOTE: the intermediate answer is the reply's sentence as written (parse_answer's short answer when
            # the reply used the answer phrase: "So the answer is X." -> "X.")
            said = (intermediate.answer if intermediate.found else reply.text).strip()
            said += "" if said.endswith((".", "!", "?")) else "."  # as the demonstrations' answers end
            transcript += asked.rstrip() + f"\n{INTERMEDIATE} {said}\n"
            await emit(IterationRecord(t, follow_up, passage_refs(hits), answer_prompt, said, intermediate.answer,
                                       retrieve_s, generate_s + seconds, intermediate.found))
        return used
