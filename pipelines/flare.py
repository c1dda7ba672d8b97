"""FLARE (Jiang et al., 2023), direct form: retrieve only when the model is unsure of what it is about to say.

Sentence by sentence, generate a look-ahead sentence from the passages held so far (none at first: the question
alone) with each sampled token's probability (the sampler's logprobs, no second pass). If every token is at
least `threshold` likely, keep the sentence; else retrieve with the sentence's confident tokens (the unsure ones
masked out: they would steer the search toward the model's guess) and write the sentence again from those
passages. The chain ends at the sentence that gives the answer ("So the answer is ...") or at `max_steps`, whose
generation writes on to the answer under the run's `answer_format`.

`prompt_style=flashrag` writes every sentence (the look-ahead, and the one written again from the passages) from
FlashRAG's default template (flashrag_prompts.py; the passages, none before the first retrieval) with the sentences
so far appended as FlashRAG's `get_string` appends `previous_gen`, and the answer is the sentences written, as is
(FlashRAG's FLAREPipeline scores its generation unparsed). The loop stays this module's: which passages a sentence
is written from, the sentence split, the trigger, the masked query and when the chain ends. FlashRAG's differ: its
look-ahead never shows passages, its sentences are joined with no space between them, and it stops on a length
budget.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams
from orthrus_rag.pipelines.answers import ParsedAnswer
from orthrus_rag.pipelines.chain import chain_answer, continued, first_sentence, sentence_params
from orthrus_rag.pipelines.flashrag_prompts import default_messages, previous_gen
from orthrus_rag.pipelines.method import Hits, Method, add_new, passage_refs
from orthrus_rag.pipelines.prompts import build_prompt
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.kinds import Retriever


def check_flare(max_steps: int, threshold: float, step_tokens: int) -> None:
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be a probability in (0, 1), got {threshold}")
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be at least 1, got {step_tokens}")


Pieces = list[tuple[str, float]]  # each sampled token's text and probability


def token_pieces(out: Any, tokenizer: Any) -> Pieces:
    """Each sampled token's text and probability: a chat response's logprobs (`out.pieces`, the LangChain
    runnable's), or the engine's ids and logprobs decoded one token at a time (as the server's chat logprobs are)."""
    pieces = getattr(out, "pieces", None)
    if pieces is not None:
        return pieces
    logprobs = getattr(out, "logprobs", None)
    if logprobs is None:
        raise RuntimeError("flare needs each sampled token's logprob; the serving system returned none")
    if tokenizer is None:
        raise RuntimeError("flare reads its sentences' tokens: it needs the generation model's tokenizer")
    return [(tokenizer.decode([lp.token_id]), math.exp(lp.logprob)) for lp in logprobs]


def sentence_pieces(pieces: Pieces, sentence: str) -> Pieces:
    """The leading tokens that make up `sentence` (the generation's first sentence)."""
    text = ""
    for n, (piece, _) in enumerate(pieces, 1):
        text += piece
        if len(text.strip()) >= len(sentence):
            return pieces[:n]
    return pieces


def masked_query(pieces: Pieces, threshold: float) -> str:
    """The sentence with its unsure tokens (probability under `threshold`) left out: FLARE's masked query."""
    return " ".join("".join(piece for piece, p in pieces if p >= threshold).split())


class FLARE(Method):
    """`threshold`: a token less likely than this triggers retrieval for its sentence; `max_steps`: sentences at
    most (the last writes on to the answer); `step_tokens`: the token budget of one look-ahead sentence. Needs a
    retriever and token logprobs from the serving system (the engine's ids are read with `tokenizer`, default: the
    client's; a chat response's logprobs carry their text)."""

    name = "flare"

    def __init__(self, client: EngineClient, retriever: Retriever, k: int = 5, max_steps: int = 5,
                 threshold: float = 0.4, step_tokens: int = 48, tokenizer: Any = None,
                 sampling_params: SamplingParams | None = None, chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free",
                 prompt_style: str = "native") -> None:
        if retriever is None:
            raise ValueError("flare retrieves when unsure: it needs a retriever")
        check_flare(max_steps, threshold, step_tokens)
        super().__init__(client, retriever, k, sampling_params, chat_template, max_concurrency, recall_ks,
                         question_timeout_s, answer_format, prompt_style)
        self.tokenizer = tokenizer or getattr(client, "tokenizer", None)  # only for outputs without pieces
        self.max_steps, self.threshold = max_steps, threshold
        # NOTE: logprobs=0: each sampled token's own log-probability, no alternatives
        self.lookahead_params = sentence_params(self.sampling_params, step_tokens, logprobs=0)
        self.step_params = sentence_params(self.sampling_params, step_tokens)

    def _prompt(self, question: str, passages: Hits | None, thoughts: list[str]) -> str:
        passages_shown = [p for p, _ in passages] if passages is not None else None
        if self.prompt_style == "flashrag":
            return self.render_messages(default_messages(question, passages_shown)) + previous_gen(thoughts)
        return continued(self.render(build_prompt(question, passages_shown)), thoughts)

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        passages: Hits | None = None  # what the latest retrieval found; None until the model is first unsure
        used: Hits = []  # every passage a kept sentence was written from, for recall
        thoughts: list[str] = []
        for t in range(1, self.max_steps + 1):
            final = t == self.max_steps
            prompt = self._prompt(ex.question, passages, thoughts)
            out, generate_s = await self.generate(prompt, self.final_params if final else self.lookahead_params)
            query, hits, retrieve_s = "", [], 0.0
            sentence = out.text.strip() if final else first_sentence(out.text)
            if not final and sentence:
                pieces = sentence_pieces(token_pieces(out, self.tokenizer), sentence)
                if pieces and min(p for _, p in pieces) < self.threshold:
                    query = masked_query(pieces, self.threshold) or ex.question
                    hits, retrieve_s = await self.retrieve(query)
                    passages = hits
                    used = add_new(used, hits)
                    prompt = self._prompt(ex.question, passages, thoughts)
                    again, seconds = await self.generate(prompt, self.step_params)
                    generate_s += seconds
                    sentence = first_sentence(again.text)
            thoughts.append(sentence)
            parsed, ends = chain_answer(thoughts, final, self.answer_format, ex.question)
            if self.prompt_style == "flashrag":
                parsed = ParsedAnswer(" ".join(thoughts).strip(), True)
            await emit(IterationRecord(t, query, passage_refs(hits), prompt, sentence, parsed.answer, retrieve_s,
                                       generate_s, parsed.found))
            if ends:
                break
        return used
