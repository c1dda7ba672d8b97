"""Files that appear whole or not at all: what a killed process leaves behind is the old file or the new one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file opened on a temporary sibling of `path` (`.<name>.tmp`), fsynced and renamed over `path` when the
    block ends (the folder fsynced too, so the rename itself survives a power cut); removed, leaving `path` as it
    was, when the block raises."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open(mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # NOTE: a platform whose folders cannot be opened (Windows): the rename is all there is
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
