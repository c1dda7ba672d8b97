"""`POST /v1/responses`: OpenAI's Responses API with the `file_search` tool run inside the server.

A request names its input (a string, or messages), optional `instructions`, and at most one `file_search` tool
(`vector_store_ids`, `max_num_results` 1-50; vector stores: vector_stores.py). With the tool (and `tool_choice` not
"none"), the server searches with the input's last user message: the query's embedding is one more request in the
engine's steps, beside every other response's tokens. The passages go into the prompt, the model answers, and the
output holds a `file_search_call` item (its query, and with `include=["file_search_call.results"]` its results) then
the message, whose text cites each passage it was given (`file_citation` annotations at the end of the text). A
search that fails is reported as a failed tool call and the model answers without passages; bad input (an unknown
tool type, an empty input or query, `max_num_results` out of range, a vector store that does not exist) is a 4xx
naming it. `stream=true` sends the Responses API's events (`response.created`, the file search call's
`in_progress` / `searching` / `completed`, the text's deltas, `response.completed`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from orthrus_rag.entrypoints.openai.errors import OpenAIError, bad_request
from orthrus_rag.entrypoints.openai.schemas import MAX_TEXT_CHARS, _Strict
from orthrus_rag.entrypoints.openai.service import OpenAIService, new_id
from orthrus_rag.entrypoints.openai.vector_stores import MAX_NUM_RESULTS, Hit, VectorStores
from orthrus_rag.outputs import GenerationOutput

logger = logging.getLogger(__name__)
DEFAULT_NUM_RESULTS = 5
RESULTS_INCLUDE = "file_search_call.results"
ANSWER_INSTRUCTION = "Answer the question using the passages below when they help."


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=16)
    tool_choice: str | dict[str, Any] = "auto"
    include: list[str] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


class FileSearch:
    """The request's file_search tool, checked."""

    def __init__(self, tool: dict[str, Any]) -> None:
        allowed = {"type", "vector_store_ids", "max_num_results", "filters", "ranking_options"}
        unknown = sorted(set(tool) - allowed)
        if unknown:
            raise bad_request(f"file_search: unknown field(s) {', '.join(unknown)}", "tools")
        ids = tool.get("vector_store_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise bad_request("file_search.vector_store_ids must be a list of vector store ids", "tools")
        k = tool.get("max_num_results", DEFAULT_NUM_RESULTS)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_RESULTS:
            raise bad_request(f"file_search.max_num_results must be an integer from 1 to {MAX_NUM_RESULTS}, got {k!r}",
                              "tools")
        if tool.get("filters") is not None:
            raise bad_request("file_search.filters are not supported by this server", "tools")
        self.vector_store_ids, self.k, self.spec = list(ids), k, tool


def _file_search_tool(req: ResponsesRequest) -> FileSearch | None:
    searches = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind != "file_search":
            raise bad_request(f"tools[{i}]: tool type {kind!r} is not supported; this server runs file_search",
                              "tools")
        searches.append(FileSearch(tool))
    if len(searches) > 1:
        raise bad_request("give at most one file_search tool (list several vector_store_ids in it)", "tools")
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = choice.get("type")
    if choice not in ("auto", "required", "none", "file_search"):
        raise bad_request(f"tool_choice {req.tool_choice!r} is not one of auto, required, none, file_search",
                          "tool_choice")
    if choice in ("required", "file_search") and not searches:
        raise bad_request("tool_choice asks for a tool the request does not give", "tool_choice")
    return searches[0] if searches and choice != "none" else None


def _messages(req: ResponsesRequest) -> list[dict[str, str]]:
    """The input as chat messages (instructions first, as the system message)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for i, item in enumerate(items):
        if item.get("type", "message") != "message":
            raise bad_request(f"input[{i}]: item type {item.get('type')!r} is not supported; send messages", "input")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"input[{i}]: role {role!r} is not one of user, assistant, system, developer", "input")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"input[{i}]: content of type {kind!r} is not supported; send text", "input")
                parts.append(str(part.get("text") or ""))
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"input[{i}]: content must be text", "input")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    if not question.strip():
        raise bad_request("input holds no user text to answer", "input")
    return messages


def _with_passages(messages: list[dict[str, str]], hits: list[Hit]) -> list[dict[str, str]]:
    """The last user message preceded by the passages."""
    if not hits:
        return messages
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    passages = "\n".join(f"[{n}] {p.title}: {p.text}" for n, (p, _) in enumerate(hits, start=1))
    content = f"{ANSWER_INSTRUCTION}\n\nPassages:\n{passages}\n\nQuestion: {messages[last]['content']}"
    return [*messages[:last], {"role": "user", "content": content}, *messages[last + 1:]]


class Responses:
    """The endpoint's side of one server: its service (the engine) and its vector stores (the index)."""

    def __init__(self, service: OpenAIService, stores: VectorStores) -> None:
        self.service, self.stores = service, stores

    async def _prepare(self, req: ResponsesRequest) -> tuple[Any, list[dict[str, str]], FileSearch | None]:
        model = req.model or self.service.models.generation
        adapter = self.service.generation_adapter(model)
        tool = _file_search_tool(req)
        messages = _messages(req)
        if tool is not None:
            for store_id in tool.vector_store_ids:
                self.stores.store(store_id)  # NOTE: a 404 naming an unknown store before anything runs
            self.stores.documents.require()
        for name in req.include or []:
            if name != RESULTS_INCLUDE:
                raise bad_request(f"include {name!r} is not supported (only {RESULTS_INCLUDE})", "include")
        self.service.require_chat_template("model")
        params = self.service.sampling_params(req.max_output_tokens, req.temperature, req.top_p, [], None, 0,
                                              adapter=adapter)
        return params, messages, tool

    async def _search(self, tool: FileSearch, query: str, disconnected: Any) -> tuple[list[Hit], str]:
        """The tool's hits and its status; a search that fails (the stores were checked before: a query the embedder
        refuses, an engine error) is a failed tool call, not a failed response."""
        try:
            return await self.stores.search(tool.vector_store_ids, query, tool.k, disconnected), "completed"
        except OpenAIError as exc:
            logger.warning("file_search failed: %s", exc.message)
        except Exception:  # noqa: BLE001 (reported in the response)
            logger.exception("file_search failed")
        return [], "failed"

    def _prompt(self, messages: list[dict[str, str]], hits: list[Hit]) -> list[int]:
        return self.service.chat_tokens(_with_passages(messages, hits), "input")

    def _search_item(self, item_id: str, query: str, hits: list[Hit], status: str,
                     req: ResponsesRequest) -> dict[str, Any]:
        results = [self.stores.result(p, s) for p, s in hits] if RESULTS_INCLUDE in (req.include or []) else None
        return {"id": item_id, "type": "file_search_call", "status": status, "queries": [query], "results": results}

    def _annotations(self, text: str, hits: list[Hit]) -> list[dict[str, Any]]:
        cited, out = set(), []
        for p, s in hits:
            r = self.stores.result(p, s)
            if r["file_id"] not in cited:
                cited.add(r["file_id"])
                out.append({"type": "file_citation", "file_id": r["file_id"], "filename": r["filename"],
                            "index": len(text)})
        return out

    def _message(self, item_id: str, out: GenerationOutput | None, hits: list[Hit], status: str) -> dict[str, Any]:
        text = out.text if out is not None else ""
        content = [] if out is None else [{"type": "output_text", "text": text,
                                           "annotations": self._annotations(text, hits), "logprobs": []}]
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def _response(self, rid: str, created: float, req: ResponsesRequest, output: list[dict[str, Any]],
                  out: GenerationOutput | None, status: str) -> dict[str, Any]:
        incomplete = out is not None and out.finish_reason == "length"
        usage = None
        if out is not None:
            prompt, cached = len(out.prompt_token_ids), int(out.num_cached_tokens)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + len(out.token_ids)}
        return {"id": rid, "object": "response", "created_at": created,
                "status": "incomplete" if status == "completed" and incomplete else status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": req.model or self.service.models.generation, "output": output,
                "parallel_tool_calls": bool(req.parallel_tool_calls), "previous_response_id": None,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": req.tool_choice, "tools": req.tools,
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
                "metadata": dict(req.metadata or {}), "store": False}

    # ---- the two forms ---------------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, disconnected: Any = None) -> dict[str, Any]:
        params, messages, tool = await self._prepare(req)
        rid, created, output = new_id("resp"), time.time(), []
        hits: list[Hit] = []
        if tool is not None:
            query = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            hits, status = await self._search(tool, query, disconnected)
            output.append(self._search_item(new_id("fs"), query, hits, status, req))
        (out,) = await self.service.generate_many(self._prompt(messages, hits), [params], disconnected)
        output.append(self._message(new_id("msg"), out, hits, "incomplete" if out.finish_reason == "length"
                                    else "completed"))
        return self._response(rid, created, req, output, out, "completed")

    async def stream(self, req: ResponsesRequest) -> AsyncIterator[dict[str, Any]]:
        """The events (dicts with `type` and `sequence_number`); checks run before the first event."""
        params, messages, tool = await self._prepare(req)
        self.service.reserve(1)
        rid, created = new_id("resp"), time.time()

        async def events() -> AsyncIterator[dict[str, Any]]:
            output: list[dict[str, Any]] = []
            seq = iter(range(1 << 62))

            def event(kind: str, **body: Any) -> dict[str, Any]:
                return {"type": kind, "sequence_number": next(seq), **body}

            yield event("response.created", response=self._response(rid, created, req, [], None, "in_progress"))
            yield event("response.in_progress", response=self._response(rid, created, req, [], None, "in_progress"))
            hits: list[Hit] = []
            if tool is not None:
                query = next(m["content"] for m in reversed(messages) if m["role"] == "user")
                fs_id, index = new_id("fs"), len(output)
                yield event("response.output_item.added", output_index=index,
                            item=self._search_item(fs_id, query, [], "in_progress", req))
                yield event("response.file_search_call.in_progress", output_index=index, item_id=fs_id)
                yield event("response.file_search_call.searching", output_index=index, item_id=fs_id)
                hits, status = await self._search(tool, query, None)
                item = self._search_item(fs_id, query, hits, status, req)
                if status == "completed":
                    yield event("response.file_search_call.completed", output_index=index, item_id=fs_id)
                output.append(item)
                yield event("response.output_item.done", output_index=index, item=item)
            msg_id, index = new_id("msg"), len(output)
            yield event("response.output_item.added", output_index=index,
                        item=self._message(msg_id, None, [], "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=msg_id, output_index=index, content_index=0, part=part)
            sent, final = "", None
            async for _, snap in self.service.stream_many(self._prompt(messages, hits), [params]):
                delta = snap.text[len(sent):] if snap.text.startswith(sent) else ""
                if delta:
                    sent = snap.text
                    yield event("response.output_text.delta", item_id=msg_id, output_index=index, content_index=0,
                                delta=delta, logprobs=[])
                if snap.finished:
                    final = snap
            message = self._message(msg_id, final, hits, "incomplete" if final is not None
                                    and final.finish_reason == "length" else "completed")
            text_part = message["content"][0] if message["content"] else part
            yield event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0,
                        text=text_part["text"], logprobs=[])
            yield event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                        part=text_part)
            output.append(message)
            yield event("response.output_item.done", output_index=index, item=message)
            yield event("response.completed", response=self._response(rid, created, req, output, final,
                                                                      "completed"))

        return events()


async def sse_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The Responses API's SSE form: `event: <type>` and its JSON, no [DONE]; a failure after the first event ends
    the stream with an `error` event."""
    try:
        async for body in events:
            yield f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
    except OpenAIError as exc:
        body = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        yield f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
