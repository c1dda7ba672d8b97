"""Plain records shared by loaders, retrievers and pipelines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Passage:
    """One retrievable paragraph (a Wikipedia-like title plus its text)."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """What gets embedded: the title on its own line, then the text."""
        return f"{self.title}\n{self.text}"


@dataclass
class QAExample:
    """One question with its gold answers (EM/F1 take the best match) and, when known, its paragraphs."""

    id: str
    question: str
    golden_answers: list[str]
    type: str | None = None
    supporting_titles: list[str] = field(default_factory=list)
    context: list[Passage] = field(default_factory=list)

