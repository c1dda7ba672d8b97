"""Turn user inputs (text or token ids) into validated token lists; bad input fails here, before it can reach
a step shared with other requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
