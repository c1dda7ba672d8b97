"""Iter-RetGen (Shao et al., 2023), standard RAG and no-retrieval, through any `EngineClient`.

Iteration t retrieves with the previous generation placed before the question (y_{t-1} || q), then generates
from the retrieved paragraphs and the question (the previous output is not in the prompt). The shared plumbing
(concurrency, timeouts, failures, scoring) is `Method`'s (method.py).

`prompt_style=flashrag` runs it as FlashRAG's SequentialPipeline (one iteration), IterativePipeline and, without a
retriever, `naive_run` do: FlashRAG's default template (flashrag_prompts.py), the answer the generation as is (no
"So the answer is" parsing), and iteration t retrieving with the question first, then the previous generation as
FlashRAG writes it (q || y_{t-1}, the generation unstripped).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.answers import ParsedAnswer, parse_final
from orthrus_rag.pipelines.flashrag_prompts import default_messages
from orthrus_rag.pipelines.method import Hits, Method, check_settings, default_concurrency, passage_refs
from orthrus_rag.pipelines.prompts import build_prompt
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.kinds import Retriever

__all__ = ["IterRetGen", "check_settings", "default_concurrency"]


class IterRetGen(Method):
    """`iterations=1` is standard RAG; `retriever=None` is no retrieval (one generation from the question)."""

    name = "iter_retgen"

    def __init__(self, client: EngineClient, retriever: Retriever | None, iterations: int = 2, k: int = 5,
                 sampling_params: SamplingParams | None = None, chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free",
                 prompt_style: str = "native") -> None:
        check_settings(iterations, k, max_concurrency, question_timeout_s)
        super().__init__(client, retriever, k, sampling_params, chat_template, max_concurrency, recall_ks,
                         question_timeout_s, answer_format, prompt_style)
        self.iterations = iterations if retriever is not None else 1

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        flashrag = self.prompt_style == "flashrag"
        previous = raw = ""
        retrieved: Hits = []
        for t in range(1, self.iterations + 1):
            if t == 1:
                query = ex.question
            else:  # NOTE: FlashRAG's IterativePipeline puts the question first and the generation unstripped
                query = f"{ex.question} {raw}" if flashrag else f"{previous} {ex.question}".strip()
            retrieved, retrieve_s = await self.retrieve(query)
            passages = [p for p, _ in retrieved] if self.retriever is not None else None
            prompt = (self.render_messages(default_messages(ex.question, passages)) if flashrag
                      else self.render(build_prompt(ex.question, passages)))
            final = t == self.iterations
            out, generate_s = await self.generate(prompt, self.final_params if final else self.sampling_params)
            raw = out.text
            previous = raw.strip()
            parsed = (ParsedAnswer(previous, True) if flashrag
                      else parse_final(previous, self.answer_format if final else "free", ex.question))
            await emit(IterationRecord(t, query, passage_refs(retrieved), prompt, previous, parsed.answer, retrieve_s,
                                       generate_s, parsed.found))
        return retrieved
