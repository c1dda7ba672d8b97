"""`logprobs` / `top_logprobs` in the OpenAI response shapes. The values come from the engine's sampler, in the step
that sampled each token (`GenerationOutput.logprobs`, asked for with `SamplingParams.logprobs`): no second pass."""

from __future__ import annotations

from typing import Any

from orthrus_rag.outputs import TokenLogprob


def completion_logprobs(items: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """The completions API's `logprobs` object (`top_logprobs`: None when no top tokens were asked for)."""
    tokens = [tokenizer.decode([x.token_id]) for x in items]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [{tokenizer.decode([i]): v for i, v in x.top} if x.top else None for x in items]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in items], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(items: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """The chat API's `logprobs` object (`content`: one entry per token)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(i, v) for i, v in x.top]}
                        for x in items], "refusal": None}


def prompt_logprobs(items: list[TokenLogprob | None], tokenizer: Any) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token (None for the first), by token id, the
    prompt token's entry and its position's top ones, each `{"logprob", "rank", "decoded_token"}`."""
    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}

    out: list[dict[str, Any] | None] = []
    for x in items:
        if x is None:
            out.append(None)
            continue
        best = {str(i): entry(i, v, rank) for rank, (i, v) in enumerate(x.top, start=1)}
        out.append({str(x.token_id): entry(x.token_id, x.logprob, x.rank), **{k: v for k, v in best.items()
                                                                              if k != str(x.token_id)}})
    return out
