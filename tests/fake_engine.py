"""A model-free stand-in for `Engine` behind the real `AsyncEngine` (an `EngineClient`), for run-level tests
where the model is not the point: thousands of questions, timeouts, full disks, sweeps.

Each generation finishes after `steps_per_request` steps (at most `max_num_seqs` requests advance per step) with
the text `answer_for(question)` gives; a question containing "hang" never finishes. Every step reports a
`StepStats` to the observers as the real engine does. Questions come from `qa_rows`: "What is item <i>?" with the
golden answer "item <i>" and three kinds of generations (see `answer_for`), so the expected scores are known.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from orthrus_rag.outputs import GenerationOutput, StepStats
from orthrus_rag.params import EmbeddingSpace


def answer_for(question: str) -> str:
    """i % 3 == 0: the prompt's format, right (EM 1); 1: no answer phrase, the answer inside a sentence (EM 0,
    acc 1); 2: the format, wrong answer (all 0)."""
    i = int(re.search(r"item (\d+)", question).group(1))
    if i % 3 == 0:
        return f"The list names item {i}. So the answer is item {i}."
    if i % 3 == 1:
        return f"It must be item {i} from the list"
    return "Nothing in the passages says. So the answer is unknown."


def expected_scores(indices: range | list[int]) -> dict[str, float]:
    n = len(indices)
    return {"em": sum(i % 3 == 0 for i in indices) / n, "acc": sum(i % 3 in (0, 1) for i in indices) / n}


def qa_rows(n: int, hang: set[int] = frozenset()) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "question": f"What is item {i}?" + (" (hang)" if i in hang else ""),
             "golden_answers": [f"item {i}"], "type": "fake"} for i in range(n)]


def write_dataset(path: Path, n: int, hang: set[int] = frozenset()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(n, hang)))
    return path


def _question(prompt: str) -> str:
    return prompt.rsplit("Question: ", 1)[-1].split("\n", 1)[0]


class FakeEngine:
    def __init__(self, steps_per_request: int = 2, max_num_seqs: int = 64, policy: str = "orthrus",
                 num_threads: int | None = None) -> None:
        self.steps_per_request, self.max_num_seqs = steps_per_request, max_num_seqs
        self.config = SimpleNamespace(scheduler=SimpleNamespace(policy=policy), num_threads=num_threads)
        self.embedding_space = EmbeddingSpace("fake")
        self.tokenizer = SimpleNamespace(chat_template=None)
        self.encoder_pooling: dict = {}
        self.block_manager = SimpleNamespace()
        self.step_observers: list = []
        self.requests: dict[str, SimpleNamespace] = {}
        self.num_steps = 0
        self.max_requests = 0  # the most unfinished requests seen at once
        self.aborted: list[str] = []
        self._lock = threading.Lock()

    def add_generate(self, prompt: str, params: Any = None, request_id: str | None = None,
                     stream: bool = False, handoff: bool = False) -> str:
        question = _question(prompt)
        req = SimpleNamespace(prompt_token_ids=[1, 2, 3], output_token_ids=[], output_text="",
                              left=10**9 if "hang" in question else self.steps_per_request,
                              text=" " + answer_for(question))
        with self._lock:
            self.requests[request_id] = req
            self.max_requests = max(self.max_requests, len(self.requests))
        return request_id

    def add_embed(self, text: Any, params: Any = None, request_id: str | None = None) -> str:
        raise ValueError("the fake engine does not embed")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> GenerationOutput | None:
        with self._lock:
            req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.aborted.append(request_id)
        return GenerationOutput(request_id, req.prompt_token_ids, [], "", "abort")

    def unfinished_request_ids(self) -> list[str]:
        with self._lock:
            return list(self.requests)

    def step(self) -> list[GenerationOutput]:
        running = list(self.requests.items())[: self.max_num_seqs]
        outputs = []
        for rid, req in running:
            req.left -= 1
            if req.left <= 0:
                with self._lock:
                    del self.requests[rid]
                outputs.append(GenerationOutput(rid, req.prompt_token_ids, [7], req.text, "stop"))
        waiting = max(0, len(self.requests) - len(running))
        stats = StepStats(self.num_steps, 0, 0, len(running), 0, len(running), waiting, len(running), 0, len(running),
                          step_time=1e-4)
        for observe in self.step_observers:
            observe(stats)
        self.num_steps += 1
        return outputs


def fake_client(max_in_flight: int = 64, **kwargs: Any):  # -> AsyncEngine over a FakeEngine
    from orthrus_rag.engine.async_engine import AsyncEngine

    return AsyncEngine(FakeEngine(**kwargs), max_in_flight=max_in_flight)
