"""Where a retriever's passages come from (the `corpus` config group), as one stream of `Passage`s:

- `contexts`: the QA dataset's own context paragraphs (`build_corpus`: the distractor setting);
- `jsonl`: a FlashRAG JSONL file (`{"id", "contents"}` with contents "title\\ntext", or `title` + `text`), `.gz` too;
- `hf`: a `datasets` dataset by name / config / split with a text column, streamed (never downloaded whole);
- `files`: a folder of .txt / .md files cut into passages by a token-aware splitter (`langchain-text-splitters`).

Bad input stops the stream with a `CorpusError` (a ValueError: the CLI exits 2) naming the file and line. A stream
is deterministic: the index builder resumes a killed build by reading it again and skipping what is done.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orthrus_rag.data.types import Passage

logger = logging.getLogger(__name__)

CORPUS_KINDS = ("contexts", "jsonl", "hf", "files")
FILE_SUFFIXES = (".txt", ".md")


class CorpusError(ValueError):
    """A corpus that cannot be read; the message names the file (and line) and what is wrong."""


def corpus_identity(conf: Any) -> dict[str, Any]:
    """What a corpus is, for an index build's resume check: its settings, and a file's size (a changed file is
    another corpus)."""
    fields = ("kind", "path", "hub_id", "config", "split", "data_files", "text_field", "title_field", "id_field",
              "chunk_tokens", "chunk_overlap", "limit")
    identity = {k: _plain(getattr(conf, k, None)) for k in fields}
    path = getattr(conf, "path", None)
    if conf.kind == "jsonl" and path and Path(path).is_file():
        identity["size"] = Path(path).stat().st_size
    return identity


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return list(value) if not isinstance(value, dict) else dict(value)


def iter_corpus(conf: Any, contexts: Callable[[], list[Passage]] | None = None,
                count_tokens: Callable[[str], int] | None = None) -> Iterator[Passage]:
    """The passages `conf` (a `CorpusConf`) names, in a fixed order, at most `conf.limit` of them.

    `contexts`: gives the dataset's context paragraphs (kind `contexts`); `count_tokens`: the token count the
    `files` splitter cuts by (default: words)."""
    kind = conf.kind
    if kind not in CORPUS_KINDS:
        raise CorpusError(f"unknown corpus kind {kind!r}; expected one of {', '.join(CORPUS_KINDS)}")
    if kind == "contexts":
        if contexts is None:
            raise CorpusError("corpus=contexts needs the dataset's examples")
        stream: Iterator[Passage] = iter(contexts())
    elif kind == "jsonl":
        stream = read_jsonl(_required_path(conf, "a FlashRAG JSONL file"), conf.id_field, conf.title_field,
                            conf.text_field)
    elif kind == "hf":
        stream = read_hf(conf)
    else:
        stream = read_files(_required_path(conf, "a folder of .txt / .md files"), conf.chunk_tokens,
                            conf.chunk_overlap, count_tokens)
    limit = conf.limit
    for n, passage in enumerate(stream):
        if limit is not None and n >= limit:
            return
        yield passage


def count_passages(conf: Any) -> int | None:
    """How many passages a corpus holds, where that is cheap to know (for a progress bar's ETA); else None."""
    total = None
    if conf.kind == "jsonl" and conf.path and Path(conf.path).is_file():
        with _open_text(Path(conf.path)) as f:
            total = sum(1 for line in f if line.strip())
    return min(total, conf.limit) if total is not None and conf.limit is not None else total


def _required_path(conf: Any, what: str) -> Path:
    if not conf.path:
        raise CorpusError(f"corpus={conf.kind} needs corpus.path: {what}")
    path = Path(os.path.expanduser(conf.path))
    if not path.exists():
        raise CorpusError(f"corpus.path {path} does not exist")
    return path


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


# ---- jsonl ------------------------------------------------------------------------------------------------------
def read_jsonl(path: Path, id_field: str | None = None, title_field: str | None = None,
               text_field: str | None = None) -> Iterator[Passage]:
    """FlashRAG JSONL: one object a line with `contents` ("title\\ntext", the title line optional) or `text` (and
    `title`); `id` optional (default: the line number). The fields may be renamed; others are ignored."""
    if not path.is_file():
        raise CorpusError(f"corpus.path {path} is not a file")
    with _open_text(path) as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{num}: not a JSON object ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise CorpusError(f"{path}:{num}: expected a JSON object, got {type(row).__name__}")
            try:
                yield _row_passage(row, str(num - 1), id_field, title_field, text_field)
            except CorpusError as exc:
                raise CorpusError(f"{path}:{num}: {exc}") from None


def _row_passage(row: dict[str, Any], fallback_id: str, id_field: str | None, title_field: str | None,
                 text_field: str | None) -> Passage:
    """One record as a Passage: the named fields, else `contents` or `text` (+ `title`). A null field counts as
    absent (a `datasets` table fills in the columns a row lacks with nulls)."""
    row = {k: v for k, v in row.items() if v is not None}
    for name in (id_field, title_field, text_field):
        if name is not None and name not in row:
            raise CorpusError(f"no field {name!r} (the record has {', '.join(sorted(row)) or 'no fields'})")
    text_key = text_field or next((k for k in ("contents", "text") if k in row), None)
    if text_key is None:
        raise CorpusError(f"no 'contents' or 'text' field (the record has {', '.join(sorted(row)) or 'none'}); "
                          "set corpus.text_field")
    body = row[text_key]
    if not isinstance(body, str):
        raise CorpusError(f"field {text_key!r} is a {type(body).__name__}, not a string")
    title_key = title_field or ("title" if "title" in row else None)
    if title_key is not None:
        title, text = str(row[title_key] or ""), body
        first, _, rest = body.partition("\n")
        if text_key == "contents" and rest and first.strip().strip('"') == title.strip().strip('"'):
            text = rest  # NOTE: FlashRAG's `contents` repeats the title as its first line
    elif text_key == "contents" and "\n" in body:  # NOTE: FlashRAG's "title\ntext"
        title, text = body.split("\n", 1)
    else:
        title, text = "", body
    title, text = title.strip().strip('"'), text.strip()
    if not text:
        raise CorpusError(f"empty passage (field {text_key!r} has no text)")
    pid = row.get(id_field or "id")
    return Passage(str(pid) if pid is not None else fallback_id, title, text)


# ---- hf ---------------------------------------------------------------------------------------------------------
def read_hf(conf: Any) -> Iterator[Passage]:
    """A `datasets` dataset, streamed row by row (`streaming=True`: nothing is downloaded whole)."""
    import datasets

    if not conf.hub_id:
        raise CorpusError("corpus=hf needs corpus.hub_id: a dataset name on the hub or a loader such as 'json' "
                          "with corpus.data_files")
    where = f"{conf.hub_id!r} (config={conf.config!r}, split={conf.split!r})"
    try:
        rows = datasets.load_dataset(conf.hub_id, conf.config, split=conf.split, streaming=True,
                                     data_files=_plain(conf.data_files))
    except Exception as exc:  # NOTE: offline, unknown id / split: one message that says what was asked
        raise CorpusError(f"could not open the corpus {where}: {type(exc).__name__}: {exc}") from exc
    for num, row in enumerate(rows):
        try:
            yield _row_passage(dict(row), str(num), conf.id_field, conf.title_field, conf.text_field)
        except CorpusError as exc:
            raise CorpusError(f"{where} row {num}: {exc}") from None


# ---- files ------------------------------------------------------------------------------------------------------
def read_files(folder: Path, chunk_tokens: int, chunk_overlap: int,
               count_tokens: Callable[[str], int] | None = None) -> Iterator[Passage]:
    """Every .txt / .md file under `folder` (sorted, recursive) cut into passages of at most `chunk_tokens` tokens
    with `chunk_overlap` tokens shared between neighbours; a passage's title is its file's path in the folder."""
    if not folder.is_dir():
        raise CorpusError(f"corpus=files needs a folder; {folder} is a file")
    if chunk_tokens < 1 or not 0 <= chunk_overlap < chunk_tokens:
        raise CorpusError(f"corpus.chunk_tokens must be >= 1 and 0 <= chunk_overlap < chunk_tokens, got "
                          f"{chunk_tokens} / {chunk_overlap}")
    splitters = {suffix: text_splitter(suffix == ".md", chunk_tokens, chunk_overlap, count_tokens)
                 for suffix in FILE_SUFFIXES}
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
    if not files:
        raise CorpusError(f"{folder} holds no {' or '.join(FILE_SUFFIXES)} files")
    for path in files:
        rel = path.relative_to(folder).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        chunks = split_text(splitters[path.suffix.lower()], text)
        if not chunks:
            logger.warning("%s holds no text; skipped", path)
        for k, chunk in enumerate(chunks):
            yield Passage(f"{rel}#{k}", rel, chunk)


def text_splitter(markdown: bool, chunk_tokens: int, chunk_overlap: int,
                  count_tokens: Callable[[str], int] | None = None) -> Any:
    """A splitter into passages of at most `chunk_tokens` tokens (`count_tokens`; default: words), neighbours sharing
    `chunk_overlap`, cut at paragraph, then line, sentence and word boundaries (Markdown's headings first)."""
    from langchain_text_splitters import Language, RecursiveCharacterTextSplitter

    separators = RecursiveCharacterTextSplitter.get_separators_for_language(Language.MARKDOWN) if markdown else None
    return RecursiveCharacterTextSplitter(separators=separators, chunk_size=chunk_tokens, chunk_overlap=chunk_overlap,
                                          length_function=count_tokens or (lambda text: len(text.split())))


def split_text(splitter: Any, text: str) -> list[str]:
    """The non-empty passages of `text`."""
    return [c.strip() for c in splitter.split_text(text) if c.strip()]
