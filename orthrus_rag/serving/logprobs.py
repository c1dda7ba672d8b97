"""Token log-probabilities for `logprobs` / `top_logprobs`: the prompt and its generated tokens go through the
same engine once more as a backbone embedding with pooling="all" and a head that scores each generated token
(log-softmax of the model's logits, the raw distribution as OpenAI reports it). It is an ordinary request, so it
shares steps with everything else and runs on the engine's thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from orthrus_rag.engine.routing import NO_ADAPTER
from orthrus_rag.outputs import GenerationOutput
from orthrus_rag.params import PoolingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens at that position, best first


def scoring_params(engine: Any, targets: list[int], top_k: int) -> PoolingParams:
    """A pooling head over the [prompt + output] hidden rows that returns, per output token, its log-probability
    and the `top_k` best (ids and log-probabilities) in one float32 [m, 1 + 2k] matrix."""
    m = len(targets)
    target = torch.tensor(targets, dtype=torch.long)

    def head(rows: torch.Tensor) -> torch.Tensor:
        predicting = rows[rows.shape[0] - m - 1:rows.shape[0] - 1]  # row t predicts token t + 1
        lp = torch.log_softmax(engine.compute_logits(predicting).float(), dim=-1)
        chosen = lp.gather(1, target.to(lp.device)[:, None])
        top = lp.topk(top_k, dim=-1) if top_k else None
        parts = [chosen] + ([top.values, top.indices.float()] if top is not None else [])
        return torch.cat(parts, dim=1)

    return PoolingParams(pooling="all", normalize=False, head=head, adapter=NO_ADAPTER)


async def token_logprobs(aengine: Any, out: GenerationOutput, top_k: int) -> list[TokenLogprob]:
    if not out.token_ids:
        return []
    params = scoring_params(aengine.engine, out.token_ids, top_k)
    scored = await aengine.embed(list(out.prompt_token_ids) + list(out.token_ids), params)
    matrix = scored.embedding.float().cpu()
    result = []
    for t, row in zip(out.token_ids, matrix.tolist()):
        values, ids = row[1:1 + top_k], row[1 + top_k:]
        result.append(TokenLogprob(t, row[0], [(int(i), v) for i, v in zip(ids, values)]))
    return result


def completion_logprobs(items: list[TokenLogprob], tokenizer: Any, top_k: int) -> dict[str, Any]:
    """The completions API's `logprobs` object."""
    tokens = [tokenizer.decode([x.token_id]) for x in items]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [{tokenizer.decode([i]): v for i, v in x.top[:top_k]} if top_k else None for x in items]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in items], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(items: list[TokenLogprob], tokenizer: Any, top_k: int) -> dict[str, Any]:
    """The chat API's `logprobs` object (`content`: one entry per token)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(x.token_id, x.logprob),
                         "top_logprobs": [entry(i, v) for i, v in x.top[:top_k]]} for x in items],
            "refusal": None}
