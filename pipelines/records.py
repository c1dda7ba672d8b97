"""What a pipeline keeps per question, so a run can be inspected (FlashRAG-style) and resumed afterwards.

Each iteration keeps the raw generation beside the answer parsed from it; the question's scores are those of the
last iteration's answer. `index` (the question's position in the dataset) and `session` / `finished_s` (which run
of a resumed run recorded it, and when after that session's start) let a run be resumed and timed from its
records alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class IterationRecord:
    iteration: int
    query: str
    retrieved: list[dict[str, Any]]  # [{"id", "title", "score"}], best first
    prompt: str
    generation: str  # raw, as the model wrote it
    answer: str  # parsed from the generation (answers.parse_answer)
    retrieve_s: float  # query embedding + index search
    generate_s: float
    answer_found: bool = True  # the prompt's "So the answer is" was there (False: a fallback rule found the answer)
    # the step's generations: tokens generated, and prompt tokens computed (not served by the prefix cache); 0
    # where the serving system does not say (a remote server)
    generated_tokens: int = 0
    prefilled_tokens: int = 0


@dataclass
class QARecord:
    id: str
    question: str
    golden_answers: list[str]
    type: str | None
    supporting_titles: list[str]
    iterations: list[IterationRecord] = field(default_factory=list)
    prediction: str = ""  # the last iteration's parsed answer
    em: float = 0.0
    f1: float = 0.0
    acc: float = 0.0
    recall: dict[str, float | None] = field(default_factory=dict)  # "recall@k" of the last retrieval
    latency_s: float = 0.0
    generated_tokens: int = 0  # over every generation of the question's loop (how much a method generates)
    # prompt tokens its generations computed, the prefix cache's hits left out (0 where the serving system does not
    # report hits: a remote server)
    prefilled_tokens: int = 0
    error: str | None = None
    # the failure was the serving system's, not the question's (its replica died, the question timed out): a
    # resume asks it again (`retry_failed`), where a bad input would only fail the same way
    retryable: bool = False
    index: int = -1  # position in the dataset
    session: int = 0  # 0: the first run into this folder; n: its n-th resume
    finished_s: float = 0.0  # seconds after the session's pipeline started

    @property
    def raw_generation(self) -> str:
        return self.iterations[-1].generation if self.iterations else ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "QARecord":
        """The inverse of `to_json` (unknown keys are ignored, so older records still read)."""
        known = {f.name for f in fields(cls)}
        rec = cls(**{k: v for k, v in row.items() if k in known and k != "iterations"})
        it_known = {f.name for f in fields(IterationRecord)}
        rec.iterations = [IterationRecord(**{k: v for k, v in it.items() if k in it_known})
                          for it in row.get("iterations", [])]
        return rec


def ask_again(rec: QARecord, retry_failed: str) -> bool:
    """Whether a resume (`retry_failed`: retryable / all / none) asks this recorded question again."""
    if rec.error is None or retry_failed == "none":
        return False
    return retry_failed == "all" or rec.retryable
