"""Incremental output text and stop conditions for a generating request (vLLM semantics)."""

from __future__ import annotations

from typing import Any

from orthrus_rag.engine.core.request import Request


def update_output(req: Request, tokenizer: Any, eos_token_ids: set[int], max_seq_len: int | None = None) -> str | None:
    """Call after appending one sampled token to req.output_token_ids.

    Returns a finish reason ("stop" for EOS / stop token id / stop string, "length" when max_tokens or
    `max_seq_len` (prompt + output: the model's or the KV cache's limit) is reached) or None. req.output_text
    is kept current for streaming and stop-string requests, and always set when the request finishes.
    The caller records the reason and finishes the request.
    """
    params = req.sampling_params
    assert params is not None and req.output_token_ids, "update_output needs a generating request with a token"
    token_id = req.output_token_ids[-1]
    # EOS / stop token: the token stays in output_token_ids but never reaches the text
    if (not params.ignore_eos and token_id in eos_token_ids) or token_id in params.stop_token_ids:
        req.output_text = tokenizer.decode(req.output_token_ids[:-1], skip_special_tokens=True)
        return "stop"
    reason = None
    if req.grammar is not None and req.grammar.is_stopped:
        # the grammar is complete and allows no further token (a choice, a closed regex); "length" when sampled tokens
        # were replaced to complete it as the budget ran out (orthrus_rag/structured/budget.py)
        reason = "length" if req.grammar.closed_on_length else "stop"
    elif len(req.output_token_ids) >= params.max_tokens or (max_seq_len is not None and req.num_tokens >= max_seq_len):
        reason = "length"
    if reason is None and not params.stop and not req.stream:
        return None  # NOTE: no text needed before the end: skip the per-step decode
    # NOTE: decoding the whole output is O(n) per call; simple and always equal to tokenizer.decode of the kept
    # tokens. Swap for offset-based incremental detokenisation if it shows up in profiles.
    prev_len = len(req.output_text)
    req.output_text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    if params.stop and _truncate_at_stop(req, prev_len):
        return "stop"
    return reason


def _truncate_at_stop(req: Request, prev_len: int) -> bool:
    """Cut req.output_text at the earliest stop string in the new tail; whether one was found.

    Only the newly decoded text plus (longest stop string - 1) characters before it is searched, so a stop
    string split over tokens is found once, at the step that completes it.
    """
    params = req.sampling_params
    assert params is not None
    text = req.output_text
    start = max(0, prev_len - (max(len(s) for s in params.stop) - 1))
    best: tuple[int, str] | None = None
    for stop_str in params.stop:
        idx = text.find(stop_str, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop_str)
    if best is None:
        return False
    idx, stop_str = best
    req.output_text = text[: idx + len(stop_str)] if params.include_stop_str_in_output else text[:idx]
    return True


def stream_text(req: Request) -> str:
    """The text an unfinished streaming snapshot may show, so that snapshot texts only ever grow into the final
    text (what a client appending deltas needs):

    - without a trailing U+FFFD: the bytes of a character split over tokens decode to it until the rest arrive;
    - with stop strings, without the last (longest stop string - 1) characters: a later token may complete a stop
      string that starts there, and the final text is cut before it (vLLM holds back the same way). A stop string
      starting earlier would already lie whole in the text and have finished the request.
    """
    params = req.sampling_params
    assert params is not None
    text = req.output_text
    if params.stop:
        text = text[: max(0, len(text) - (max(len(s) for s in params.stop) - 1))]
    return text.rstrip("\ufffd")
