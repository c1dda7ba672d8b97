"""Multi-hop QA loaders: local JSONL (2Wiki / HotpotQA / FlashRAG shapes), the hub via `datasets`, or synthetic."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orthrus_rag.data.synthetic import make_synthetic
from orthrus_rag.data.types import Passage, QAExample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives on the hub (`hub_id` None: generated locally, or read only from a file)."""

    hub_id: str | None
    config: str | None = None
    split: str = "validation"
    file_only: bool = False  # the user's own questions: read from `path`, nothing to fetch or generate


DATASETS: dict[str, DatasetSpec] = {
    "2wiki": DatasetSpec("framolfese/2WikiMultihopQA", None, "validation"),
    "hotpotqa": DatasetSpec("hotpotqa/hotpot_qa", "distractor", "validation"),
    "synthetic": DatasetSpec(None),
    "jsonl": DatasetSpec(None, file_only=True),
    # FlashRAG's dataset files ({"id", "question", "golden_answers", "metadata"} a line): any of its benchmarks
    "flashrag": DatasetSpec(None, file_only=True),
}


class DatasetUnavailableError(RuntimeError):
    """The hub could not provide the dataset (offline, wrong id, or wrong split)."""


def load_qa(name: str, path: str | Path | None = None, hub_id: str | None = None, split: str | None = None,
            limit: int | None = None, hub_config: str | None = None) -> list[QAExample]:
    """Load up to `limit` examples of dataset `name` from `path` (JSONL) or, without one, from the hub."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if path is not None:
        examples = list(_read_file(Path(path).expanduser(), limit))
        logger.info("loaded %d %s examples from %s", len(examples), name, path)
        return examples
    spec = DATASETS[name]
    if spec.file_only:
        raise ValueError(f"dataset {name!r} reads your own questions: give dataset.path=FILE (JSONL, a "
                         '{"question": ..., "golden_answers": [...]} object a line)')
    if spec.hub_id is None:
        if hub_id is not None:
            raise ValueError(f"dataset {name!r} is generated locally and has no hub id (got hub_id={hub_id!r})")
        return make_synthetic(num_questions=60 if limit is None else limit)
    # NOTE: the default config belongs to the default id; another id gets only the config it is given
    config = hub_config if hub_config is not None else (spec.config if hub_id in (None, spec.hub_id) else None)
    return _load_hub(name, hub_id or spec.hub_id, config, split or spec.split, limit)


def build_corpus(examples: list[QAExample]) -> list[Passage]:
    """Union of all context paragraphs, de-duplicated by title (first wins), in order, with ids p0, p1, ..."""
    corpus: list[Passage] = []
    seen: set[str] = set()
    for ex in examples:
        for p in ex.context:
            if p.title not in seen:
                seen.add(p.title)
                corpus.append(Passage(id=f"p{len(corpus)}", title=p.title, text=p.text))
    return corpus


def _load_hub(name: str, hub_id: str, config: str | None, split: str, limit: int | None) -> list[QAExample]:
    """Load through `datasets.load_dataset`; any failure becomes one error that says how to work offline."""
    where = f"{hub_id!r} (config={config!r}, split={split!r})"
    hint = (f"pass a local file with dataset.path=/path/to/{name}.jsonl for offline use "
            "(2WikiMultihopQA, HotpotQA or FlashRAG JSONL)")
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"loading {where} from the hub needs `pip install datasets`; or {hint}") from exc
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as exc:  # NOTE: offline, unknown id/split or a broken cache all need the same advice
        raise DatasetUnavailableError(f"could not load {name!r} from the hub {where}: "
                                      f"{type(exc).__name__}: {exc}. {hint}") from exc
    n = len(ds) if limit is None else min(limit, len(ds))
    examples = []
    for i in range(n):
        try:
            examples.append(_to_example(dict(ds[i]), f"{name}-{i}"))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{where} row {i}: {exc}") from exc
    logger.info("loaded %d %s examples from the hub %s", len(examples), name, where)
    return examples


def _read_file(path: Path, limit: int | None) -> Iterator[QAExample]:
    """Yield examples from JSONL (one object a line) or a JSON array file such as the original dev.json."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    if limit == 0:
        return
    with path.open(encoding="utf-8") as f:
        head = f.read(1024).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                records = enumerate(json.load(f), start=1)
            except ValueError as exc:
                raise ValueError(f"{path}: not a valid JSON array ({exc})") from exc
            unit = "record"
        else:
            records = ((i, line) for i, line in enumerate(f, start=1) if line.strip())
            unit = "line"
        count = 0
        for lineno, rec in records:
            try:
                if isinstance(rec, str):
                    rec = json.loads(rec)
                if not isinstance(rec, dict):
                    raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
                yield _to_example(rec, f"{path.stem}-{lineno - 1}")
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}: {unit} {lineno}: cannot read example: {exc}") from exc
            count += 1
            if limit is not None and count >= limit:
                return


def _to_example(rec: dict[str, Any], fallback_id: str) -> QAExample:
    """Map one record (2Wiki, HotpotQA, FlashRAG or `datasets` column shapes) to a QAExample."""
    meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
    question = rec.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing or empty 'question'")
    answers = rec.get("golden_answers", rec.get("answer", meta.get("answer")))
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError("missing 'golden_answers' (a list of strings) or 'answer' (a string)")
    ex_id = next((rec[k] for k in ("id", "_id", "flashrag_id") if rec.get(k) is not None), fallback_id)
    context = _paragraphs(rec.get("context", meta.get("context")))
    return QAExample(
        id=str(ex_id),
        question=question.strip(),
        golden_answers=list(answers),
        type=rec.get("type", meta.get("type")),
        supporting_titles=_supporting_titles(rec.get("supporting_facts", meta.get("supporting_facts"))),
        context=[Passage(id=f"{ex_id}#{k}", title=t, text=text) for k, (t, text) in enumerate(context)],
    )


def _paragraphs(context: Any) -> list[tuple[str, str]]:
    """(title, text) pairs from [[title, [sent, ...]], ...], {title: [...], sentences|content: [...]} or dicts."""
    if context is None:
        return []
    if isinstance(context, dict):  # columnar (`datasets`, FlashRAG metadata)
        titles = context.get("title")
        bodies = next((context[k] for k in ("sentences", "content", "text") if k in context), None)
        if not isinstance(titles, list) or not isinstance(bodies, list) or len(titles) != len(bodies):
            raise ValueError("'context' dict needs equal-length 'title' and 'sentences' lists")
        context = list(zip(titles, bodies))
    if not isinstance(context, list):
        raise ValueError(f"'context' must be a list, got {type(context).__name__}")
    out = []
    for item in context:
        if isinstance(item, dict):
            item = (item.get("title"), next((item[k] for k in ("sentences", "content", "text") if k in item), None))
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"bad 'context' entry {str(item)[:80]!r}; expected [title, [sentence, ...]]")
        title, body = item
        sentences = [body] if isinstance(body, str) else body
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise ValueError(f"bad sentences for context title {title!r}")
        out.append((title.strip(), _join(sentences)))
    return out


def _supporting_titles(facts: Any) -> list[str]:
    """Gold titles, in order, without repeats, from [[title, idx], ...] or {title: [...], sent_id: [...]}."""
    if facts is None:
        return []
    if isinstance(facts, dict):
        facts = [[t] for t in facts.get("title", [])]
    if not isinstance(facts, list):
        raise ValueError(f"'supporting_facts' must be a list, got {type(facts).__name__}")
    titles: list[str] = []
    for fact in facts:
        title = fact if isinstance(fact, str) else (fact[0] if isinstance(fact, (list, tuple)) and fact else None)
        if not isinstance(title, str):
            raise ValueError(f"bad 'supporting_facts' entry {fact!r}; expected [title, sentence_index]")
        if title.strip() not in titles:
            titles.append(title.strip())
    return titles


def _join(sentences: list[str]) -> str:
    """Sentences joined by single spaces, with runs of whitespace collapsed."""
    return re.sub(r"\s+", " ", " ".join(s.strip() for s in sentences if s.strip())).strip()
