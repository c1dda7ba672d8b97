"""What every RAG method shares, so that a method is one file stating its loop (FlashRAG's `pipeline.run(dataset)`
is the model): questions run concurrently (not lock-step over the dataset), so query embeddings of some questions
share engine steps with generations of others; at most `max_concurrency` at a time, the rest wait for a slot; a
question's failure, timeout or retry is recorded in its record; every step of its loop is an `IterationRecord`.

A method subclasses `Method` and writes `_loop(rec, ex, emit)`: it retrieves with `self.retrieve`, generates with
`self.generate`, appends one `IterationRecord` per step (`emit` shows it to a caller as soon as it is done) and
returns the passages its answer was read from (for recall); `Method` parses nothing else and scores the last
step's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

from orthrus_rag.data.types import Passage, QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.answers import final_constraint
from orthrus_rag.pipelines.evaluate import answer_scores, recall_at_k
from orthrus_rag.pipelines.flashrag_prompts import check_prompt_style
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.pipelines.rerank import Reranking
from orthrus_rag.retrievers.kinds import Retriever

logger = logging.getLogger(__name__)
REQUESTS_PER_QUESTION = 1  # a question waits on one query embedding or one generation at a time
Hits = list[tuple[Passage, float]]
OnIteration = Callable[[IterationRecord], Awaitable[None] | None]
# the record of the question whose loop is running: `Method.generate` counts its generated tokens there (a
# question's sub-tasks, e.g. Self-Ask's, inherit it), so no method has to pass the count along
_QUESTION: contextvars.ContextVar[QARecord | None] = contextvars.ContextVar("orthrus_question", default=None)


def generated_tokens(out: Any) -> int:
    """Tokens a generation produced: its ids (this engine's outputs, the peers'), else a chat response's count."""
    ids = getattr(out, "token_ids", None)
    return len(ids) if ids is not None else int(getattr(out, "num_tokens", 0) or 0)


def prefilled_tokens(out: Any) -> int:
    """Prompt tokens a generation computed: its prompt less what the prefix cache served (0 where the output carries
    no prompt ids: a remote server's)."""
    return max(0, len(getattr(out, "prompt_token_ids", None) or ()) - int(getattr(out, "num_cached_tokens", 0) or 0))


def default_concurrency(max_in_flight: int, max_num_seqs: int | None = None) -> int:
    """Questions in flight by default: never more than the backend admits (`max_in_flight` requests: the
    engine client's limit), so none fails for lack of room; and, with the engine's
    batch size known, twice that: enough to keep every step full while some questions retrieve. More only queues
    in the engine, and then questions all finish near the end of a run instead of steadily."""
    n = max_in_flight // REQUESTS_PER_QUESTION
    if max_num_seqs:
        n = min(n, 2 * max_num_seqs)
    return max(1, n)


def check_settings(iterations: int = 1, k: int = 1, max_concurrency: int | None = None,
                   question_timeout_s: float | None = None) -> None:
    """The rules of the shared settings (the CLI's `validate` asks them here too, before anything loads)."""
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1 (or null: sized from the serving system), "
                         f"got {max_concurrency}")
    if question_timeout_s is not None and question_timeout_s <= 0:
        raise ValueError(f"question_timeout_s must be positive (or null: no limit), got {question_timeout_s}")


def _is_fatal(exc: BaseException) -> bool:
    """The serving system is gone (shut down, a dead worker): stop the run rather than fail every question."""
    from orthrus_rag.engine.clients.protocol import ClientFailed, EngineShutdown

    return isinstance(exc, (EngineShutdown, ClientFailed))


def _is_retryable(exc: BaseException) -> bool:
    """The question failed for the serving system's reason (the replica holding it died), not its own."""
    from orthrus_rag.engine.clients.protocol import EngineUnavailable

    return isinstance(exc, EngineUnavailable)


def add_new(held: Hits, hits: Hits, limit: int | None = None) -> Hits:
    """`held` and, after it, the passages of `hits` it does not hold yet (by id), `limit` in all at most."""
    ids = {p.id for p, _ in held}
    fresh = [h for h in hits if h[0].id not in ids]
    return held + (fresh if limit is None else fresh[: max(0, limit - len(held))])


def passage_refs(hits: Hits) -> list[dict[str, Any]]:
    """Retrieved passages as a record keeps them."""
    return [{"id": p.id, "title": p.title, "score": float(s)} for p, s in hits]


class Method:
    """The shared part of a method. `retriever=None`: no retrieval (a method may refuse it).

    `max_concurrency`: questions in flight (None: sized from the engine, see `default_concurrency`);
    `question_timeout_s`: a question still unanswered this long after it started is recorded as failed and its
    requests are aborted (None: no limit); `answer_format`: free | constrained | json, how the final generation
    writes its answer (answers.py); `prompt_style`: native | flashrag, whose prompts the methods that have FlashRAG's
    send and whose answer extraction they apply (flashrag_prompts.py; a method without FlashRAG's keeps its own)."""

    name = "method"

    def __init__(self, client: EngineClient, retriever: Retriever | None, k: int = 5,
                 sampling_params: SamplingParams | None = None, chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free",
                 prompt_style: str = "native") -> None:
        check_settings(1, k, max_concurrency, question_timeout_s)
        check_prompt_style(prompt_style, answer_format)
        self.client = client  # NOTE: only its `generate` and `max_in_flight` are used (LangChain passes a chat model's)
        self.retriever = retriever
        self.k = k
        self.sampling_params = sampling_params or SamplingParams(max_tokens=96, temperature=0.0)
        self.chat_template = chat_template  # a tokenizer with apply_chat_template, or None for plain text
        capacity = getattr(client, "max_in_flight", None) or 64
        self.max_concurrency = max_concurrency or default_concurrency(capacity)
        self.recall_ks = recall_ks
        self.question_timeout_s = question_timeout_s
        # the final generation under the answer format's constraint (answers.py)
        self.answer_format = answer_format
        self.prompt_style = prompt_style
        # a reranking stage between the retriever and the prompts (rerank.py; `make_method` attaches it): each
        # retrieval scores its candidates and keeps the best `k`
        self.reranker: Reranking | None = None
        constraint = final_constraint(answer_format, self.sampling_params.max_tokens)
        self.final_params = (self.sampling_params if constraint is None
                             else dataclasses.replace(self.sampling_params, structured_outputs=constraint))

    # ---- what a method's loop uses ---------------------------------------------------------------------------
    def render(self, prompt: str) -> str:
        """The prompt as the model reads it: a user turn of the chat template (generation prompt added), or as is."""
        return self.render_messages([{"role": "user", "content": prompt}])

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """Chat messages as the model reads them: through the chat template (generation prompt added), or, without
        one, their contents joined by a blank line (FlashRAG's plain form; a single message is itself)."""
        if self.chat_template is None or not getattr(self.chat_template, "chat_template", None):
            return "\n\n".join(m["content"] for m in messages if m["content"])
        return self.chat_template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def retrieve(self, query: str, k: int | None = None) -> tuple[Hits, float]:
        """The top `k` (default `self.k`) passages for `query`, and the seconds it took (embedding and search, and
        with a reranker the scoring of its candidates)."""
        t0 = time.perf_counter()
        k = k or self.k
        if self.retriever is None:
            return [], time.perf_counter() - t0
        if self.reranker is None:
            return await self.retriever.asearch(query, k), time.perf_counter() - t0
        hits = await self.retriever.asearch(query, max(k, self.reranker.candidates))
        return await self.reranker.rerank(query, hits, k), time.perf_counter() - t0

    async def generate(self, prompt: str, params: SamplingParams | None = None,
                       request_id: str | None = None) -> tuple[Any, float]:
        """One generation (default: the method's sampling parameters), and the seconds it took."""
        t0 = time.perf_counter()
        if request_id is None:  # NOTE: LangChain's chat adapter takes no request id
            out = await self.client.generate(prompt, params or self.sampling_params)
        else:
            out = await self.client.generate(prompt, params or self.sampling_params, request_id=request_id)
        self._count(out)
        return out, time.perf_counter() - t0

    @property
    def can_continue(self) -> bool:
        """Whether the client continues a finished generation with its KV kept (the in-process engine's
        `continue_`, a remote server's through `RemoteClient` given the tokenizer); else a method re-submits the
        whole text."""
        return callable(getattr(self.client, "continue_", None)) and getattr(self.client, "can_continue", True)

    async def continue_(self, request_id: str, appended: str, params: SamplingParams) -> tuple[Any, float]:
        """Continue the finished generation `request_id` (it set `hold_kv_s`) with `appended` (engine/continuation.py),
        and the seconds it took."""
        t0 = time.perf_counter()
        out = await self.client.continue_(request_id, appended, params)
        self._count(out)
        return out, time.perf_counter() - t0

    @staticmethod
    def _count(out: Any) -> None:
        rec = _QUESTION.get()
        if rec is not None:
            rec.generated_tokens += generated_tokens(out)
            rec.prefilled_tokens += prefilled_tokens(out)

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        """The method: fill `rec.iterations` step by step (each passed to `emit`); return the passages the answer
        was read from. Subclasses write it."""
        raise NotImplementedError

    # ---- the shared plumbing ---------------------------------------------------------------------------------
    async def answer(self, ex: QAExample, on_iteration: OnIteration | None = None) -> QARecord:
        """One question; `on_iteration` (if given) sees each step's record as soon as it is done."""
        rec = _new_record(ex)
        await self._answer_into(rec, ex, on_iteration)
        return rec

    async def _answer_into(self, rec: QARecord, ex: QAExample, on_iteration: OnIteration | None = None) -> None:
        """Fill `rec` step by step (a timed-out question keeps the steps it finished), then score it."""
        start = time.perf_counter()

        async def emit(step: IterationRecord) -> None:
            rec.iterations.append(step)
            if on_iteration is not None:
                done = on_iteration(step)
                if done is not None:
                    await done

        token = _QUESTION.set(rec)
        try:
            passages = await self._loop(rec, ex, emit)
        finally:
            _QUESTION.reset(token)
        rec.latency_s = time.perf_counter() - start
        rec.prediction = rec.iterations[-1].answer if rec.iterations else ""
        for name, value in answer_scores(rec.prediction, rec.golden_answers).items():
            setattr(rec, name, value)
        if self.retriever is not None:
            titles = [p.title for p, _ in passages]
            rec.recall = {f"recall@{k}": recall_at_k(titles, rec.supporting_titles, k) for k in self.recall_ks
                          if k <= self.k}
            if len(titles) > self.k:  # NOTE: a method that gathers passages over its steps (IRCoT): all it read
                rec.recall["recall@used"] = recall_at_k(titles, rec.supporting_titles, len(titles))

    async def answer_recorded(self, index: int, ex: QAExample, on_iteration: OnIteration | None = None) -> QARecord:
        """One question's record; a failure of this question (bad input, a failed request, the timeout) is
        recorded in it. A failure of the serving system as a whole propagates and stops the run."""
        rec = _new_record(ex)
        rec.index = index
        try:
            await asyncio.wait_for(self._answer_into(rec, ex, on_iteration), self.question_timeout_s)
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
                pending.add(asyncio.ensure_future(self.answer_recorded(*item)))

        try:
            refill()
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                pending.difference_update(done)
                for task in sorted(done, key=lambda t: -1 if t.exception() else t.result().index):
                    yield task.result()  # NOTE: raises a failure of the serving system (see answer_recorded)
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
