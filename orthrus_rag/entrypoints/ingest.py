"""Documents ingested into a running `orthrus-rag run`'s index (`ingest.path`): streamed from a corpus file into
the run's `LiveIndex` while its questions are answered, as bulk work in the same engine steps (below the
questions' queries and generations), each batch searchable by the next query once it lands, and kept in the
index folder. A resumed run reads the file again and skips the documents already present."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from orthrus_rag.data.types import Passage

logger = logging.getLogger(__name__)
LOG_EVERY_S = 30.0


@dataclass
class IngestReport:
    added: int = 0
    skipped: int = 0  # present already (a resumed run, or documents the index was built with)
    seconds: float = 0.0
    finished: bool = False

    @property
    def passages_per_s(self) -> float:
        return self.added / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"added": self.added, "skipped": self.skipped, "seconds": round(self.seconds, 3),
                "passages_per_s": round(self.passages_per_s, 3), "finished": self.finished}


def ingest_passages(conf: Any) -> Iterator[Passage]:
    """`ingest` (an `IngestConf`) as a stream of passages: its file read as `corpus=jsonl` reads one."""
    from orthrus_rag.data.corpus import iter_corpus

    corpus = SimpleNamespace(kind="jsonl", path=conf.path, id_field=conf.id_field, title_field=conf.title_field,
                             text_field=conf.text_field, limit=conf.limit)
    return iter_corpus(corpus)


def as_live(retriever: Any, folder: Path | None):  # -> LiveIndex
    """The run's dense retriever as a `LiveIndex` over the folder it is saved in (None: in memory)."""
    from orthrus_rag.retrievers import DenseRetriever, LiveIndex

    if not isinstance(retriever, DenseRetriever):
        raise ValueError(f"ingest.path adds documents to a dense index (retriever.kind=dense); this run's is "
                         f"{type(retriever).__name__} (bm25s indexes take no adds)")
    return LiveIndex(retriever, folder)


async def ingest(index: Any, passages: Iterator[Passage], batch_size: int, truncate: bool,
                 report: IngestReport) -> IngestReport:
    """Add `passages` to `index` in batches of `batch_size`, skipping ids it holds; fills `report` as it goes
    (so a caller that stops it early still has the counts)."""
    started = last_log = time.perf_counter()
    while batch := list(islice(passages, batch_size)):
        # NOTE: the first of a repeated id wins, as in a resumed run
        new = list({p.id: p for p in reversed(batch) if index.get(p.id) is None}.values())[::-1]
        report.skipped += len(batch) - len(new)
        if new:
            await index.aadd(new, truncate=truncate)
            report.added += len(new)
        report.seconds = time.perf_counter() - started
        if report.seconds - (last_log - started) >= LOG_EVERY_S:
            last_log = time.perf_counter()
            logger.info("ingest: %d documents added (%.1f/s), %d present already", report.added,
                        report.passages_per_s, report.skipped)
    report.seconds, report.finished = time.perf_counter() - started, True
    logger.info("ingest finished: %d documents added in %.1f s (%.1f/s), %d present already", report.added,
                report.seconds, report.passages_per_s, report.skipped)
    return report
