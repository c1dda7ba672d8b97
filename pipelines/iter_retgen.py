"""Iter-RetGen (Shao et al., 2023), standard RAG and no-retrieval, against the co-scheduled async engine.

Iteration t retrieves with the previous generation placed before the question (y_{t-1} || q), then generates
from the retrieved paragraphs and the question (the previous output is not in the prompt). All questions run
concurrently, so query embeddings of some questions share engine steps with generations of others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from tqdm.auto import tqdm

from orthrus_rag.data.types import Passage, QAExample
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.metrics import exact_match, f1_score, recall_at_k
from orthrus_rag.pipelines.prompts import build_prompt, extract_answer
from orthrus_rag.pipelines.records import IterationRecord, QARecord

logger = logging.getLogger(__name__)
PIPELINES = ("iter_retgen", "standard_rag", "no_retrieval")


class AsyncRetriever(Protocol):
    async def asearch(self, query: str, k: int = 5) -> list[tuple[Passage, float]]: ...


class AsyncGenerator(Protocol):
    async def generate(self, prompt: str, params: SamplingParams | None = None) -> Any: ...


class IterRetGen:
    """`iterations=1` is standard RAG; `retriever=None` is no retrieval (one generation from the question)."""

    def __init__(self, engine: AsyncGenerator, retriever: AsyncRetriever | None, iterations: int = 2, k: int = 5,
                 sampling_params: SamplingParams | None = None, chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5)) -> None:
        if iterations < 1:
            raise ValueError(f"iterations must be at least 1, got {iterations}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.engine = engine
        self.retriever = retriever
        self.iterations = iterations if retriever is not None else 1
        self.k = k
        self.sampling_params = sampling_params or SamplingParams(max_tokens=96, temperature=0.0)
        self.chat_template = chat_template  # a tokenizer with apply_chat_template, or None for plain text
        self.max_concurrency = max_concurrency
        self.recall_ks = recall_ks

    def _render(self, prompt: str) -> str:
        if self.chat_template is None or not getattr(self.chat_template, "chat_template", None):
            return prompt
        return self.chat_template.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)

    async def answer(self, ex: QAExample,
                     on_iteration: Callable[[IterationRecord], Awaitable[None] | None] | None = None) -> QARecord:
        """One question; `on_iteration` (if given) sees each iteration's record as soon as it is done."""
        rec = QARecord(ex.id, ex.question, list(ex.golden_answers), ex.type, list(ex.supporting_titles))
        start = time.perf_counter()
        previous = ""
        retrieved: list[tuple[Passage, float]] = []
        for t in range(1, self.iterations + 1):
            query = f"{previous} {ex.question}".strip() if t > 1 else ex.question
            t0 = time.perf_counter()
            if self.retriever is not None:
                retrieved = await self.retriever.asearch(query, self.k)
            t1 = time.perf_counter()
            prompt = self._render(build_prompt(ex.question, [p for p, _ in retrieved]
                                               if self.retriever is not None else None))
            out = await self.engine.generate(prompt, self.sampling_params)
            t2 = time.perf_counter()
            previous = out.text.strip()
            rec.iterations.append(IterationRecord(
                t, query, [{"id": p.id, "title": p.title, "score": float(s)} for p, s in retrieved], prompt,
                previous, extract_answer(previous), t1 - t0, t2 - t1))
            if on_iteration is not None:
                done = on_iteration(rec.iterations[-1])
                if done is not None:
                    await done
        rec.latency_s = time.perf_counter() - start
        rec.prediction = rec.iterations[-1].answer
        rec.em = exact_match(rec.prediction, rec.golden_answers)
        rec.f1 = f1_score(rec.prediction, rec.golden_answers)
        if self.retriever is not None:
            titles = [p.title for p, _ in retrieved]
            rec.recall = {f"recall@{k}": recall_at_k(titles, rec.supporting_titles, k) for k in self.recall_ks
                          if k <= self.k}
        return rec

    async def _guarded(self, ex: QAExample, sem: asyncio.Semaphore | None) -> QARecord:
        try:
            if sem is None:
                return await self.answer(ex)
            async with sem:
                return await self.answer(ex)
        except (ValueError, RuntimeError) as exc:  # one bad question must not sink the run
            logger.warning("question %s failed: %s", ex.id, exc)
            return QARecord(ex.id, ex.question, list(ex.golden_answers), ex.type, list(ex.supporting_titles),
                            error=f"{type(exc).__name__}: {exc}")

    async def run(self, examples: Sequence[QAExample], progress: bool = True) -> list[QARecord]:
        """Answer every question concurrently (not lock-step over the dataset); records in input order."""
        sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        tasks = [asyncio.ensure_future(self._guarded(ex, sem)) for ex in examples]
        bar = tqdm(total=len(tasks), desc="questions", disable=not progress)
        for fut in asyncio.as_completed(tasks):
            await fut
            bar.update(1)
        bar.close()
        return [t.result() for t in tasks]
