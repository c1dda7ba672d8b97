"""Two runs over the same questions, paired: how each metric moved, and whether the questions can tell.

`orthrus-rag compare BASE OTHER` reads both runs' records and keeps the questions both answered (by id; a failed
question is left out of both, so a failure never counts as a wrong answer). Per metric (EM, F1, acc, recall@k of
the last retrieval): the two means, their difference, and a paired bootstrap interval of it (the questions
resampled with replacement, the same draw for both runs; 10,000 draws, seeded, so a table is reproducible); for
the 0/1 metrics the questions gained and lost; and how many predictions are identical. With 200 questions one
question is 0.005 of EM: a difference whose interval spans 0 is not one the questions resolve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orthrus_rag.pipelines.records import QARecord
from orthrus_rag.pipelines.run_store import RECORDS, RunStore

METRICS = ("em", "f1", "acc")
BINARY = ("em", "acc")  # 0/1 per question: gained / lost counts mean something


@dataclass
class MetricDiff:
    name: str
    n: int  # questions with this metric in both runs
    base: float
    other: float
    low: float  # the bootstrap interval of other - base
    high: float
    gained: int | None = None  # 0/1 metrics: right in OTHER only
    lost: int | None = None  # right in BASE only

    @property
    def diff(self) -> float:
        return self.other - self.base


@dataclass
class Comparison:
    base: Path
    other: Path
    common: int  # questions answered in both
    only_base: int  # answered in BASE only (failed or missing in OTHER)
    only_other: int
    identical: int  # of the common ones, the same prediction
    level: float
    resamples: int
    metrics: list[MetricDiff]


def answered(folder: str | Path) -> dict[str, QARecord]:
    """A run's answered questions by id (records without an error), read without touching the folder."""
    folder = Path(folder)
    if not (folder / RECORDS).is_file():
        raise ValueError(f"{folder} is not a run folder: no {RECORDS}")
    return {r.id: r for r in RunStore(folder).read_records(repair=False) if r.error is None}


def _value(rec: QARecord, metric: str) -> float | None:
    value = getattr(rec, metric) if metric in METRICS else rec.recall.get(metric)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def compare_runs(base: str | Path, other: str | Path, resamples: int = 10_000, seed: int = 0,
                 level: float = 0.95) -> Comparison:
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return compare_records(answered(base), answered(other), Path(base), Path(other), resamples, seed, level)


def compare_records(a: dict[str, QARecord], b: dict[str, QARecord], base: Path, other: Path,
                    resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> Comparison:
    """Two runs' answered records by id, paired per question (`base` / `other` name them in messages)."""
    ids = sorted(a.keys() & b.keys(), key=lambda i: (a[i].index, i))
    if not ids:
        raise ValueError(f"{base} and {other} share no answered question (are they runs of the same dataset?)")
    differ = [i for i in ids if a[i].question != b[i].question]
    if differ:  # NOTE: ids like "dev_4" repeat across datasets: a pairing by id alone could pair other questions
        raise ValueError(f"{base} and {other} ask different questions under the same id ({len(differ)} of "
                         f"{len(ids)}, e.g. {differ[0]!r}): not runs of the same dataset")
    # NOTE: recall@k by k, then recall@used (the passages a gathering method read)
    recalls = sorted({k for i in ids for k in (*a[i].recall, *b[i].recall) if k.startswith("recall@")},
                     key=lambda k: (not k.split("@")[1].isdigit(), int(k.split("@")[1]) if k.split("@")[1].isdigit()
                                    else 0, k))
    rng = np.random.default_rng(seed)
    metrics = []
    for name in (*METRICS, *recalls):
        pairs = [(x, y) for i in ids if (x := _value(a[i], name)) is not None and (y := _value(b[i], name)) is not None]
        if not pairs:
            continue
        xs, ys = np.array(pairs).T
        # NOTE: one draw of question indices per resample, shared by both runs: the pairing is the point
        draws = rng.integers(0, len(xs), size=(resamples, len(xs)))
        diffs = (ys[draws] - xs[draws]).mean(axis=1)
        low, high = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
        row = MetricDiff(name, len(xs), float(xs.mean()), float(ys.mean()), float(low), float(high))
        if name in BINARY:
            row.gained, row.lost = int(((ys > 0) & (xs == 0)).sum()), int(((xs > 0) & (ys == 0)).sum())
        metrics.append(row)
    identical = sum(a[i].prediction == b[i].prediction for i in ids)
    return Comparison(base, other, len(ids), len(a.keys() - b.keys()), len(b.keys() - a.keys()),
                      identical, level, resamples, metrics)


def comparison_table(c: Comparison) -> str:
    pct = f"{100 * c.level:g}%"
    lines = [f"base:  {c.base}", f"other: {c.other}",
             f"{c.common} questions answered in both ({c.only_base} in base only, {c.only_other} in other only); "
             f"{c.identical} identical predictions", "",
             f"{'metric':<10} {'n':>4} {'base':>7} {'other':>7} {'diff':>7}   {pct + ' interval':<18} gained/lost"]
    for m in c.metrics:
        interval = f"[{m.low:+.3f}, {m.high:+.3f}]"
        counts = f"{m.gained}/{m.lost}" if m.gained is not None else ""
        lines.append(f"{m.name:<10} {m.n:>4} {m.base:>7.3f} {m.other:>7.3f} {m.diff:>+7.3f}   {interval:<18} {counts}")
    lines += ["", f"(paired bootstrap over the questions, {c.resamples} resamples; an interval that spans 0 is a "
                  "difference these questions do not resolve)"]
    return "\n".join(lines)
