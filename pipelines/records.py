"""What a pipeline keeps per question, so a run can be inspected afterwards (FlashRAG-style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class IterationRecord:
    iteration: int
    query: str
    retrieved: list[dict[str, Any]]  # [{"id", "title", "score"}], best first
    prompt: str
    generation: str
    answer: str
    retrieve_s: float  # query embedding + index search
    generate_s: float


@dataclass
class QARecord:
    id: str
    question: str
    golden_answers: list[str]
    type: str | None
    supporting_titles: list[str]
    iterations: list[IterationRecord] = field(default_factory=list)
    prediction: str = ""
    em: float = 0.0
    f1: float = 0.0
    recall: dict[str, float | None] = field(default_factory=dict)  # "recall@k" of the last retrieval
    latency_s: float = 0.0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
