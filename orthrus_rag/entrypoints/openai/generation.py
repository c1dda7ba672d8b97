"""The completions and chat completions endpoints over `OpenAIService`: request -> engine prompts and sampling
params, outputs -> OpenAI response bodies or SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from orthrus_rag.outputs import GenerationOutput
from orthrus_rag.entrypoints.openai.errors import OpenAIError, bad_request
from orthrus_rag.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from orthrus_rag.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest
from orthrus_rag.entrypoints.openai.service import OpenAIService, as_prompts, new_id
from orthrus_rag.entrypoints.openai.structured import checked_constraint

Runner = Callable[[Awaitable[Any]], Awaitable[Any]]


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    bad = req.unsupported()
    if bad:
        raise bad_request(f"not supported by this server: {', '.join(bad)}", "tools" if "tools" in bad[0] else None)


def _finish_reason(out: GenerationOutput) -> str | None:
    return {"abort": "stop"}.get(out.finish_reason or "", out.finish_reason) if out.finished else None


def _usage(outs: list[GenerationOutput], prompt_tokens: int) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


# ---- chat ------------------------------------------------------------------------------------------------
def chat_prompt(service: OpenAIService, req: ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    tok = service.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request(f"{service.models.generation} has no chat template; use /v1/completions", "messages")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def _chat_params(service: OpenAIService, req: ChatCompletionRequest) -> list:
    adapter = service.generation_adapter(req.model)
    _refuse_unsupported(req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured = await checked_constraint(service.client, req)
    return [service.sampling_params(req.token_limit(), req.temperature, req.top_p, req.stop_list(), req.seed, i,
                                    logprobs, structured, adapter) for i in range(req.n)]


async def chat(service: OpenAIService, req: ChatCompletionRequest, run: Runner | None = None) -> dict[str, Any]:
    params = await _chat_params(service, req)
    prompt = chat_prompt(service, req)
    outs = await service.generate_many(prompt, params, run)
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
                                      req.logprobs, structured, adapter) for i in range(req.n)]
    return prompts, params


async def completions(service: OpenAIService, req: CompletionRequest, run: Runner | None = None) -> dict[str, Any]:
    prompts, params = await _completion_params(service, req)
    service.reserve(len(prompts) * len(params))
    # NOTE: every prompt's samples are submitted together, so they share engine steps
    tasks = [asyncio.ensure_future(service.generate_many(prompt, params, run)) for prompt in prompts]
    try:
        per_prompt = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    choices, outs_all, prompt_tokens = [], [], 0
    for p_index, outs in enumerate(per_prompt):
        prompt_tokens += len(outs[0].prompt_token_ids)
        for i, out in enumerate(outs):
            logprobs = completion_logprobs(out.logprobs, service.tokenizer) if req.logprobs is not None else None
            choices.append({"index": p_index * req.n + i, "text": out.text, "logprobs": logprobs,
                            "finish_reason": _finish_reason(out)})
        outs_all.extend(outs)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices, "usage": _usage(outs_all, prompt_tokens)}


async def completions_stream(service: OpenAIService, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
    """The chunks (dicts) of a streamed completion; as `chat_stream`."""
    prompts, params = await _completion_params(service, req)
    if len(prompts) != 1:
        raise bad_request("stream=true takes one prompt per request", "prompt")
    if req.logprobs is not None:
        raise bad_request("logprobs are not supported with stream=true; ask without streaming", "logprobs")
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
