"""`orthrus-rag ask "question" retriever.index_dir=... [pipeline=...]`: one question (or, without one, a prompt that
reads questions until end of input) answered from the shell over an index of your own documents, with any method.

Every generation streams its text as the engine writes it; after each step come the passages its search retrieved,
numbered, and at the end the answer and the sources it was read from. The log goes to stderr, so stdout holds only
the question's transcript.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TextIO

from orthrus_rag.data.types import QAExample
from orthrus_rag.outputs import GenerationOutput
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.records import IterationRecord, QARecord

logger = logging.getLogger(__name__)
PROMPT = "question> "
QUIT = ("exit", "quit")


class StreamingClient:
    """An `EngineClient` whose generations (and continuations) stream their new text to `write` as it comes, each
    ending with a new line; everything else is the wrapped client's."""

    def __init__(self, client: Any, write: Callable[[str], None]) -> None:
        self.client, self.write = client, write
        if callable(getattr(client, "continue_stream", None)):
            self.continue_ = self._continue

    def __getattr__(self, name: str) -> Any:
        if name in ("continue_", "can_continue"):  # NOTE: only a streamed continuation (set in __init__) is offered
            raise AttributeError(name)
        return getattr(self.client, name)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> GenerationOutput:
        return await self._show(self.client.generate_stream(prompt, params, request_id=request_id))

    async def _continue(self, request_id: str, appended: Any = (), params: SamplingParams | None = None,
                        ) -> GenerationOutput:
        return await self._show(self.client.continue_stream(request_id, appended, params))

    async def _show(self, snapshots: AsyncIterator[GenerationOutput]) -> GenerationOutput:
        sent, final = "", None
        async for snap in snapshots:
            if snap.text.startswith(sent) and len(snap.text) > len(sent):
                self.write(snap.text[len(sent):])
                sent = snap.text
            final = snap
        self.write("\n")
        assert final is not None and final.finished, "a stream ends with its finished output"
        return final


def show_step(step: IterationRecord, out: TextIO) -> None:
    """A step's search and its numbered passages (nothing for a step that did not retrieve)."""
    if not step.retrieved:
        return
    out.write(f"  [search] {step.query}\n")
    for n, hit in enumerate(step.retrieved, start=1):
        out.write(f"    [{n}] {hit['title'] or hit['id']}  ({hit['score']:.3f})\n")
    out.flush()


def show_answer(rec: QARecord, out: TextIO) -> None:
    if rec.error is not None:
        out.write(f"failed: {rec.error}\n")
        return
    out.write(f"answer: {rec.prediction}\n")
    titles = list(dict.fromkeys(hit["title"] or hit["id"] for step in rec.iterations for hit in step.retrieved))
    if titles:
        out.write("sources: " + "; ".join(f"[{n}] {t}" for n, t in enumerate(titles, start=1)) + "\n")
    out.flush()


def check_ask(cfg: Any) -> None:
    if cfg.pipeline.name != "no_retrieval" and cfg.retriever.index_dir is None:
        raise ValueError("orthrus-rag ask searches an index of your documents: give retriever.index_dir=<folder> "
                         "(built by `orthrus-rag index`), or pipeline=no_retrieval")


def ask(cfg: Any, question: str | None, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Answer `question` (None: each line of `stdin` until end of input or "exit") with the configured method over
    `retriever.index_dir`; the transcript goes to `out`. Returns the exit code (1 if a question failed)."""
    from orthrus_rag.entrypoints.checks import validate
    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.commands import build_pipeline, build_retriever

    stdin, out = stdin or sys.stdin, out or sys.stdout
    if question is not None and not question.strip():
        raise ValueError("the question is empty")
    validate(cfg)
    check_ask(cfg)
    client = build_client(cfg)
    try:
        # NOTE: opened before the event loop starts (blocking calls on the engine, as `run` does)
        retriever = build_retriever(cfg, client, [], None) if cfg.pipeline.name != "no_retrieval" else None
        method = build_pipeline(cfg, StreamingClient(client, lambda text: (out.write(text), out.flush())), retriever)
    except BaseException:
        asyncio.run(client.aclose())
        raise
    return asyncio.run(_answer_all(method, client, None if question is None else [question], stdin, out))


async def _answer_all(method: Any, client: Any, given: list[str] | None, stdin: TextIO, out: TextIO) -> int:
    """Each question in turn; the client is closed on this loop (the one it is bound to) when they are done."""
    code, n = 0, 0
    try:
        while True:
            if given is not None:
                if n == len(given):
                    return code
                question = given[n]
            else:
                out.write(PROMPT)
                out.flush()
                line = await asyncio.to_thread(stdin.readline)
                if not line or line.strip().lower() in QUIT:
                    out.write("\n" if not line else "")
                    return code
                question = line.strip()
                if not question:
                    continue
            n += 1
            # NOTE: as a run records a question: its own failure (too long, a timeout) is in the record and the
            # prompt goes on; a failure of the serving system stops `ask`
            rec = await method.answer_recorded(n, QAExample(f"ask-{n}", question, []),
                                               lambda step: show_step(step, out))
            if rec.error is not None:
                out.write("\n")
            show_answer(rec, out)
            code = max(code, 1 if rec.error is not None else 0)
    finally:
        await client.aclose()
