"""One session of `orthrus-rag run` in its run folder: a fresh run, or a resumed one (`resume=<run_dir>`).

It reads back what earlier sessions recorded, writes each new record as its question finishes, streams the engine's
steps to steps.jsonl, rewrites summary.json every `checkpoint_every` questions and at the end, and shows progress
(questions/s, ETA, running scores). The summary is always recomputed from the records (and the engine totals from
steps.jsonl), so a resumed run ends with the summary an uninterrupted one would have, timings aside.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from orthrus_rag.config.saved import config_diff
from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.stats import StepAggregator
from orthrus_rag.outputs import StepStats
from orthrus_rag.pipelines.evaluate import RunScores
from orthrus_rag.pipelines.records import QARecord, ask_again
from orthrus_rag.pipelines.run_store import CONFIG, RETRIED, SUMMARY, RunStore

logger = logging.getLogger(__name__)


class RunSession:
    def __init__(self, folder: str | Path, cfg: Any) -> None:
        """Open the run folder: refuse to write over another run; on resume, check the config and read back."""
        from omegaconf import OmegaConf

        self.store = RunStore(folder)
        self.folder = self.store.folder
        self.cfg = cfg
        self.scores = RunScores()
        self.steps = StepAggregator()
        self.done: dict[int, str] = {}  # dataset position -> question id, of every recorded question
        self.session = 0
        self.previous_sessions: list[dict[str, Any]] = []
        self.num_total = 0
        self.num_new = 0
        self.started = time.perf_counter()
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.labels: dict[str, Any] = {}  # what the run is (policy, retriever, dataset...): set by the app
        self.ingest: dict[str, Any] | None = None  # documents added while it ran (ingest.path): set by the app
        self._set_aside: tuple[list[QARecord], list[QARecord]] | None = None  # (asked again, kept), on resume
        self._bar: Any = None
        if cfg.resume is None:
            if self.store.has_records():
                raise ValueError(f"{self.folder} already holds a run (records.jsonl is not empty); continue it with "
                                 f"resume={self.folder}, or choose another run_dir")
            self.store.open()
            self.store.write_atomic(CONFIG, OmegaConf.to_yaml(cfg, resolve=True))
        else:
            self._read_back(OmegaConf.create(self._saved_config()))
            self.store.open()

    def _saved_config(self) -> str:
        saved = self.store.read_text(CONFIG)
        if saved is None:
            raise ValueError(f"resume: {self.folder} has no {CONFIG}; it is not a run folder of `orthrus-rag run`")
        return saved

    def _read_back(self, saved: Any) -> None:
        import json

        diff = config_diff(saved, self.cfg)
        if diff:
            raise ValueError(f"resume: the config differs from the one {self.folder} was started with:\n  "
                             + "\n  ".join(diff) + f"\n(`orthrus-rag run resume={self.folder}` alone continues "
                             "with the saved config)")
        records = list(self.store.read_records())
        again = [r for r in records if ask_again(r, self.cfg.retry_failed)]
        if again:  # NOTE: moved to retried.jsonl when the pipeline starts (begin), not before it could run
            records = [r for r in records if not ask_again(r, self.cfg.retry_failed)]
            self._set_aside = (again, records)
            logger.info("resume: asking %d failed questions again (retry_failed=%s; their records go to %s)",
                        len(again), self.cfg.retry_failed, self.store.folder / RETRIED)
        for rec in records:
            self.scores.add(rec)
            self.done[rec.index] = rec.id
        step_sessions = set()
        for row in self.store.read_steps():
            self.steps.add_row(row)
            step_sessions.add(row.get("session", -1))
        summary = self.store.read_text(SUMMARY)
        if summary is not None:  # NOTE: its last session may lag its records by up to checkpoint_every questions
            previous = json.loads(summary)
            self.previous_sessions = previous.get("sessions", [])
            self.labels = previous.get("config", {})  # until the app sets this session's
        # NOTE: after every session that left a trace: a record, a set-aside record, a step row or the summary (a
        # session may have ended before it recorded anything, or had all its records set aside since)
        seen = [r.session for r in records + again] + [r.session for r in self.store.read_retried()]
        seen += [s.get("session", -1) for s in self.previous_sessions] + list(step_sessions)
        self.session = max(seen, default=-1) + 1
        logger.info("resuming %s: %d questions recorded, session %d", self.folder, len(self.done), self.session)

    # ---- the questions left -----------------------------------------------------------------------------
    def remaining(self, examples: Sequence[QAExample]) -> list[tuple[int, QAExample]]:
        """(index, example) of the questions not yet recorded; checks the recorded ones against the dataset."""
        self.num_total = len(examples)
        for index, qid in self.done.items():
            if index >= len(examples) or index < 0 or examples[index].id != qid:
                there = examples[index].id if 0 <= index < len(examples) else "nothing"
                raise ValueError(f"resume: {self.folder} recorded question {qid!r} at position {index}, but the "
                                 f"dataset has {there} there (another dataset file or order?)")
        return [(i, ex) for i, ex in enumerate(examples) if i not in self.done]

    # ---- while the run goes -----------------------------------------------------------------------------
    def begin(self) -> None:
        """The pipeline starts now (records' `finished_s`, and so the run's wall time, count from here). The
        records of the questions asked again leave records.jsonl now, not before the run could start."""
        if self._set_aside is not None:
            self.store.set_aside(*self._set_aside)
            self._set_aside = None
        self.started = time.perf_counter()

    def observe(self, stats: StepStats) -> None:
        """Engine step observer (the engine's thread): totals, and a steps.jsonl row."""
        self.steps.add(stats)
        self.store.append_step({**vars(stats), "session": self.session})

    def record(self, rec: QARecord) -> None:
        """Write one finished question's record as it comes (the caller drives the pipeline), checkpoint every
        `checkpoint_every`, show progress (inside `progress()`)."""
        rec.session, rec.finished_s = self.session, time.perf_counter() - self.started
        self.store.append_record(rec)
        self.scores.add(rec)
        self.num_new += 1
        if self._bar is not None:
            self._show(rec)
        if self.num_new % self.cfg.checkpoint_every == 0:
            self.checkpoint()

    @contextlib.contextmanager
    def progress(self) -> Iterator[None]:
        """A progress bar over the run's questions while the records come."""
        tty = sys.stderr.isatty()
        self._bar = tqdm(total=self.num_total, initial=len(self.done), desc="questions", unit="q",
                         disable=not self.cfg.progress, smoothing=0.05, mininterval=0.5 if tty else 30.0,
                         dynamic_ncols=True)
        try:
            yield
        finally:
            self._bar.close()
            self._bar = None

    def _show(self, rec: QARecord) -> None:
        s = self.scores.means
        self._bar.set_postfix_str(f"EM {s.mean('em'):.3f} F1 {s.mean('f1'):.3f} acc {s.mean('acc'):.3f} "
                                  f"failed {self.scores.num_failed}", refresh=False)
        self._bar.update(1)

    def progress_line(self) -> str:
        elapsed = time.perf_counter() - self.started
        rate = self.num_new / elapsed if elapsed > 0 else 0.0
        left = self.num_total - self.scores.num_questions
        eta = f"{left / rate / 60:.1f} min" if rate > 0 else "?"
        s = self.scores.means
        return (f"{self.scores.num_questions}/{self.num_total} questions, {rate:.3f} q/s, ETA {eta}; EM "
                f"{s.mean('em'):.3f} F1 {s.mean('f1'):.3f} acc {s.mean('acc'):.3f}; {self.scores.num_failed} failed")

    def checkpoint(self) -> None:
        self.store.checkpoint(self.summary())
        logger.info("%s", self.progress_line())

    # ---- the summary ------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        summary = self.scores.summary()
        summary["num_total"] = self.num_total
        summary["complete"] = self.scores.num_questions == self.num_total
        sessions = self._sessions()
        if self.steps.totals["num_steps"]:  # NOTE: prefix-cache hits too: each step counts its own
            summary["engine"] = self.steps.summary()
        summary["sessions"] = sessions
        summary["config"] = self.labels
        if self.ingest is not None:
            summary["ingest"] = self.ingest
        return summary

    def _sessions(self) -> list[dict[str, Any]]:
        this = {"session": self.session, "started": self.started_at, "questions": self.num_new,
                "time_s": time.perf_counter() - self.started}
        return [s for s in self.previous_sessions if s.get("session") != self.session] + [this]

    def close(self) -> None:
        self.store.close()
