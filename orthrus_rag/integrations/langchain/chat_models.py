"""`ChatOrthrus`: a LangChain chat model served by the co-scheduled engine (in-process or by base URL), with
streaming and usage metadata. The model's chat template renders the messages (server side)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import Field

from orthrus_rag.integrations.langchain._base import OrthrusConnection

_ROLES = {HumanMessage: "user", SystemMessage: "system", AIMessage: "assistant", ToolMessage: "tool"}


def _message(msg: BaseMessage) -> dict[str, Any]:
    role = msg.role if isinstance(msg, ChatMessage) else next(
        (r for cls, r in _ROLES.items() if isinstance(msg, cls)), None)
    if role is None:
        raise ValueError(f"ChatOrthrus cannot send a {type(msg).__name__}")
    out: dict[str, Any] = {"role": role, "content": msg.content}
    if msg.name:
        out["name"] = msg.name
    return out


def _usage(usage: dict[str, Any] | None) -> UsageMetadata | None:
    if not usage:
        return None
    return UsageMetadata(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                         total_tokens=usage["total_tokens"])


class ChatOrthrus(OrthrusConnection, BaseChatModel):
    """Chat completions from the engine that also serves the embeddings, so a chain's retrieval and generation
    share its steps.

    ```python
    chat = ChatOrthrus(engine=engine, max_tokens=64, temperature=0)          # in-process
    chat = ChatOrthrus(base_url="http://127.0.0.1:8000/v1")                  # against `orthrus-rag serve`
    chat.invoke("Name the three primary colours.")
    ```
    `with_structured_output(schema)` constrains decoding to a pydantic model's or a JSON schema's shape (the
    server's `response_format`), so the output always parses. Tool calling and images are not supported (the
    server answers 400).
    """

    model: str | None = Field(default=None, alias="model_name")
    """The served generation model's name; None: the server's."""
    temperature: float | None = None
    """Sampling temperature (OpenAI default 1; 0 is greedy)."""
    max_tokens: int | None = None
    """Most tokens to generate; None: the server's default."""
    top_p: float | None = None
    """Nucleus sampling mass."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings (not included in the output)."""
    seed: int | None = None
    """Seed of the sampler: equal seeds give equal samples."""
    streaming: bool = False
    """`invoke` streams under the hood (callbacks get each token)."""

    @property
    def _llm_type(self) -> str:
        return "orthrus-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "seed": self.seed, "base_url": self.base_url}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="orthrus", ls_model_type="chat",
                                 ls_model_name=kwargs.get("model") or self.model or "orthrus")
        if self.temperature is not None:
            params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if self.max_tokens is not None:
            params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def with_structured_output(self, schema: dict | type, *, include_raw: bool = False,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               strict: bool | None = None, **kwargs: Any) -> Runnable:
        """A runnable that returns `schema`'s instance (pydantic model) or a dict (JSON schema, TypedDict).

        `method="json_schema"` (the default) constrains the tokens to the schema itself, and so does
        `"function_calling"` (there is no tool calling: the schema's arguments come from the same constraint);
        `"json_mode"` only to some JSON object (the prompt must ask for the keys). `include_raw`: return
        `{"raw": AIMessage, "parsed": ..., "parsing_error": ...}` instead of raising on a parse failure.
        `strict` is accepted for OpenAI compatibility: the schema is always enforced (a constrained decoder has no
        weaker mode)."""
        if kwargs:
            raise ValueError(f"unexpected arguments {', '.join(sorted(kwargs))}; ChatOrthrus takes include_raw, "
                             "method and strict")
        json_schema = convert_to_json_schema(schema)
        if method in ("json_schema", "function_calling"):
            # NOTE: no tool calling here; a tool's arguments are what constrained decoding to its schema gives
            response_format = {"type": "json_schema", "json_schema": {
                "name": json_schema.get("title", "output"), "schema": json_schema, "strict": strict is not False}}
        elif method == "json_mode":
            response_format = {"type": "json_object"}
        else:
            raise ValueError(f"method {method!r} is not supported: use 'json_schema', 'function_calling' (the same "
                             "constraint) or 'json_mode'")
        llm = self.bind(response_format=response_format,
                        ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                     "schema": json_schema})
        is_model = isinstance(schema, type) and is_basemodel_subclass(schema)  # pydantic 2 or 1
        parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    def _payload(self, messages: list[BaseMessage], stop: list[str] | None, **kwargs: Any) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": kwargs.pop("model", None) or self.model or self.transport.generation_model,
            "messages": [_message(m) for m in messages]}
        for key in ("temperature", "max_tokens", "top_p", "seed"):
            value = kwargs.pop(key, getattr(self, key))
            if value is not None:
                payload[key] = value
        stops = stop if stop is not None else self.stop
        if stops:
            payload["stop"] = list(stops)
        payload.update(kwargs)  # anything else (e.g. tools) goes to the server, which says what it refuses
        return payload

    @staticmethod
    def _result(body: dict[str, Any]) -> ChatResult:
        usage = _usage(body.get("usage"))
        generations = []
        for choice in body["choices"]:
            meta = {"finish_reason": choice.get("finish_reason"), "model_name": body.get("model")}
            if choice.get("logprobs"):
                meta["logprobs"] = choice["logprobs"]
            msg = AIMessage(content=choice["message"]["content"] or "", usage_metadata=usage,
                            response_metadata=meta, id=body.get("id"))
            generations.append(ChatGeneration(message=msg, generation_info=meta))
        return ChatResult(generations=generations, llm_output={"model_name": body.get("model"),
                                                               "token_usage": body.get("usage")})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            chunks = list(self._stream(messages, stop, run_manager, **kwargs))
            return ChatResult(generations=[_merge(chunks)])
        return self._result(self.transport.chat(self._payload(messages, stop, **kwargs)))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
            return ChatResult(generations=[_merge(chunks)])
        return self._result(await self.transport.achat(self._payload(messages, stop, **kwargs)))

    def _stream_payload(self, messages: list[BaseMessage], stop: list[str] | None, **kwargs: Any) -> dict:
        payload = self._payload(messages, stop, **kwargs)
        payload["stream_options"] = {"include_usage": True}
        payload.pop("stream", None)
        return payload

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        payload = self._stream_payload(messages, stop, **kwargs)
        for body in self.transport.chat_stream(payload):
            chunk = _chunk(body)
            if chunk is None:
                continue
            if run_manager is not None and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        payload = self._stream_payload(messages, stop, **kwargs)
        async for body in self.transport.achat_stream(payload):
            chunk = _chunk(body)
            if chunk is None:
                continue
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def _chunk(body: dict[str, Any]) -> ChatGenerationChunk | None:
    """A chunk of the first choice (content or finish), or the closing usage chunk."""
    usage = _usage(body.get("usage"))
    if not body.get("choices"):
        if usage is None:
            return None
        return ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage,
                                                          chunk_position="last"))
    choice = body["choices"][0]
    if choice.get("index", 0) != 0:
        return None
    meta = {"finish_reason": choice["finish_reason"], "model_name": body.get("model")} \
        if choice.get("finish_reason") else {}
    content = (choice.get("delta") or {}).get("content") or ""
    return ChatGenerationChunk(message=AIMessageChunk(content=content, response_metadata=meta, id=body.get("id")),
                               generation_info=meta or None)


def _merge(chunks: list[ChatGenerationChunk]) -> ChatGeneration:
    if not chunks:
        return ChatGeneration(message=AIMessage(content=""))
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    msg = total.message
    return ChatGeneration(message=AIMessage(content=msg.content, usage_metadata=getattr(msg, "usage_metadata", None),
                                            response_metadata=msg.response_metadata, id=msg.id),
                          generation_info=total.generation_info)
