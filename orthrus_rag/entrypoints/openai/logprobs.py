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
