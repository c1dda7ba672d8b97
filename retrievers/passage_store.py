"""Passages on disk, read by position: Arrow IPC shards, memory-mapped, so a retriever's memory does not grow with
its corpus (the pages of the passages a search returns are all that is read).

A store is a folder of `shard-00000.arrow`, `shard-00001.arrow`, ... (columns id, title, text), in order; passage
`i` of the store is row `i` of their concatenation. Shards are written whole and atomically (a temporary file,
fsynced, then renamed), so a build killed part-way leaves only finished shards, and the index builder
(index_build.py) resumes from them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

from orthrus_rag.atomic import atomic_write
from orthrus_rag.data.types import Passage

SHARD_GLOB = "shard-*.arrow"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.arrow"


def _pyarrow():  # noqa: ANN202 (the module)
    import pyarrow as pa  # NOTE: installed with `datasets`
    import pyarrow.ipc  # noqa: F401 (registers pa.ipc)

    return pa


def write_shard(path: Path, passages: Sequence[Passage]) -> None:
    """Write `passages` as one Arrow IPC file at `path`, atomically (no half-written shard is ever visible)."""
    pa = _pyarrow()
    table = pa.table({"id": [p.id for p in passages], "title": [p.title for p in passages],
                      "text": [p.text for p in passages]},
                     schema=pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.large_string())]))
    with atomic_write(path) as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def read_shard(path: Path) -> list[Passage]:
    """Every passage of one shard file, read whole."""
    pa = _pyarrow()
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"{path} is not a passage shard: {exc}") from exc
    ids, titles, texts = (table.column(k).to_pylist() for k in range(3))
    return [Passage(a, b, c) for a, b, c in zip(ids, titles, texts)]


class PassageStore(Sequence[Passage]):
    """The passages of a store folder, by position (`store[i]`), memory-mapped; `shards` limits it to the first
    that many shards (a build's finished ones)."""

    def __init__(self, folder: str | Path, shards: int | None = None) -> None:
        pa = _pyarrow()
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"no passage store at {self.folder}: not a folder")
        paths = sorted(self.folder.glob(SHARD_GLOB))
        if shards is not None:
            if len(paths) < shards:
                raise ValueError(f"{self.folder} holds {len(paths)} passage shards; expected {shards}")
            paths = paths[:shards]
        self._tables = []
        self._starts: list[int] = []
        total = 0
        for path in paths:
            try:
                table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
            except (OSError, pa.ArrowInvalid) as exc:
                raise ValueError(f"{path} is not a passage shard: {exc}") from exc
            self._starts.append(total)
            self._tables.append(table)
            total += table.num_rows
        self._len = total

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> Passage: ...

    @overload
    def __getitem__(self, i: slice) -> list[Passage]: ...

    def __getitem__(self, i: int | slice) -> Passage | list[Passage]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"passage {i} is out of range (the store holds {self._len})")
        shard = bisect.bisect_right(self._starts, i) - 1
        table, row = self._tables[shard], i - self._starts[shard]
        return Passage(table.column(0)[row].as_py(), table.column(1)[row].as_py(), table.column(2)[row].as_py())

    def ids(self) -> list[str]:
        """Every passage's id, in order (one column read: no titles or texts)."""
        return [i for table in self._tables for i in table.column(0).to_pylist()]

    def __iter__(self) -> Iterator[Passage]:
        for table in self._tables:
            for batch in table.to_batches(max_chunksize=4096):
                ids, titles, texts = (batch.column(k).to_pylist() for k in range(3))
                yield from (Passage(a, b, c) for a, b, c in zip(ids, titles, texts))
