"""The engine's text boundary, both ways: user inputs (text or token ids) into validated token lists
(`InputProcessor`: bad input fails here, before it can reach a step shared with other requests), and sampled tokens
into incremental output text with its stop conditions (`update_output`, `stream_text`; vLLM semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orthrus_rag.engine.core.request import Request
from orthrus_rag.params import PoolingParams


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_kv_tokens: int,
                 encoder_tokenizer: Any = None, encoder_vocab_size: int = 0, encoder_max_len: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_kv_tokens = max_kv_tokens
        self.encoder_tokenizer = encoder_tokenizer
        self.encoder_vocab_size = encoder_vocab_size
        self.encoder_max_len = encoder_max_len

    @staticmethod
    def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"{what} must be a string or a list of token ids, got {type(ids).__name__}")
        ids = list(ids)
        if not ids:
            raise ValueError(f"{what} is empty")
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        return ids

    def _tokenize(self, tokenizer: Any, text: str, what: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"{what} must be a string or a list of token ids, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"{what} is empty")
        return tokenizer(text)["input_ids"]

    def prompt(self, prompt: str | Sequence[int]) -> list[int]:
        ids = prompt if not isinstance(prompt, str) else self._tokenize(self.tokenizer, prompt, "prompt")
        ids = self._check_ids(ids, self.vocab_size, "prompt")
        self._check_len(len(ids), "prompt")
        return ids

    def appended(self, appended: str | Sequence[int]) -> list[int]:
        """Tokens a continuation appends (engine/continuation.py): text without special tokens (it goes mid-sequence),
        or token ids; empty is allowed (generate on from where the output stopped)."""
        if isinstance(appended, str):
            return self.tokenizer(appended, add_special_tokens=False)["input_ids"] if appended else []
        if isinstance(appended, Sequence) and not appended:
            return []
        return self._check_ids(appended, self.vocab_size, "appended input")

    def embed_input(self, text: str | Sequence[int], params: PoolingParams, on_encoder: bool) -> list[int]:
        tokenizer = self.encoder_tokenizer if on_encoder else self.tokenizer
        vocab = self.encoder_vocab_size if on_encoder else self.vocab_size
        if isinstance(text, str):
            text = (params.instruction or "") + text
            ids = self._tokenize(tokenizer, text, "embedding input")
        else:
            ids = self._check_ids(text, vocab, "embedding input")
            if params.instruction:
                ids = tokenizer(params.instruction, add_special_tokens=False)["input_ids"] + ids
        ids = self._check_ids(ids, vocab, "embedding input")
        if not on_encoder and params.wants_eos:
            end = tokenizer.eos_token_id if params.end_token is None else self._token_id(tokenizer, params.end_token)
            if ids[-1] != end:
                ids.append(end)
        limit = self.encoder_max_len if on_encoder else min(self.max_model_len, self.max_kv_tokens)
        if params.truncate and len(ids) > limit:
            # NOTE: keep the final token: the encoder's [SEP], or the EOS that `last` pooling reads
            keep_last = on_encoder or params.wants_eos
            ids = ids[:limit - 1] + ids[-1:] if keep_last else ids[:limit]
        if params.weights is not None and len(params.weights) != len(ids):
            raise ValueError(f"weighted_mean got {len(params.weights)} weights for {len(ids)} tokens")
        if on_encoder:
            if len(ids) > self.encoder_max_len:
                raise ValueError(f"embedding input has {len(ids)} tokens, more than the embedding model's "
                                 f"maximum of {self.encoder_max_len}")
        else:
            self._check_len(len(ids), "embedding input")
        return ids

    @staticmethod
    def _token_id(tokenizer: Any, token: str) -> int:
        """The id of one special token; a string the vocabulary lacks is a ValueError, not the unknown token."""
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"end_token {token!r} is not one token of this tokenizer (it encodes to {ids})")
        return ids[0]

    def _check_len(self, n: int, what: str) -> None:
        if n > self.max_model_len:
            raise ValueError(f"{what} has {n} tokens, more than the model's maximum of {self.max_model_len}")
        if n > self.max_kv_tokens:
            raise ValueError(f"{what} has {n} tokens, more than the KV cache holds ({self.max_kv_tokens}); "
                             "raise cache.num_blocks")


# ---- tokens out: text and stop conditions -------------------------------------------------------------------
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
    # below min_tokens nothing stops the output: its stop tokens were masked out of sampling (runner), and a stop
    # string found in the text so far is not looked for (vLLM's rule)
    stoppable = len(req.output_token_ids) >= params.min_tokens
    # EOS / stop token: the token stays in output_token_ids but never reaches the text
    if stoppable and ((not params.ignore_eos and token_id in eos_token_ids) or token_id in params.stop_token_ids):
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
    if params.stop and stoppable and _truncate_at_stop(req, prev_len):
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
