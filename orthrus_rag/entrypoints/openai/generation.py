"""The completions and chat completions endpoints over `OpenAIService`: request -> engine prompts and sampling
params, outputs -> OpenAI response bodies or SSE chunks.

A request's output constraint (`constraint_of`, `checked_constraint`), from OpenAI's `response_format` or vLLM's extra
fields, checked before any engine request is made (a bad schema is a 400 naming it, never a broken stream).

Accepted, one per request:
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`; the schema is enforced
  whether or not `strict` is set (a constrained decoder has no weaker mode);
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`, plus
  `whitespace_flexible` and `close_on_length`;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

`structured_close_on_length` (top level, ours) switches `close_on_length` for whichever of them is given: an output
closed as its token budget runs out (on, the default) or cut where it ends (off).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from orthrus_rag.outputs import GenerationOutput
from orthrus_rag.entrypoints.openai.errors import OpenAIError, bad_request
from orthrus_rag.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from orthrus_rag.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest
from orthrus_rag.entrypoints.openai.service import Disconnected, OpenAIService, as_prompts, new_id
from orthrus_rag.params import STRUCTURED_KINDS, StructuredOutputsParams
from orthrus_rag.structured.compiler import compiler_for

# ---- the output constraint -----------------------------------------------------------------------------------
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_of(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from ((None, None): free text); a 400 naming the field
    for anything malformed."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        spec = _from_response_format(fmt)
        if spec is not None:
            given.append(("response_format", spec))
    if req.structured_outputs is not None:
        allowed = set(STRUCTURED_KINDS) | {"whitespace_flexible", "close_on_length"}
        unknown = sorted(set(req.structured_outputs) - allowed)
        if unknown:
            raise bad_request(f"structured_outputs: unknown field(s) {', '.join(unknown)}; expected one of "
                              f"{', '.join(sorted(allowed))}", "structured_outputs")
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            given.append((field, {kind: value}))
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(f for f, _ in given)}", given[1][0])
    field, fields = given[0]
    try:
        spec = StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"{field}: {exc}", field) from None
    close = getattr(req, "structured_close_on_length", None)
    return (spec if close is None else replace(spec, close_on_length=close)), field


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                              "response_format")
        return {"json": body["schema"]}
    raise bad_request(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                      "response_format")


async def checked_constraint(client: Any, req: Any) -> StructuredOutputsParams | None:
    """The request's constraint, compiled in a worker thread: a 400 naming the field when the schema, regex or
    grammar is invalid. An in-process engine's own compiler does it (its requests then find it compiled); a client
    whose engine is elsewhere (a deployment, replicas, a remote server) is checked with this process's compiler
    for its tokenizer, and its engine compiles the constraint again, once."""
    spec, field = constraint_of(req)
    if spec is None:
        return None
    compiler = getattr(getattr(client, "engine", None), "grammars", None) \
        or compiler_for(client.tokenizer, len(client.tokenizer))
    try:
        await asyncio.to_thread(compiler.prepare, spec)
    except ValueError as exc:
        raise bad_request(str(exc), field) from None
    return spec


# ---- the endpoints --------------------------------------------------------------------------------------------
def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    bad = req.unsupported()
    if bad:
        param = "tools" if "tools" in bad[0] else bad[0] if bad[0] in type(req).model_fields else None
        raise bad_request(f"not supported by this server: {', '.join(bad)}", param)


def _finish_reason(out: GenerationOutput) -> str | None:
    return {"abort": "stop"}.get(out.finish_reason or "", out.finish_reason) if out.finished else None


def _usage(outs: list[GenerationOutput], prompt_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the prefix cache served (`prompt_tokens_details.cached_tokens`; default:
    the most any choice of the one prompt found)."""
    completion = sum(len(o.token_ids) for o in outs)
    cached = max((o.num_cached_tokens for o in outs), default=0) if cached is None else cached
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- chat ------------------------------------------------------------------------------------------------
def chat_prompt(service: OpenAIService, req: ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    return service.chat_tokens([{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                                for m in req.messages])


async def _chat_params(service: OpenAIService, req: ChatCompletionRequest) -> list:
    adapter = service.generation_adapter(req.model)
    _refuse_unsupported(req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured = await checked_constraint(service.client, req)
    return [service.sampling_params(req.token_limit(), req.temperature, req.top_p, req.stop_list(), req.seed, i,
                                    logprobs, structured, adapter, **req.engine_sampling()) for i in range(req.n)]


async def chat(service: OpenAIService, req: ChatCompletionRequest,
               disconnected: Disconnected | None = None) -> dict[str, Any]:
    params = await _chat_params(service, req)
    prompt = chat_prompt(service, req)
    outs = await service.generate_many(prompt, params, disconnected)
    choices = []
    for i, out in enumerate(outs):
        logprobs = chat_logprobs(out.logprobs, service.tokenizer) if req.logprobs else None
        choices.append({"index": i, "message": {"role": "assistant", "content": out.text, "refusal": None},
                        "logprobs": logprobs, "finish_reason": _finish_reason(out)})
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": choices, "usage": _usage(outs, len(prompt)),
            "system_fingerprint": None}


async def chat_stream(service: OpenAIService, req: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
    """The chunks (dicts): a role chunk per choice, content deltas, a finish chunk per choice, usage if asked.
    Checks run before the first chunk, so a bad request is an error status, not a broken stream; a failure
    after it raises `OpenAIError` from the iterator (`sse_events` turns that into an error event)."""
    params = await _chat_params(service, req)
    if req.logprobs:
        raise bad_request("logprobs are not supported with stream=true; ask without streaming", "logprobs")
    prompt = chat_prompt(service, req)
    service.reserve(len(params))
    rid, created, model = new_id("chatcmpl"), int(time.time()), req.model

    def chunk(choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, "system_fingerprint": None}
        if req.stream_options is not None and req.stream_options.include_usage:
            body["usage"] = usage
        return body

    async def events() -> AsyncIterator[dict[str, Any]]:
        for i in range(req.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for i, out, delta, finals in _deltas(service, prompt, params):
            if delta:
                yield chunk([{"index": i, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}])
            if out.finished:
                yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(out)}])
            if finals is not None and req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], _usage(finals, len(prompt)))

    return events()


# ---- completions -------------------------------------------------------------------------------------------
async def _completion_params(service: OpenAIService, req: CompletionRequest) -> tuple[list, list]:
    adapter = service.generation_adapter(req.model)
    _refuse_unsupported(req)
    prompts = as_prompts(req.prompt)
    structured = await checked_constraint(service.client, req)
    params = [service.sampling_params(req.max_tokens, req.temperature, req.top_p, req.stop_list(), req.seed, i,
                                      req.logprobs, structured, adapter, **req.engine_sampling()) for i in range(req.n)]
    return prompts, params


async def completions(service: OpenAIService, req: CompletionRequest,
                      disconnected: Disconnected | None = None) -> dict[str, Any]:
    prompts, params = await _completion_params(service, req)
    service.reserve(len(prompts) * len(params))
    # NOTE: every prompt's samples are submitted together, so they share engine steps
    tasks = [asyncio.ensure_future(service.generate_many(prompt, params, disconnected)) for prompt in prompts]
    try:
        per_prompt = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    choices, outs_all, prompt_tokens, cached = [], [], 0, 0
    for p_index, outs in enumerate(per_prompt):
        prompt_tokens += len(outs[0].prompt_token_ids)
        cached += max(o.num_cached_tokens for o in outs)
        for i, out in enumerate(outs):
            logprobs = completion_logprobs(out.logprobs, service.tokenizer) if req.logprobs is not None else None
            choice = {"index": p_index * req.n + i, "text": out.text, "logprobs": logprobs,
                      "finish_reason": _finish_reason(out)}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs or [], service.tokenizer)
            if req.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(out.prompt_token_ids), list(out.token_ids)
            choices.append(choice)
        outs_all.extend(outs)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices, "usage": _usage(outs_all, prompt_tokens, cached)}


async def completions_stream(service: OpenAIService, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
    """The chunks (dicts) of a streamed completion; as `chat_stream`."""
    prompts, params = await _completion_params(service, req)
    if len(prompts) != 1:
        raise bad_request("stream=true takes one prompt per request", "prompt")
    if req.logprobs is not None:
        raise bad_request("logprobs are not supported with stream=true; ask without streaming", "logprobs")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not supported with stream=true; ask without streaming",
                          "prompt_logprobs")
    if req.return_token_ids:
        raise bad_request("return_token_ids is not supported with stream=true; ask without streaming",
                          "return_token_ids")
    service.reserve(len(params))
    rid, created, model = new_id("cmpl"), int(time.time()), req.model

    async def events() -> AsyncIterator[dict[str, Any]]:
        async for i, out, delta, finals in _deltas(service, prompts[0], params):
            if delta or out.finished:
                yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": i, "text": delta, "logprobs": None,
                                    "finish_reason": _finish_reason(out)}]}
            if finals is not None and req.stream_options is not None and req.stream_options.include_usage:
                yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": _usage(finals, len(finals[0].prompt_token_ids))}

    return events()


# ---- shared streaming -----------------------------------------------------------------------------------------
async def _deltas(service: OpenAIService, prompt: Any, params: list,
                  ) -> AsyncIterator[tuple[int, GenerationOutput, str, list[GenerationOutput] | None]]:
    """(choice, snapshot, new text since the last one, all final outputs once the last choice finished)."""
    sent = [""] * len(params)
    finals: dict[int, GenerationOutput] = {}
    async for i, out in service.stream_many(prompt, params):
        delta = out.text[len(sent[i]):] if out.text.startswith(sent[i]) else ""
        sent[i] = out.text if delta or not sent[i] else sent[i]
        if out.finished:
            finals[i] = out
        yield i, out, delta, ([finals[k] for k in range(len(params))] if len(finals) == len(params) else None)


async def sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The HTTP form of a stream: each chunk as an SSE event, then [DONE]. An error after the first event cannot
    change the status: it ends the stream with an error event."""
    try:
        async for body in chunks:
            yield _sse(body)
    except OpenAIError as exc:
        yield _sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}})
        return
    yield "data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
