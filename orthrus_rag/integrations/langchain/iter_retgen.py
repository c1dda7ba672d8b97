"""Every RAG method as a LangChain `Runnable` (`RAGRunnable(method="ircot")`; `IterRetGenRunnable` is Iter-RetGen's):
`invoke` / `ainvoke` answer one question, `batch` / `abatch` answer many concurrently (their embeddings and
generations meet in the engine's steps), `stream` / `astream` yield one event per step as it finishes and then the
final record. The methods are the project's own (orthrus_rag/pipelines/)."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

from langchain_core.runnables import Runnable, RunnableConfig

from orthrus_rag.data.types import QAExample
from orthrus_rag.integrations.langchain.chat_models import ChatOrthrus
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.registry import make_method

T = TypeVar("T")
QuestionInput = str | dict[str, Any]


class _ChatGenerator:
    """A method's generator over a `ChatOrthrus`'s transport: each prompt is one user message, rendered by
    the model's chat template on the serving side (in-process or the server). Asked for logprobs (FLARE), it
    returns each token's text and probability from the response's."""

    def __init__(self, chat: ChatOrthrus) -> None:
        self.chat = chat

    async def generate(self, prompt: str, params: SamplingParams | None = None) -> Any:
        params = params or SamplingParams()
        transport = self.chat.transport
        body = await transport.achat({
            "model": params.adapter or self.chat.model or transport.generation_model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            **({"seed": params.seed} if params.seed is not None else {}),
            **({"stop": list(params.stop)} if params.stop else {}),
            **({"structured_outputs": params.structured_outputs.as_request()} if params.structured_outputs else {}),
            **({"logprobs": True} if params.logprobs is not None else {})})
        choice = body["choices"][0]
        content = (choice.get("logprobs") or {}).get("content")
        pieces = [(c["token"], math.exp(c["logprob"])) for c in content] if content is not None else None
        return _Text(choice["message"]["content"] or "", pieces, (body.get("usage") or {}).get("completion_tokens", 0))


class _Text:
    def __init__(self, text: str, pieces: list[tuple[str, float]] | None = None, num_tokens: int = 0) -> None:
        self.text = text
        self.num_tokens = num_tokens  # the response's completion tokens (a question's generated tokens count them)
        if pieces is not None:  # NOTE: absent, not None, when not asked for: FLARE then says it needs logprobs
            self.pieces = pieces


def _example(value: QuestionInput, index: int = 0) -> QAExample:
    if isinstance(value, str):
        return QAExample(f"q{index}", value, [])
    if isinstance(value, dict) and isinstance(value.get("question"), str):
        return QAExample(str(value.get("id", f"q{index}")), value["question"], list(value.get("answers", [])))
    raise TypeError("a RAG method takes a question string or a dict with a 'question' (and optional 'answers', 'id')")


class RAGRunnable(Runnable[QuestionInput, dict[str, Any]]):
    """`retriever`: an `OrthrusRetriever` or a `DenseRetriever`; `chat`: the `ChatOrthrus` that generates;
    `method`: a name of `orthrus_rag.pipelines.PIPELINES` (iter_retgen, standard_rag, no_retrieval, ircot, flare,
    self_ask), `options` its own settings (`iterations`; `max_steps`, `max_passages`, `step_tokens`; `threshold`;
    `max_follow_ups`, `force_follow_up`). Output: the question's record (`prediction`, `iterations` with each
    step's query, passages and output, EM/F1 when answers were given)."""

    def __init__(self, retriever: Any, chat: ChatOrthrus, method: str = "iter_retgen", k: int = 5,
                 max_tokens: int = 96, temperature: float = 0.0, answer_format: str = "free",
                 generation_adapter: str | None = None, **options: Any) -> None:
        dense = getattr(retriever, "retriever", retriever)
        self.pipeline = make_method(method, _ChatGenerator(chat), dense, k=k,
                                    sampling_params=SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                   adapter=generation_adapter),
                                    answer_format=answer_format, **options)

    # ---- async -------------------------------------------------------------------------------------------------
    async def ainvoke(self, input: QuestionInput, config: RunnableConfig | None = None,
                      **kwargs: Any) -> dict[str, Any]:
        return (await self.pipeline.answer(_example(input))).to_json()

    async def abatch(self, inputs: Sequence[QuestionInput], config: RunnableConfig | list[RunnableConfig] | None = None,
                     *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        tasks = [self.pipeline.answer(_example(x, i)) for i, x in enumerate(inputs)]
        records = await asyncio.gather(*tasks, return_exceptions=return_exceptions)
        return [r if isinstance(r, BaseException) else r.to_json() for r in records]

    async def astream(self, input: QuestionInput, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def _on_iteration(it: Any) -> None:
            await events.put({"event": "iteration", **asdict(it)})

        async def _run() -> None:
            rec = await self.pipeline.answer(_example(input), on_iteration=_on_iteration)
            await events.put({"event": "final", **rec.to_json()})

        task = asyncio.ensure_future(_run())
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    task.result()  # raises the pipeline's error
                    continue
                event = getter.result()
                yield event
                if event["event"] == "final":
                    return
        finally:
            task.cancel()

    # ---- sync: the same coroutines on a private loop (works from inside a running loop too) ------------------
    def invoke(self, input: QuestionInput, config: RunnableConfig | None = None, **kwargs: Any) -> dict[str, Any]:
        return _run_sync(self.ainvoke(input, config))

    def batch(self, inputs: list[QuestionInput], config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return _run_sync(self.abatch(inputs, return_exceptions=return_exceptions))

    def stream(self, input: QuestionInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[dict[str, Any]]:
        items: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def _pump() -> None:
            async for event in self.astream(input, config):
                items.put(("event", event))

        def _main() -> None:
            try:
                asyncio.run(_pump())
                items.put(("done", None))
            except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer)
                items.put(("error", exc))

        threading.Thread(target=_main, name="iter-retgen-stream", daemon=True).start()
        while True:
            tag, value = items.get()
            if tag == "error":
                raise value
            if tag == "done":
                return
            yield value


class IterRetGenRunnable(RAGRunnable):
    """Iter-RetGen's runnable: `RAGRunnable(method="iter_retgen", iterations=...)`."""

    def __init__(self, retriever: Any, chat: ChatOrthrus, iterations: int = 2, k: int = 5, max_tokens: int = 96,
                 temperature: float = 0.0, answer_format: str = "free", generation_adapter: str | None = None) -> None:
        super().__init__(retriever, chat, "iter_retgen", k, max_tokens, temperature, answer_format,
                         generation_adapter, iterations=iterations)


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` in a helper thread, so a caller inside a running event loop is not refused."""
    result: dict[str, Any] = {}

    def _main() -> None:
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            result["error"] = exc

    thread = threading.Thread(target=_main, name="iter-retgen", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
