"""Summaries of a pipeline run: answer quality (on the parsed answer, and on the raw generation for comparison),
retrieval recall, latency per question and per stage, throughput, failures; rendered as a table.

`RunScores` folds records in one at a time, so a run of any length keeps only a few numbers per question (the
latencies, for exact percentiles) and the summary can be recomputed from records.jsonl at any point.

The metrics: answer and retrieval metrics as the field reports them (SQuAD / HotpotQA / FlashRAG): EM, F1 and `acc` with
the standard answer normalisation (lower case, no punctuation, no articles, single spaces), best over all golden
answers; recall@k of the supporting paragraphs; latency percentiles.

`acc` is FlashRAG's `Sub_ExactMatch`: 1 when a normalised golden answer is a substring of the normalised prediction
(a plain substring, as FlashRAG does: "no" is contained in "not"; answers.parse_answer reduces yes/no answers to a
bare "yes" / "no" first).
"""

from __future__ import annotations

import math
import re
import string
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from orthrus_rag.pipelines.records import QARecord

# ---- the metrics of one answer, one retrieval, many latencies -----------------------------------------------
def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def accuracy(prediction: str, golden_answers: Sequence[str]) -> float:
    """FlashRAG's `acc`: some normalised golden answer is contained in the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in golden_answers))


def answer_scores(prediction: str, golden_answers: Sequence[str]) -> dict[str, float]:
    """EM, F1 and acc of one prediction (the keys the records and summaries use)."""
    return {"em": exact_match(prediction, golden_answers), "f1": f1_score(prediction, golden_answers),
            "acc": accuracy(prediction, golden_answers)}


def _f1(prediction: str, golden: str) -> float:
    pred, gold = normalize_answer(prediction), normalize_answer(golden)
    # NOTE: yes/no/noanswer must match exactly (HotpotQA's official rule)
    if pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer"):
        return float(pred == gold)
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    return max((_f1(prediction, g) for g in golden_answers), default=0.0)


def recall_at_k(retrieved_titles: Sequence[str], supporting_titles: Sequence[str], k: int) -> float | None:
    """Share of the supporting paragraphs among the top-k retrieved; None when there is nothing to find."""
    gold = set(supporting_titles)
    if not gold:
        return None
    return len(gold & set(retrieved_titles[:k])) / len(gold)


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 95, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


# ---- a run's scores -----------------------------------------------------------------------------------------
METRICS = ("em", "f1", "acc")
MAX_LISTED_FAILURES = 100  # the summary names this many failed questions; records.jsonl has them all


class _Means:
    """Running sums of named values."""

    def __init__(self) -> None:
        self.sums: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()

    def add(self, key: str, value: float | None) -> None:
        if value is not None:
            self.sums[key] += value
            self.counts[key] += 1

    def mean(self, key: str) -> float:
        return self.sums[key] / self.counts[key] if self.counts[key] else float("nan")


class RunScores:
    """The summary of the records added so far."""

    def __init__(self) -> None:
        self.num_questions = 0
        self.failures: Counter[str] = Counter()
        self.failed: list[dict[str, Any]] = []
        self.means = _Means()
        self.by_type: dict[str, _Means] = {}
        self.latency, self.retrieve, self.generate = array("d"), array("d"), array("d")
        self.session_end: dict[int, float] = {}  # session -> its last record's finished_s

    def add(self, rec: QARecord) -> None:
        self.num_questions += 1
        self.session_end[rec.session] = max(self.session_end.get(rec.session, 0.0), rec.finished_s)
        if rec.error is not None:
            self.failures[rec.error.split(":", 1)[0]] += 1
            if len(self.failed) < MAX_LISTED_FAILURES:
                self.failed.append({"index": rec.index, "id": rec.id, "error": rec.error})
            return
        raw = answer_scores(rec.raw_generation, rec.golden_answers)
        typed = self.by_type.setdefault(rec.type or "-", _Means())
        for m in METRICS:
            self.means.add(m, getattr(rec, m))
            self.means.add(f"raw_{m}", raw[m])
            typed.add(m, getattr(rec, m))
        typed.add("n", 1.0)
        self.means.add("answer_found", float(bool(rec.iterations) and rec.iterations[-1].answer_found))
        # NOTE: how often a method alternates the two kinds: its recorded steps, and those that retrieved
        self.means.add("steps", float(len(rec.iterations)))
        self.means.add("retrievals", float(sum(1 for it in rec.iterations if it.retrieved)))
        self.means.add("generated_tokens", float(rec.generated_tokens))
        self.means.add("prefilled_tokens", float(rec.prefilled_tokens))
        for key, value in rec.recall.items():
            self.means.add(key, value)
        self.latency.append(rec.latency_s)
        self.retrieve.extend(it.retrieve_s for it in rec.iterations)
        self.generate.extend(it.generate_s for it in rec.iterations)

    @property
    def num_failed(self) -> int:
        return sum(self.failures.values())

    @property
    def wall_time_s(self) -> float:
        """Time the pipeline ran, summed over the sessions of a resumed run (each up to its last record)."""
        return sum(self.session_end.values())

    def summary(self) -> dict[str, Any]:
        ok = self.num_questions - self.num_failed
        wall = self.wall_time_s
        summary: dict[str, Any] = {"num_questions": self.num_questions, "num_failed": self.num_failed}
        summary.update({m: self.means.mean(m) for m in METRICS})
        summary["raw_generation"] = {m: self.means.mean(f"raw_{m}") for m in METRICS}
        summary["answer_found_rate"] = self.means.mean("answer_found")
        summary["steps_per_question"] = self.means.mean("steps")
        summary["retrievals_per_question"] = self.means.mean("retrievals")
        summary["generated_tokens_per_question"] = self.means.mean("generated_tokens")
        summary["prefilled_tokens_per_question"] = self.means.mean("prefilled_tokens")
        summary.update({
            "wall_time_s": wall,
            "throughput_qps": ok / wall if wall > 0 else float("nan"),
            "latency_s": percentiles(self.latency),
            "retrieve_s": percentiles(self.retrieve),
            "generate_s": percentiles(self.generate),
        })
        for key in sorted(k for k in self.means.counts if k.startswith("recall@")):
            summary[key] = self.means.mean(key)
        summary["by_type"] = {t: {"n": int(m.sums["n"]), **{k: m.mean(k) for k in METRICS}}
                              for t, m in sorted(self.by_type.items())}
        summary["failures"] = dict(self.failures.most_common())
        summary["failed"] = list(self.failed)
        return summary


def summarize(records: Iterable[QARecord]) -> dict[str, Any]:
    scores = RunScores()
    for rec in records:
        scores.add(rec)
    return scores.summary()


def _num(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def format_table(summary: dict[str, Any]) -> str:
    raw = summary.get("raw_generation", {})
    rows = [("questions", str(summary["num_questions"])), ("failed", str(summary["num_failed"]))]
    rows += [(m.upper() if m != "acc" else "acc", f"{_num(summary[m])}   (raw generation {_num(raw.get(m))})")
             for m in METRICS]
    rows.append(("answer phrase found", _num(summary.get("answer_found_rate"))))
    rows += [(label, _num(summary.get(key))) for label, key in (("steps / question", "steps_per_question"),
                                                                ("retrievals / question", "retrievals_per_question"),
                                                                ("generated tokens / question",
                                                                 "generated_tokens_per_question"),
                                                                ("prefilled tokens / question",
                                                                 "prefilled_tokens_per_question"))]
    rows += [(k, _num(v)) for k, v in summary.items() if k.startswith("recall@")]
    rows += [("throughput (q/s)", _num(summary["throughput_qps"])), ("wall time (s)", _num(summary["wall_time_s"]))]
    for stage in ("latency_s", "retrieve_s", "generate_s"):
        p = summary[stage]
        rows.append((f"{stage} p50/p95/p99", " / ".join(_num(p[q]) for q in ("p50", "p95", "p99"))))
    for reason, count in summary.get("failures", {}).items():
        rows.append((f"failed: {reason}", str(count)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
