"""IRCoT (Trivedi et al., 2023): interleave retrieval with chain-of-thought reasoning, one sentence at a time.

Retrieve with the question; then, step by step, generate the next sentence of the reasoning from every passage
gathered so far (the chain so far continues the answer), and retrieve with that sentence, adding the passages not
yet held (at most `max_passages`, first come first kept). The chain ends at the sentence that gives the answer
("So the answer is ...") or at `max_steps`, whose generation writes on to the answer under the run's
`answer_format`. Of all methods here it alternates embedding and generation most often: one query embedding per
reasoning sentence.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.chain import chain_answer, continued, first_sentence, sentence_params
from orthrus_rag.pipelines.method import Hits, Method, add_new, passage_refs
from orthrus_rag.pipelines.prompts import build_prompt
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.kinds import Retriever

def check_ircot(max_steps: int, max_passages: int, step_tokens: int) -> None:
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    if max_passages < 1:
        raise ValueError(f"max_passages must be at least 1, got {max_passages}")
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be at least 1, got {step_tokens}")


class IRCoT(Method):
    """`max_steps`: reasoning sentences at most (the last writes on to the answer); `max_passages`: passages the
    prompt holds at most; `step_tokens`: the token budget of one reasoning sentence. Needs a retriever."""

    name = "ircot"

    def __init__(self, client: EngineClient, retriever: Retriever, k: int = 5, max_steps: int = 5,
                 max_passages: int = 15, step_tokens: int = 48, sampling_params: SamplingParams | None = None,
                 chat_template: Any = None, max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free") -> None:
        if retriever is None:
            raise ValueError("ircot retrieves at every step: it needs a retriever")
        check_ircot(max_steps, max_passages, step_tokens)
        super().__init__(client, retriever, k, sampling_params, chat_template, max_concurrency, recall_ks,
                         question_timeout_s, answer_format)
        self.max_steps, self.max_passages = max_steps, max_passages
        self.step_params = sentence_params(self.sampling_params, step_tokens)

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        query = ex.question
        hits, retrieve_s = await self.retrieve(query)
        passages: Hits = list(hits[: self.max_passages])
        thoughts: list[str] = []
        for t in range(1, self.max_steps + 1):
            final = t == self.max_steps
            prompt = continued(self.render(build_prompt(ex.question, [p for p, _ in passages])), thoughts)
            out, generate_s = await self.generate(prompt, self.final_params if final else self.step_params)
            sentence = out.text.strip() if final else first_sentence(out.text)
            thoughts.append(sentence)
            parsed, ends = chain_answer(thoughts, final, self.answer_format, ex.question)
            await emit(IterationRecord(t, query, passage_refs(hits), prompt, sentence, parsed.answer, retrieve_s,
                                       generate_s, parsed.found))
            if ends:
                break
            query = sentence
            hits, retrieve_s = await self.retrieve(query)
            passages = add_new(passages, hits, self.max_passages)
        return passages
