"""IRCoT (Trivedi et al., 2023): interleave retrieval with chain-of-thought reasoning, one sentence at a time.

Retrieve with the question; then, step by step, generate the next sentence of the reasoning from every passage
gathered so far (the chain so far continues the answer), and retrieve with that sentence, adding the passages not
yet held (at most `max_passages`, first come first kept). The chain ends at the sentence that gives the answer
("So the answer is ...") or at `max_steps`, whose generation writes on to the answer under the run's
`answer_format`. Of all methods here it alternates embedding and generation most often: one query embedding per
reasoning sentence.

`prompt_style=flashrag` runs FlashRAG's IRCOTPipeline loop where it concerns the prompt and the answer: FlashRAG's
plain-text prompt (flashrag_prompts.py; never the chat template), each thought a whole generation under the run's
`max_tokens` kept as the model wrote it (FlashRAG's generator settings for every thought; `step_tokens` does not
apply), the thoughts so far appended to the prompt joined by a space, the chain ending at a thought that holds "So the
answer is:" or at `max_steps`, and the answer FlashRAG's `ircot_pred_parse` of the joined thoughts. Passages merge
FlashRAG's way too: each kept at the best score any retrieval gave it, shown in ascending score order (the best next
to the question) after the first merge; the first prompt shows the question's hits in the retriever's order. What
remains of this module's own loop: `max_passages` still caps the passages shown (the lowest scored are dropped;
FlashRAG keeps all: set it to at least k x max_steps to match), a blank thought ends the chain (FlashRAG would search
with it), and no retrieval follows the last step (FlashRAG's only changes its recorded passages, not the answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from orthrus_rag.data.types import Passage, QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.chain import chain_answer, continued, first_sentence, sentence_params
from orthrus_rag.pipelines.flashrag_prompts import IRCOT_ANSWER, ircot_answer, ircot_prompt
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
                 question_timeout_s: float | None = None, answer_format: str = "free",
                 prompt_style: str = "native") -> None:
        if retriever is None:
            raise ValueError("ircot retrieves at every step: it needs a retriever")
        check_ircot(max_steps, max_passages, step_tokens)
        super().__init__(client, retriever, k, sampling_params, chat_template, max_concurrency, recall_ks,
                         question_timeout_s, answer_format, prompt_style)
        self.max_steps, self.max_passages = max_steps, max_passages
        self.step_params = sentence_params(self.sampling_params, step_tokens)

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        if self.prompt_style == "flashrag":
            return await self._flashrag_loop(ex, emit)
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

    async def _flashrag_loop(self, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        """FlashRAG's IRCoT loop (see the module)."""
        query = ex.question
        hits, retrieve_s = await self.retrieve(query)
        held: dict[str, tuple[Passage, float]] = {}  # every passage retrieved, first come first, at its best score
        merge_by_score(held, hits, self.max_passages)
        shown = list(hits[: self.max_passages])  # NOTE: FlashRAG's first prompt keeps the retriever's order
        thoughts: list[str] = []
        for t in range(1, self.max_steps + 1):
            prompt = ircot_prompt(ex.question, [p for p, _ in shown], thoughts)
            out, generate_s = await self.generate(prompt, self.sampling_params)
            thoughts.append(out.text)
            joined = " ".join(thoughts)
            await emit(IterationRecord(t, query, passage_refs(hits), prompt, out.text, ircot_answer(joined),
                                       retrieve_s, generate_s, IRCOT_ANSWER in joined))
            if IRCOT_ANSWER in out.text or t == self.max_steps or not out.text.strip():
                break
            query = out.text
            hits, retrieve_s = await self.retrieve(query)
            shown = merge_by_score(held, hits, self.max_passages)
        ids = {p.id for p, _ in shown}
        return [h for h in held.values() if h[0].id in ids]  # for recall: first come first, as the native loop's


def merge_by_score(held: dict[str, tuple[Passage, float]], hits: Hits, limit: int) -> Hits:
    """Add `hits` to `held` (a passage seen again keeps its best score) and return what FlashRAG's IRCoT shows: all
    held passages in ascending score order (ties first come first), here the `limit` best of them."""
    for passage, score in hits:
        seen = held.get(passage.id)
        held[passage.id] = (passage, score if seen is None else max(seen[1], score))
    return sorted(held.values(), key=lambda h: h[1])[-limit:]
