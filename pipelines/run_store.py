"""A run folder on disk, written so that a crash, a kill or a full disk loses nothing already answered:

- `records.jsonl`: one line per question, written (one unbuffered write) as each finishes, fsynced at every
  checkpoint; a write that fails part-way is cut off again, so the file only ever holds whole records;
- `steps.jsonl`: one line per engine step, streamed while the run goes;
- `retried.jsonl`: the failed records a resume set aside to ask their questions again (history only: records.jsonl
  keeps one record per question);
- `summary.json` and `config.yaml`: replaced atomically (a temporary file, fsynced, then renamed), so a reader
  never sees half of one.

Reading back (for `resume=`) drops a record line that a kill cut short and truncates the file to the last whole
record, so the next appends start on a clean line. Any I/O failure becomes a `RunStoreError` naming the file, the
cause and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from orthrus_rag.atomic import atomic_write
from orthrus_rag.pipelines.records import QARecord

logger = logging.getLogger(__name__)
RECORDS, STEPS, SUMMARY, CONFIG = "records.jsonl", "steps.jsonl", "summary.json", "config.yaml"
RETRIED = "retried.jsonl"
PLAN = "plan.json"  # what ran each part of the engine's steps (engine/executor/plan.py); rewritten per session


class RunStoreError(RuntimeError):
    """The run folder could not be written or read. `num_records`: records safely in the folder."""

    def __init__(self, message: str, num_records: int = 0) -> None:
        super().__init__(message)
        self.num_records = num_records


def _open_append(path: Path) -> IO[Any]:
    """Records: unbuffered bytes, one write per record (in the OS at once; a failed one is cut off again).
    Steps: buffered text (many small rows from the engine's thread, flushed at checkpoints)."""
    return path.open("ab", buffering=0) if path.name == RECORDS else path.open("a", encoding="utf-8")


def _write_all(f: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _hint(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full: free some space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "the folder is not writable: fix its permissions or choose another run_dir"
    if exc.errno == errno.EFBIG:
        return "the file outgrew the size limit (ulimit -f): raise it"
    return "fix the cause above"


class RunStore:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.num_records = 0  # whole records in records.jsonl (read back + appended)
        self._records: IO[bytes] | None = None
        self._records_size = 0  # bytes of whole records
        self._steps: IO[str] | None = None
        self._steps_lock = threading.Lock()
        self._steps_error: OSError | None = None

    # ---- opening ------------------------------------------------------------------------------------------
    def has_records(self) -> bool:
        path = self.folder / RECORDS
        return path.is_file() and path.stat().st_size > 0

    def open(self) -> None:
        """Create the folder if needed and open the record and step files for appending."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._records = _open_append(self.folder / RECORDS)
            self._records_size = os.fstat(self._records.fileno()).st_size
            self._steps = _open_append(self.folder / STEPS)
        except OSError as exc:
            self.close()
            raise self._error(exc, self.folder) from exc

    def close(self) -> None:
        for f in (self._records, self._steps):
            if f is not None:
                try:
                    f.close()
                except OSError as exc:  # NOTE: a full disk can fail the final flush; the earlier lines stay
                    logger.warning("closing %s: %s", f.name, exc)
        self._records = self._steps = None

    # ---- reading back -------------------------------------------------------------------------------------
    def read_records(self, repair: bool = True) -> Iterator[QARecord]:
        """Every whole record in records.jsonl; a last line cut short by a kill is dropped from the file (`repair`;
        else only skipped: a reader that must not write, e.g. `orthrus-rag compare`)."""
        for row in self._read_rows(RECORDS, repair=repair):
            self.num_records += 1
            yield QARecord.from_json(row)

    def set_aside(self, again: list[QARecord], kept: list[QARecord]) -> None:
        """On resume, as the pipeline starts: move the records of the questions asked again to retried.jsonl,
        leaving records.jsonl with `kept`. The set-aside lines are fsynced first and records.jsonl is then replaced
        atomically (and reopened for appending), so a kill in between only repeats lines of retried.jsonl, never
        loses a record."""
        def lines(recs: list[QARecord]) -> str:
            return "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in recs)

        path = self.folder / RETRIED
        try:
            with path.open("a", encoding="utf-8") as f:
                f.write(lines(again))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise self._error(exc, path) from exc
        was_open = self._records is not None
        if was_open:  # NOTE: the replaced file is a new inode: an open handle would append to the old one
            self._records.close()
            self._records = None
        self.write_atomic(RECORDS, lines(kept))
        self.num_records = len(kept)
        if was_open:
            try:
                self._records = _open_append(self.folder / RECORDS)
                self._records_size = os.fstat(self._records.fileno()).st_size
            except OSError as exc:
                raise self._error(exc, self.folder / RECORDS) from exc

    def read_retried(self) -> Iterator[QARecord]:
        """The records earlier resumes set aside (retried.jsonl)."""
        for row in self._read_rows(RETRIED, repair=False):
            yield QARecord.from_json(row)

    def read_steps(self) -> Iterator[dict[str, Any]]:
        yield from self._read_rows(STEPS, repair=True)

    def _read_rows(self, name: str, repair: bool) -> Iterator[dict[str, Any]]:
        path = self.folder / name
        if not path.is_file():
            return
        good = 0  # bytes up to the end of the last whole row
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    row = json.loads(line) if line.endswith(b"\n") else None
                except ValueError:
                    row = None
                if row is None:
                    if f.read(1):  # NOTE: only the last line can be torn; anything else is damage
                        raise ValueError(f"{path}: line {lineno} is not a JSON record; the file was edited or "
                                         "damaged (repair or remove that line, then resume)")
                    break
                good += len(line)
                yield row
        if repair and good < path.stat().st_size:
            logger.warning("%s: dropping a partly written last line (the previous run stopped while writing it)",
                           path)
            with path.open("r+b") as f:
                f.truncate(good)

    def read_text(self, name: str) -> str | None:
        path = self.folder / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    # ---- writing ------------------------------------------------------------------------------------------
    def append_record(self, rec: QARecord) -> None:
        assert self._records is not None, "open() first"
        self.raise_step_error()
        data = (json.dumps(rec.to_json(), ensure_ascii=False) + "\n").encode()
        try:
            _write_all(self._records, data)  # NOTE: in the OS now: a killed process loses nothing written
        except OSError as exc:
            with contextlib.suppress(OSError):  # NOTE: a full disk may have taken part of the line: cut it off
                os.ftruncate(self._records.fileno(), self._records_size)
            raise self._error(exc, self.folder / RECORDS) from exc
        self._records_size += len(data)
        self.num_records += 1

    def append_step(self, row: dict[str, Any]) -> None:
        """From the engine's thread: must not raise; a failure is kept and raised on the run's side."""
        with self._steps_lock:
            if self._steps is None or self._steps_error is not None:
                return
            try:
                self._steps.write(json.dumps(row) + "\n")
            except OSError as exc:
                self._steps_error = exc

    def raise_step_error(self) -> None:
        if self._steps_error is not None:
            raise self._error(self._steps_error, self.folder / STEPS) from self._steps_error

    def checkpoint(self, summary: dict[str, Any]) -> None:
        """Make every record durable (fsync), flush the steps and replace summary.json."""
        try:
            if self._records is not None:
                os.fsync(self._records.fileno())
            with self._steps_lock:
                if self._steps is not None and self._steps_error is None:
                    self._steps.flush()
        except OSError as exc:
            raise self._error(exc, self.folder / RECORDS) from exc
        self.raise_step_error()
        self.write_atomic(SUMMARY, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")

    def write_atomic(self, name: str, text: str) -> None:
        path = self.folder / name
        try:
            with atomic_write(path, "w") as f:
                f.write(text)
        except OSError as exc:
            raise self._error(exc, path) from exc

    def _error(self, exc: OSError, path: Path) -> RunStoreError:
        cause = exc.strerror or str(exc)
        if self.num_records == 0:
            return RunStoreError(f"cannot write {path}: {cause}; {_hint(exc)}", 0)
        return RunStoreError(
            f"cannot write {path}: {cause}; {_hint(exc)}. The {self.num_records} records written before are kept "
            f"in {self.folder / RECORDS}; continue the run with `orthrus-rag run resume={self.folder}`",
            self.num_records)
