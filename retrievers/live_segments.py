"""A live index's files: the segments of documents added since the index was built, and the manifest naming them.

`LiveIndex` (live_index.py) decides what a search sees; this module owns what is on disk under `<index>/live/`:
one Arrow shard (`<segment>.arrow`) and one vector file (`<segment>.npy`) per segment, and `live.json`, which names
the segments in order, the tombstoned positions and the next file number. Every file is written atomically and
the manifest last, so a process killed at any point leaves the old manifest or the new one, never a torn one;
files it does not name are removed (`remove_unlisted`). Without a folder (an in-memory index) nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orthrus_rag.atomic import atomic_write
from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers.passage_store import read_shard, write_shard

LIVE_DIR, LIVE_MANIFEST = "live", "live.json"
LIVE_FORMAT = 1


@dataclass
class Segment:
    name: str
    n: int


@dataclass
class LiveState:
    """What `live/live.json` holds: the live segments in order, the tombstoned positions, the next file number."""

    base_passages: int
    segments: list[Segment] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    next_number: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"format_version": LIVE_FORMAT, "base_passages": self.base_passages,
                "segments": [{"name": s.name, "n": s.n} for s in self.segments],
                "deleted": sorted(self.deleted), "next_number": self.next_number}

    def copy(self) -> "LiveState":
        return LiveState(self.base_passages, list(self.segments), list(self.deleted), self.next_number)

    @classmethod
    def from_json(cls, path: Path) -> "LiveState":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("format_version") != LIVE_FORMAT:
                raise ValueError(f"format_version {raw.get('format_version')!r}; this version reads {LIVE_FORMAT}")
            return cls(int(raw["base_passages"]), [Segment(str(s["name"]), int(s["n"])) for s in raw["segments"]],
                       [int(p) for p in raw["deleted"]], int(raw["next_number"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path} is corrupt: {exc}") from exc


class SegmentFiles:
    """The `live/` folder of the saved index in `folder`, or nothing at all when `folder` is None."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    @property
    def dir(self) -> Path | None:
        return None if self.folder is None else self.folder / LIVE_DIR

    def new_segment(self, state: LiveState, passages: list[Passage], vectors: np.ndarray) -> Segment:
        """A segment of `passages`, numbered from `state` (its files written, atomically, where there is a folder)."""
        name = f"segment-{state.next_number:06d}"
        state.next_number += 1
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_shard(self.dir / f"{name}.arrow", passages)
            with atomic_write(self.dir / f"{name}.npy") as f:
                np.save(f, vectors)
        return Segment(name, len(passages))

    def write_state(self, state: LiveState) -> None:
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.dir / LIVE_MANIFEST, "w") as f:
            f.write(json.dumps(state.to_json(), indent=1) + "\n")

    def remove_unlisted(self, state: LiveState) -> None:
        """Files of segments the manifest no longer names (merged away, or left by a killed add)."""
        if self.dir is None or not self.dir.is_dir():
            return
        keep = {f"{s.name}{ext}" for s in state.segments for ext in (".arrow", ".npy")} | {LIVE_MANIFEST}
        for path in self.dir.iterdir():
            if path.name not in keep and not path.name.startswith("."):
                path.unlink(missing_ok=True)

    def read_state(self, base_passages: int) -> LiveState | None:
        """The saved manifest, None where there is none; refused when it was written over another base index."""
        if self.dir is None or not (self.dir / LIVE_MANIFEST).is_file():
            return None
        path = self.dir / LIVE_MANIFEST
        state = LiveState.from_json(path)
        if state.base_passages != base_passages:
            raise ValueError(f"{path} was written over an index of {state.base_passages} passages; {self.folder} "
                             f"holds {base_passages} (was it rebuilt? remove {self.dir} to start over)")
        return state

    def read_segments(self, state: LiveState, dimension: int) -> Iterator[tuple[list[Passage], np.ndarray]]:
        """Each segment the manifest names, in order: its passages and fp32 vectors, checked against it."""
        assert self.dir is not None
        for seg in state.segments:
            try:
                passages = read_shard(self.dir / f"{seg.name}.arrow")
                vectors = np.load(self.dir / f"{seg.name}.npy")
            except (OSError, ValueError) as exc:
                raise ValueError(f"{self.dir} is damaged: segment {seg.name} cannot be read ({exc})") from exc
            if len(passages) != seg.n or vectors.shape != (seg.n, dimension):
                raise ValueError(f"{self.dir} is damaged: segment {seg.name} holds {len(passages)} passages and "
                                 f"vectors of shape {vectors.shape}; the manifest says {seg.n} x {dimension}")
            yield passages, np.ascontiguousarray(vectors, dtype=np.float32)
