"""Iter-RetGen (Shao et al., 2023), standard RAG and no-retrieval, through any `EngineClient`.

Iteration t retrieves with the previous generation placed before the question (y_{t-1} || q), then generates
from the retrieved paragraphs and the question (the previous output is not in the prompt). Questions run
concurrently (not lock-step over the dataset), so query embeddings of some questions share engine steps with
generations of others; at most `max_concurrency` at a time, the rest wait for a free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

from orthrus_rag.data.types import Passage, QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.answers import final_constraint, parse_final
from orthrus_rag.pipelines.evaluate import answer_scores, recall_at_k
from orthrus_rag.pipelines.prompts import build_prompt
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.kinds import Retriever

logger = logging.getLogger(__name__)
PIPELINES = ("iter_retgen", "standard_rag", "no_retrieval")
REQUESTS_PER_QUESTION = 1  # a question waits on one query embedding or one generation at a time


def default_concurrency(max_in_flight: int, max_num_seqs: int | None = None) -> int:
    """Questions in flight by default: never more than the backend admits (`max_in_flight` requests: the
    engine client's limit), so none fails for lack of room; and, with the engine's
    batch size known, twice that: enough to keep every step full while some questions retrieve. More only queues
    in the engine, and then questions all finish near the end of a run instead of steadily."""
    n = max_in_flight // REQUESTS_PER_QUESTION
    if max_num_seqs:
        n = min(n, 2 * max_num_seqs)
    return max(1, n)


def _is_fatal(exc: BaseException) -> bool:
    """The serving system is gone (shut down, a dead worker): stop the run rather than fail every question."""
    from orthrus_rag.engine.clients.protocol import ClientFailed, EngineShutdown

    return isinstance(exc, (EngineShutdown, ClientFailed))


def _is_retryable(exc: BaseException) -> bool:
    """The question failed for the serving system's reason (the replica holding it died), not its own."""
    from orthrus_rag.engine.clients.protocol import EngineUnavailable

    return isinstance(exc, EngineUnavailable)


def check_settings(iterations: int = 1, k: int = 1, max_concurrency: int | None = None,
                   question_timeout_s: float | None = None) -> None:
    """The rules of Iter-RetGen's settings (the CLI's `validate` asks them here too, before anything loads)."""
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1 (or null: sized from the serving system), "
                         f"got {max_concurrency}")
    if question_timeout_s is not None and question_timeout_s <= 0:
        raise ValueError(f"question_timeout_s must be positive (or null: no limit), got {question_timeout_s}")


class IterRetGen:
    """`iterations=1` is standard RAG; `retriever=None` is no retrieval (one generation from the question).

    `max_concurrency`: questions in flight (None: sized from the engine, see `default_concurrency`);
    `question_timeout_s`: a question still unanswered this long after it started is recorded as failed and its
    requests are aborted (None: no limit); `answer_format`: free | constrained | json, how the final iteration
    writes its answer (answers.py)."""

    def __init__(self, client: EngineClient, retriever: Retriever | None, iterations: int = 2, k: int = 5,
                 sampling_params: SamplingParams | None = None, chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free") -> None:
        check_settings(iterations, k, max_concurrency, question_timeout_s)
        self.client = client  # NOTE: only its `generate` and `max_in_flight` are used (LangChain passes a chat model's)
        self.retriever = retriever
        self.iterations = iterations if retriever is not None else 1
        self.k = k
        self.sampling_params = sampling_params or SamplingParams(max_tokens=96, temperature=0.0)
        self.chat_template = chat_template  # a tokenizer with apply_chat_template, or None for plain text
        capacity = getattr(client, "max_in_flight", None) or 64
        self.max_concurrency = max_concurrency or default_concurrency(capacity)
        self.recall_ks = recall_ks
        self.question_timeout_s = question_timeout_s
        # the final iteration's generation under the answer format's constraint (answers.py)
        self.answer_format = answer_format
        constraint = final_constraint(answer_format, self.sampling_params.max_tokens)
        self.final_params = (self.sampling_params if constraint is None
                             else dataclasses.replace(self.sampling_params, structured_outputs=constraint))

    def _render(self, prompt: str) -> str:
        if self.chat_template is None or not getattr(self.chat_template, "chat_template", None):
            return prompt
        return self.chat_template.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)

    async def answer(self, ex: QAExample,
                     on_iteration: Callable[[IterationRecord], Awaitable[None] | None] | None = None) -> QARecord:
        """One question; `on_iteration` (if given) sees each iteration's record as soon as it is done."""
        rec = _new_record(ex)
        await self._answer_into(rec, ex, on_iteration)
        return rec

    async def _answer_into(self, rec: QARecord, ex: QAExample,
                           on_iteration: Callable[[IterationRecord], Awaitable[None] | None] | None = None) -> None:
        """Fill `rec` iteration by iteration (a timed-out question keeps the iterations it finished)."""
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
            final = t == self.iterations
            out = await self.client.generate(prompt, self.final_params if final else self.sampling_params)
            t2 = time.perf_counter()
            previous = out.text.strip()
            parsed = parse_final(previous, self.answer_format if final else "free", ex.question)
            rec.iterations.append(IterationRecord(
                t, query, [{"id": p.id, "title": p.title, "score": float(s)} for p, s in retrieved], prompt,
                previous, parsed.answer, t1 - t0, t2 - t1, parsed.found))
            if on_iteration is not None:
                done = on_iteration(rec.iterations[-1])
                if done is not None:
                    await done
        rec.latency_s = time.perf_counter() - start
        rec.prediction = rec.iterations[-1].answer
        for name, value in answer_scores(rec.prediction, rec.golden_answers).items():
            setattr(rec, name, value)
        if self.retriever is not None:
            titles = [p.title for p, _ in retrieved]
            rec.recall = {f"recall@{k}": recall_at_k(titles, rec.supporting_titles, k) for k in self.recall_ks
                          if k <= self.k}

    async def _guarded(self, index: int, ex: QAExample) -> QARecord:
        """One question's record; a failure of this question (bad input, a failed request, the timeout) is
        recorded in it. A failure of the serving system as a whole propagates and stops the run."""
        rec = _new_record(ex)
        rec.index = index
        try:
            await asyncio.wait_for(self._answer_into(rec, ex), self.question_timeout_s)
        except asyncio.TimeoutError:  # NOTE: wait_for cancelled the question: its engine requests were aborted
            logger.warning("question %s timed out after %g s", ex.id, self.question_timeout_s)
            rec.error = (f"TimeoutError: no answer within {self.question_timeout_s:g} s "
                         "(pipeline.question_timeout_s); its requests were aborted")
            rec.retryable = True
        except (ValueError, RuntimeError) as exc:  # one bad question must not sink the run
            if _is_fatal(exc):
                raise
            logger.warning("question %s failed: %s", ex.id, exc)
            rec.error = f"{type(exc).__name__}: {exc}"
            rec.retryable = _is_retryable(exc)
        return rec

    async def stream(self, examples: Iterable[tuple[int, QAExample]]) -> AsyncIterator[QARecord]:
        """Answer `(index, example)` pairs, at most `max_concurrency` at a time, pulling the next example only when
        a slot frees (memory stays bounded however many there are); yield each record as it finishes. Closing the
        stream early cancels the questions in flight and aborts their requests."""
        source = iter(examples)
        pending: set[asyncio.Task[QARecord]] = set()

        def refill() -> None:
            while len(pending) < self.max_concurrency:
                item = next(source, None)
                if item is None:
                    return
                pending.add(asyncio.ensure_future(self._guarded(*item)))

        try:
            refill()
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                pending.difference_update(done)
                for task in sorted(done, key=lambda t: -1 if t.exception() else t.result().index):
                    yield task.result()  # NOTE: raises a failure of the serving system (see _guarded)
                refill()
        finally:
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)

    async def run(self, examples: Sequence[QAExample]) -> list[QARecord]:
        """Answer every question (concurrently, see `stream`); records in input order."""
        records: list[QARecord | None] = [None] * len(examples)
        async with contextlib.aclosing(self.stream(enumerate(examples))) as stream:
            async for rec in stream:
                records[rec.index] = rec
        return [r for r in records if r is not None]


def _new_record(ex: QAExample) -> QARecord:
    return QARecord(ex.id, ex.question, list(ex.golden_answers), ex.type, list(ex.supporting_titles))
