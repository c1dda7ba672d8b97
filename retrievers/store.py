"""On-disk layout of a dense index: `index.faiss`, `passages.jsonl` and `manifest.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orthrus_rag.data.types import Passage

FORMAT_VERSION = 1
INDEX_FILE, PASSAGES_FILE, MANIFEST_FILE = "index.faiss", "passages.jsonl", "manifest.json"


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


def write_passages(path: Path, passages: list[Passage]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n")


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
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is corrupt: expected a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {version!r}; this version reads {FORMAT_VERSION}")
    missing = [k for k in ("embedder", "index", "dimension", "num_passages") if k not in manifest]
    if missing:
        raise ValueError(f"{path} is corrupt: missing {', '.join(missing)}")
    return manifest


def check_folder(folder: Path) -> None:
    """Refuse a folder that is not a saved index, naming what is missing."""
    if not folder.is_dir():
        raise ValueError(f"no saved index at {folder}: not a folder")
    missing = [name for name in (INDEX_FILE, PASSAGES_FILE, MANIFEST_FILE) if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder} is not a saved dense index: missing {', '.join(missing)}")
