"""A run's records in FlashRAG's result shape (`orthrus-rag export RUN_DIR --format flashrag`), so its evaluator and
tools read a run made here.

FlashRAG saves a run as `intermediate_data.json`: a JSON array, one item a question, `{"id", "question",
"golden_answers", "metadata", "output": {...}}`, where `output` holds what the pipeline produced: `retrieval_result`
(documents `{"id", "contents", ...}`, `contents` the title, a new line and the text), `prompt`, `raw_pred`, `pred` and
`metric_score`. Here `retrieval_result` lists every passage the question's steps retrieved, in order, each once (a
one-retrieval method's is its top-k); a passage's text comes from the run's index folder (`index/`, or the
`retriever.index_dir` it searched), and is left out where neither holds it. A question that failed keeps an empty
prediction and its `error`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from orthrus_rag.atomic import atomic_write
from orthrus_rag.data.types import Passage
from orthrus_rag.pipelines.records import QARecord

logger = logging.getLogger(__name__)
EXPORT_FORMATS = ("flashrag",)
FLASHRAG_FILE = "intermediate_data.json"


def retrieved(rec: QARecord) -> list[dict[str, Any]]:
    """Every passage the question's steps retrieved, in order, each once."""
    seen: dict[str, dict[str, Any]] = {}
    for step in rec.iterations:
        for hit in step.retrieved:
            seen.setdefault(str(hit["id"]), hit)
    return list(seen.values())


def flashrag_item(rec: QARecord, passages: dict[str, Passage]) -> dict[str, Any]:
    """One record as a FlashRAG dataset item with its `output`."""
    docs = []
    for hit in retrieved(rec):
        p = passages.get(str(hit["id"]))
        title = p.title if p is not None else hit.get("title", "")
        doc = {"id": hit["id"], "title": title, "score": hit.get("score")}
        if p is not None:
            doc["text"], doc["contents"] = p.text, f"{p.title}\n{p.text}"
        docs.append(doc)
    last = rec.iterations[-1] if rec.iterations else None
    output: dict[str, Any] = {"retrieval_result": docs, "prompt": last.prompt if last is not None else "",
                              "raw_pred": rec.raw_generation, "pred": rec.prediction,
                              "metric_score": {"em": rec.em, "f1": rec.f1, "acc": rec.acc, **rec.recall},
                              "iterations": len(rec.iterations), "latency_s": rec.latency_s}
    if rec.error is not None:
        output["error"] = rec.error
    metadata: dict[str, Any] = {"supporting_titles": list(rec.supporting_titles)}
    if rec.type is not None:
        metadata["type"] = rec.type
    return {"id": rec.id, "question": rec.question, "golden_answers": list(rec.golden_answers),
            "metadata": metadata, "output": output}


def index_passages(folders: Iterable[Path], wanted: set[str]) -> dict[str, Passage]:
    """The passages of `wanted` ids found in the index folders' passage stores (each read once, front to back)."""
    from orthrus_rag.retrievers.passage_store import PassageStore

    found: dict[str, Passage] = {}
    for folder in folders:
        store_dir = folder / "passages"
        if not store_dir.is_dir() or len(found) == len(wanted):
            continue
        try:
            for p in PassageStore(store_dir):
                if p.id in wanted and p.id not in found:
                    found[p.id] = p
        except ValueError as exc:  # NOTE: an unreadable store only costs the texts
            logger.warning("passages of %s not read: %s", folder, exc)
    return found


def export_run(run_dir: str | Path, fmt: str = "flashrag", out: str | Path | None = None) -> Path:
    """Write the run's records in format `fmt` (to `out`, default `<run_dir>/intermediate_data.json`); its path."""
    from orthrus_rag.pipelines.run_store import CONFIG, RunStore

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {', '.join(EXPORT_FORMATS)}")
    folder = Path(run_dir)
    if not (folder / "records.jsonl").is_file():
        raise ValueError(f"{folder} holds no records.jsonl: not a run folder")
    store = RunStore(folder)
    records = sorted(store.read_records(repair=False), key=lambda r: (r.index, r.id))
    folders = [folder / "index"]
    config = store.read_text(CONFIG)
    if config:
        import yaml

        index_dir = (yaml.safe_load(config) or {}).get("retriever", {}).get("index_dir")
        if index_dir:
            folders.append(Path(index_dir))
    wanted = {str(hit["id"]) for rec in records for hit in retrieved(rec)}
    passages = index_passages(folders, wanted)
    if wanted and len(passages) < len(wanted):
        logger.warning("%d of %d retrieved passages have no text in %s: exported with their ids and titles",
                       len(wanted) - len(passages), len(wanted), ", ".join(map(str, folders)))
    path = Path(out) if out is not None else folder / FLASHRAG_FILE
    with atomic_write(path, "w") as f:
        json.dump([flashrag_item(r, passages) for r in records], f, indent=1, ensure_ascii=False)
    return path
