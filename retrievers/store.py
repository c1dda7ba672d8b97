"""On-disk layout of a dense index: `index.faiss`, `passages/` (Arrow shards: passage_store.py) and
`manifest.json` (format 2; format 1 folders, with `passages.jsonl`, are still read)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orthrus_rag.atomic import atomic_write
from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers.passage_store import PassageStore

FORMAT_VERSION = 2
READS = (1, 2)
INDEX_FILE, PASSAGES_DIR, MANIFEST_FILE = "index.faiss", "passages", "manifest.json"
OLD_PASSAGES_FILE = "passages.jsonl"  # format 1


def canonical(value: Any) -> Any:
    """`value` as JSON gives it back (tuples become lists), so identities compare the same before and after."""
    return json.loads(json.dumps(value, sort_keys=True))


def identity_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per field that differs: 'name: index has X, embedder has Y'."""
    saved, current = canonical(saved), canonical(current)
    lines = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<missing>"), current.get(key, "<missing>")
        if a != b:
            lines.append(f"{key}: index has {a!r}, embedder has {b!r}")
    return lines


def manifest(identity: dict[str, Any], index: dict[str, Any], dimension: int | None, num_passages: int,
             **extra: Any) -> dict[str, Any]:
    """A saved index's manifest: what embedded it (refused at load when the query embedder differs), the index
    spec, and how many passages of what width it holds; `extra`: e.g. the corpus and how it was built."""
    return {"format_version": FORMAT_VERSION, "embedder": canonical(identity), "index": index,
            "dimension": dimension, "num_passages": num_passages, **canonical(extra)}


def open_passages(folder: Path, manifest: dict[str, Any]) -> Sequence[Passage]:
    """A saved index's passages: memory-mapped Arrow shards (format 2), or the JSONL of format 1, read whole."""
    if manifest["format_version"] == 1:
        return read_passages(folder / OLD_PASSAGES_FILE)
    return PassageStore(folder / PASSAGES_DIR, shards=manifest.get("num_shards"))


def read_passages(path: Path) -> list[Passage]:
    passages = []
    with path.open(encoding="utf-8") as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                passages.append(Passage(str(row["id"]), row["title"], row["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{num}: not a passage record ({exc})") from exc
    return passages


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a folder killed while saving keeps its old manifest (or none), never a torn one."""
    with atomic_write(path, "w") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is corrupt: expected a JSON object")
    version = manifest.get("format_version")
    if version not in READS:
        raise ValueError(f"{path} has format_version {version!r}; this version reads {', '.join(map(str, READS))}")
    missing = [k for k in ("embedder", "index", "dimension", "num_passages") if k not in manifest]
    if missing:
        raise ValueError(f"{path} is corrupt: missing {', '.join(missing)}")
    return manifest


def check_folder(folder: Path, dense: bool = True) -> None:
    """Refuse a folder that is not a saved index (`dense`: with a FAISS index), naming what is missing."""
    if not folder.is_dir():
        raise ValueError(f"no saved index at {folder}: not a folder")
    missing = [name for name in ((INDEX_FILE, MANIFEST_FILE) if dense else (MANIFEST_FILE,))
               if not (folder / name).is_file()]
    if not (folder / PASSAGES_DIR).is_dir() and not (folder / OLD_PASSAGES_FILE).is_file():
        missing.append(f"{PASSAGES_DIR}/")
    if missing:
        raise ValueError(f"{folder} is not a saved dense index: missing {', '.join(missing)}")
