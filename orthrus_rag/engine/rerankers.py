"""What a reranker is to the engine: how a (query, document) pair becomes one scoring request's tokens, and the
pooling head that turns its final hidden state into a relevance score in [0, 1].

Scoring is a pooling head on the embedding path, so a pair is scheduled, packed and (on the backbone) chunked as an
embedding is, beside generations in the same steps:
- `CrossEncoderReranker`: a BERT-family *ForSequenceClassification checkpoint (models/cross_encoder.py) run whole as
  a separate encoder in the step. The pair is the tokenizer's own pair encoding, `[CLS] query [SEP] document [SEP]`
  in segments 0 and 1, cut longest-first to the model's length (sentence-transformers' CrossEncoder); the score is
  its classifier's on the [CLS] row.
- `BackboneReranker`: the generation backbone, under a LoRA adapter or none, read as Qwen3-Reranker is: the pair in
  a judging chat (its system line, `<Instruct>: ... <Query>: ... <Document>: ...`) up to where the assistant's
  answer starts, and the score P("yes") of the softmax over the "yes" and "no" logits at the last token.

`model.rerankers` names them: a cross-encoder's folder, built-in name or hub id, or `backbone` /
`backbone+ADAPTER` (build_rerankers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from orthrus_rag.params import PoolingParams, RerankParams

BACKBONE = "backbone"  # `model.rerankers` entry: the generation backbone's yes/no reading (`backbone+ADAPTER`)
# Qwen3-Reranker's judging prompt and default task: what its checkpoints (and adapters trained in its form) read
JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# the embedding encoder's size that one encoder token of the step-cost model stands for when none is loaded
# (all-MiniLM-L6-v2: 6 layers of width 384)
REFERENCE_ENCODER_WORK = 6 * 384 ** 2


@dataclass(frozen=True)
class ScoreInput:
    """One pair as the engine queues it."""

    token_ids: list[int]
    params: PoolingParams  # the pooling and the scoring head
    token_type_ids: list[int] | None = None
    on_encoder: bool = False
    encoder: str = ""  # the runner's name for the encoder it runs on
    adapter_slot: int = 0
    token_cost: float = 1.0


class Reranker(Protocol):
    name: str

    def pair(self, query: str, document: str, params: RerankParams) -> ScoreInput:
        """The pair's tokens and head; ValueError / TypeError for input it cannot score (nothing is queued)."""


def _check_text(text: Any, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"the {what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"the {what} is empty")
    return text


class CrossEncoderReranker:
    """A separate cross-encoder: whole pairs on the encoder named `name`."""

    def __init__(self, name: str, model: torch.nn.Module, tokenizer: Any, token_cost: float) -> None:
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.token_cost = token_cost
        limit = getattr(tokenizer, "model_max_length", None)
        # NOTE: a tokenizer without a length says ~1e30; the model's positions bound it then
        self.max_length = min(model.max_position_embeddings, limit if limit and limit < 1_000_000 else math.inf)

    def head(self, cls_row: torch.Tensor) -> torch.Tensor:
        return self.model.relevance(cls_row[None])

    def pair(self, query: str, document: str, params: RerankParams) -> ScoreInput:
        query, document = _check_text(query, "query"), _check_text(document, "document")
        if params.instruction is not None:
            raise ValueError(f"reranker {self.name!r} is a cross-encoder: it takes no instruction")
        enc = self.tokenizer(query, document, truncation="longest_first" if params.truncate else False,
                             max_length=int(self.max_length) if params.truncate else None)
        ids = list(enc["input_ids"])
        if len(ids) > self.max_length:
            raise ValueError(f"the pair has {len(ids)} tokens; reranker {self.name!r} takes at most "
                             f"{int(self.max_length)} (truncate cuts it to fit)")
        types = list(enc.get("token_type_ids") or [0] * len(ids))
        return ScoreInput(ids, PoolingParams(pooling="cls", normalize=False, head=self.head,
                                             priority=params.priority),
                          token_type_ids=types, on_encoder=True, encoder=self.name, token_cost=self.token_cost)


class BackboneReranker:
    """The generation backbone's yes/no judgement, chunked in the decoder's forward like an embedding."""

    def __init__(self, name: str, tokenizer: Any, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype, max_tokens: int, adapter_slot: int = 0) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.compute_logits = compute_logits
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.adapter_slot = adapter_slot
        self.yes_no = [_single_token(tokenizer, "no"), _single_token(tokenizer, "yes")]
        sentinel = "\x00document\x00"
        chat = tokenizer.apply_chat_template([{"role": "system", "content": JUDGE_SYSTEM},
                                              {"role": "user", "content": sentinel}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        before, after = chat.split(sentinel)
        self.prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
        self.suffix = tokenizer(after, add_special_tokens=False)["input_ids"]

    def head(self, last_row: torch.Tensor) -> torch.Tensor:
        logits = self.compute_logits(last_row[None].to(self.dtype))[0, self.yes_no]
        return torch.softmax(logits.float(), dim=-1)[1:]

    def pair(self, query: str, document: str, params: RerankParams) -> ScoreInput:
        query, document = _check_text(query, "query"), _check_text(document, "document")
        instruction = params.instruction or DEFAULT_INSTRUCTION
        body = self.tokenizer(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
                              add_special_tokens=False)["input_ids"]
        room = self.max_tokens - len(self.prefix) - len(self.suffix)
        if len(body) > room:
            head = len(self.tokenizer(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: ",
                                      add_special_tokens=False)["input_ids"])
            if not params.truncate or head >= room:
                raise ValueError(f"the pair has {len(body) + len(self.prefix) + len(self.suffix)} tokens; reranker "
                                 f"{self.name!r} takes at most {self.max_tokens}"
                                 + (" (truncate cuts the document to fit)" if not params.truncate else
                                    " even with the document cut: the query or instruction is too long"))
            body = body[:room]  # NOTE: the document's tail goes, as Qwen3-Reranker's own truncation does
        ids = self.prefix + body + self.suffix
        return ScoreInput(ids, PoolingParams(pooling="last", normalize=False, append_eos=False, head=self.head,
                                             priority=params.priority),
                          adapter_slot=self.adapter_slot)


def _single_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the backbone's tokenizer splits {word!r} into {len(ids)} tokens; a yes/no reranker needs "
                         "one token for each answer")
    return int(ids[0])


def encoder_work(model: torch.nn.Module) -> int:
    """A BERT encoder's per-token work, in layers x width^2 (what its linears cost a token)."""
    return int(model.config.num_hidden_layers * model.config.hidden_size ** 2)


def build_rerankers(names: list[str], cross_encoders: Mapping[str, tuple[torch.nn.Module, Any]],
                    embedding_encoder: torch.nn.Module | None, tokenizer: Any,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, max_tokens: int,
                    adapter_slot: Callable[[str], int]) -> dict[str, Reranker]:
    """The engine's rerankers by name, in `model.rerankers` order: loaded cross-encoders, and the backbone's
    readings (`adapter_slot(name)` resolves `backbone+ADAPTER`, a ValueError for one not loaded). A cross-encoder
    token costs its work over the embedding encoder's (all-MiniLM-L6-v2's when none is loaded)."""
    unit = encoder_work(embedding_encoder) if embedding_encoder is not None else REFERENCE_ENCODER_WORK
    out: dict[str, Reranker] = {}
    for name in names:
        if is_backbone(name):
            adapter = name.partition("+")[2]
            slot = adapter_slot(adapter) if adapter else 0
            out[name] = BackboneReranker(name, tokenizer, compute_logits, dtype, max_tokens, slot)
        else:
            if name not in cross_encoders:
                raise ValueError(f"reranker {name!r} is a cross-encoder that was not loaded (Engine.from_config loads "
                                 "every model.rerankers entry)")
            model, enc_tokenizer = cross_encoders[name]
            out[name] = CrossEncoderReranker(name, model, enc_tokenizer, encoder_work(model) / unit)
    return out


def is_backbone(name: str) -> bool:
    """Whether a `model.rerankers` entry is a reading of the backbone (nothing to load)."""
    return name == BACKBONE or name.startswith(BACKBONE + "+")
