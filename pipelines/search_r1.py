"""Reasoning search (Search-R1, Jin et al., 2025, and its kin R1-Searcher and ReSearch): the model itself decides,
mid-generation, when to search.

It reasons inside think tags and, when it lacks a fact, writes a search tag with a query. The generation stops at
the tag's end; the query is retrieved for (its embedding runs at query priority, in the same engine steps as other
questions' decodes), the top-k passages are appended inside an information tag and the generation goes on from
there, up to `max_searches` times. The answer is what the model writes inside the answer tags; after the last
allowed search the model is left to answer (a further search tag gets no results).

Continuation: where the client continues a finished generation with its KV kept (the in-process engine's
`continue_`, engine/continuation.py), each round continues the previous one's token sequence, so a round computes
only the appended passages. Elsewhere (`continuation=false`, a remote server, a peer) each round re-submits the whole
text, and only a prefix cache saves the repeated part. The records keep, per search, the query, the passages and
the tokens generated and computed.

`tags` picks the protocol's spelling: `search_r1` (<search>, <information>, <answer>), `r1_searcher`
(<|begin_of_query|>, <|begin_of_documents|>, <answer>) or `research` (<search>, <result>, an answer in \\boxed{}).
The instructions are written for this project in each protocol's terms. `constrain_format` makes every round follow
the protocol through the engine's structured outputs (reasoning, then one search or the answer): a model not
trained on the tags, like the small offline one, then still searches and answers in them; with it, `min_searches`
rounds must search before one may answer (SmolLM2-135M answers at once otherwise, as it does under Self-Ask).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.params import SamplingParams, StructuredOutputsParams
from orthrus_rag.pipelines.answers import parse_answer, reduce_yes_no
from orthrus_rag.pipelines.method import Hits, Method, add_new, passage_refs, prefilled_tokens
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.kinds import Retriever

HOLD_KV_S = 30.0  # how long a round's KV waits for its search (released earlier when running work needs the blocks)


@dataclass(frozen=True)
class Tags:
    """One protocol's spelling of the tags, and its instruction (`{question}` filled in)."""

    search: tuple[str, str]
    information: tuple[str, str]
    answer: tuple[str, str]
    instruction: str
    think: tuple[str, str] = ("<think>", "</think>")
    boxed: bool = False  # the answer is written as \boxed{...} inside the answer tags


TAGS: dict[str, Tags] = {
    "search_r1": Tags(
        ("<search>", "</search>"), ("<information>", "</information>"), ("<answer>", "</answer>"),
        "Answer the question below. Each time you get new information, reason about it inside <think> and "
        "</think>. If some knowledge is missing, search for it by writing <search> your query </search>: the "
        "best passages come back between <information> and </information>. Search as often as you need. When "
        "you know the answer, write it inside <answer> and </answer>, with no explanation.\nQuestion: {question}"),
    "r1_searcher": Tags(
        ("<|begin_of_query|>", "<|end_of_query|>"), ("<|begin_of_documents|>", "<|end_of_documents|>"),
        ("<answer>", "</answer>"),
        "Answer the question below, thinking step by step inside <think> and </think>. When you need a fact you "
        "do not know, write a search query between <|begin_of_query|> and <|end_of_query|>; the retrieved "
        "documents follow between <|begin_of_documents|> and <|end_of_documents|>. Give the final answer, only "
        "the answer, between <answer> and </answer>.\nQuestion: {question}"),
    "research": Tags(
        ("<search>", "</search>"), ("<result>", "</result>"), ("<answer>", "</answer>"),
        "Answer the question below. Reason inside <think> and </think>; to look something up, write the query "
        "inside <search> and </search>, and the results appear inside <result> and </result>. Finish with the "
        "answer inside <answer> and </answer>, written as \\boxed{{answer}}.\nQuestion: {question}",
        boxed=True),
}
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def check_search_r1(max_searches: int, step_tokens: int, tags: str, answer_format: str = "free",
                    min_searches: int = 0, constrain_format: bool = False) -> None:
    if answer_format != "free":
        raise ValueError(f"search_r1 reads its answer from the answer tags; answer_format must be free, got "
                         f"{answer_format!r} (pipeline.constrain_format=true makes the model write the tags)")
    if max_searches < 0:
        raise ValueError(f"max_searches must be at least 0, got {max_searches}")
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be at least 1, got {step_tokens}")
    if not 0 <= min_searches <= max_searches:
        raise ValueError(f"min_searches must be between 0 and max_searches ({max_searches}), got {min_searches}")
    if min_searches and not constrain_format:
        raise ValueError("min_searches needs constrain_format=true: only the grammar can hold an answer back")
    if tags not in TAGS:
        raise ValueError(f"unknown tags {tags!r}; expected one of {', '.join(TAGS)}")


def between(text: str, tags: tuple[str, str]) -> str | None:
    """The text inside the last complete `tags` pair of `text` (None: there is none)."""
    end = text.rfind(tags[1])
    start = text.rfind(tags[0], 0, end) if end != -1 else -1
    return text[start + len(tags[0]):end].strip() if start != -1 else None


def left_open(text: str, tags: tuple[str, str]) -> str | None:
    """The text after a last opening tag that was never closed (a round cut by its token budget), else None."""
    start = text.rfind(tags[0])
    return text[start + len(tags[0]):].strip() if start != -1 and text.find(tags[1], start) == -1 else None


def round_grammar(tags: Tags, may_search: bool, may_answer: bool = True,
                  think_chars: int = 256) -> StructuredOutputsParams:
    """One round in the protocol: reasoning (at most `think_chars` characters, so the round's budget leaves room for
    the rest), then a search (while one is allowed) or the answer (once enough searches ran). No tag may open inside
    another, so each part is free text without '<'."""
    def esc(s: str) -> str:
        return re.escape(s)

    free, said = r"[^<]{0,%d}" % think_chars, r" ?[^<\s][^<]*"  # a query or an answer says something
    think = esc(tags.think[0]) + free + esc(tags.think[1]) + r"\s?"
    answer = esc(tags.answer[0]) + (r" ?\\boxed\{[^<{}\s][^<{}]*\} ?" if tags.boxed else said) + esc(tags.answer[1])
    search = esc(tags.search[0]) + said + esc(tags.search[1])
    ends = [part for part, allowed in ((search, may_search), (answer, may_answer)) if allowed]
    return StructuredOutputsParams(regex=think + (f"({'|'.join(ends)})" if len(ends) > 1 else ends[0]))


class SearchR1(Method):
    """`max_searches`: searches at most before the model must answer; `step_tokens`: the token budget of one round
    (reasoning and a search or the answer); `tags`: search_r1 | r1_searcher | research; `constrain_format`: each
    round follows the protocol (structured outputs); `min_searches`: under it, the rounds that must search before an
    answer; `continuation`: continue each round with its KV kept where the
    client can (else re-submit the text). Needs a retriever; the answer is the answer tags' content, so
    `answer_format` stays free. `prompt_style=flashrag` leaves it as it is: the tags are a trained protocol, and
    FlashRAG 0.1.2 has no such method."""

    name = "search_r1"

    def __init__(self, client: EngineClient, retriever: Retriever, k: int = 3, max_searches: int = 4,
                 step_tokens: int = 128, tags: str = "search_r1", constrain_format: bool = False,
                 continuation: bool = True, min_searches: int = 0, sampling_params: SamplingParams | None = None,
                 chat_template: Any = None,
                 max_concurrency: int | None = None, recall_ks: Sequence[int] = (2, 5),
                 question_timeout_s: float | None = None, answer_format: str = "free",
                 prompt_style: str = "native") -> None:
        if retriever is None:
            raise ValueError("search_r1 retrieves when the model asks: it needs a retriever")
        check_search_r1(max_searches, step_tokens, tags, answer_format, min_searches, constrain_format)
        super().__init__(client, retriever, k, sampling_params, chat_template, max_concurrency, recall_ks,
                         question_timeout_s, answer_format, prompt_style)
        self.max_searches, self.tags = max_searches, TAGS[tags]
        self.continuation = continuation and self.can_continue
        stop = [*(self.sampling_params.stop or []), self.tags.search[1], self.tags.answer[1]]
        base = dataclasses.replace(self.sampling_params, max_tokens=step_tokens, stop=stop,
                                   include_stop_str_in_output=True,
                                   hold_kv_s=HOLD_KV_S if self.continuation else 0.0)
        # NOTE: rounds that must search, rounds that may search or answer, and the last one (the answer only, holding
        # no KV)
        self.min_searches = min_searches
        self.must_search_params = self.search_params = base
        self.answer_params = dataclasses.replace(base, hold_kv_s=0.0)
        if constrain_format:
            # NOTE: reasoning takes at most about half a round's tokens (~4 characters a token)
            think = 2 * step_tokens
            self.must_search_params = dataclasses.replace(
                base, structured_outputs=round_grammar(self.tags, True, False, think))
            self.search_params = dataclasses.replace(base, structured_outputs=round_grammar(self.tags, True, True,
                                                                                            think))
            self.answer_params = dataclasses.replace(self.answer_params,
                                                     structured_outputs=round_grammar(self.tags, False, True, think))

    def information(self, hits: Hits) -> str:
        """The passages appended after a search, in the protocol's information tags."""
        docs = "\n".join(f"Doc {i} (Title: {p.title}) {p.text}" for i, (p, _) in enumerate(hits, start=1))
        return f"\n\n{self.tags.information[0]}\n{docs}\n{self.tags.information[1]}\n\n"

    def parse(self, text: str, question: str) -> tuple[str, bool]:
        """The answer in the last answer tags (inside \\boxed{} where the protocol writes it), and whether there was
        one; else the shared fallback rules over the whole text."""
        inside = between(text, self.tags.answer)
        if inside is not None:
            boxed = _BOXED.search(inside) if self.tags.boxed else None
            return reduce_yes_no((boxed.group(1) if boxed else inside).strip(), question), True
        cut = left_open(text, self.tags.answer)  # NOTE: the budget ended inside the answer: what it wrote of it
        if cut:
            return reduce_yes_no(cut.removeprefix("\\boxed{").rstrip("}").strip(), question), False
        return parse_answer(text, question).answer, False

    def search_of(self, text: str) -> tuple[str | None, str]:
        """The query a round ends with, and what closes its tag: "" when the model closed it (the stop string), the
        closing tag when the round's budget ended inside the query (it is searched as written)."""
        if text.rstrip().endswith(self.tags.search[1]):
            return between(text, self.tags.search), ""
        cut = left_open(text, self.tags.search)
        return (cut, self.tags.search[1]) if cut else (None, "")

    async def _loop(self, rec: QARecord, ex: QAExample, emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        prompt = self.render(self.tags.instruction.format(question=ex.question))
        rid = f"search-r1-{uuid.uuid4().hex[:16]}"
        try:
            return await self._rounds(prompt, rid, ex, emit)
        finally:
            release = getattr(self.client, "release", None) if self.continuation else None
            if release is not None:  # NOTE: the question is done: its last round's KV need not wait for a deadline
                await release(rid)

    async def _rounds(self, prompt: str, rid: str, ex: QAExample,
                      emit: Callable[[IterationRecord], Awaitable[None]]) -> Hits:
        used: Hits = []
        written = ""  # the model's turn so far: its rounds and the appended passages
        added = prompt  # what this round added before the model wrote (the prompt, then each round's passages)
        for t in range(1, self.max_searches + 2):
            before = added
            params = (self.must_search_params if t <= self.min_searches else
                      self.search_params if t <= self.max_searches else self.answer_params)
            if t == 1:
                out, generate_s = await self.generate(prompt, params, request_id=rid if self.continuation else None)
            elif self.continuation:
                out, generate_s = await self.continue_(rid, added, params)
            else:
                out, generate_s = await self.generate(prompt + written, params)
            written += out.text
            tokens, prefilled = len(getattr(out, "token_ids", None) or ()), prefilled_tokens(out)
            query, closing = self.search_of(out.text)
            if not query or t > self.max_searches:  # NOTE: an empty query has nothing to search for
                answer, found = self.parse(out.text if self.tags.answer[0] in out.text else written, ex.question)
                await emit(IterationRecord(t, "", [], before, out.text, answer, 0.0, generate_s, found, tokens,
                                           prefilled))
                return used
            hits, retrieve_s = await self.retrieve(query)
            used = add_new(used, hits)
            added = closing + self.information(hits)
            written += added
            await emit(IterationRecord(t, query, passage_refs(hits), before, out.text, "", retrieve_s, generate_s,
                                       False, tokens, prefilled))
        return used
