"""Answer and retrieval metrics as the field reports them (SQuAD / HotpotQA / FlashRAG): EM, F1 and `acc` with the
standard answer normalisation (lower case, no punctuation, no articles, single spaces), best over all golden
answers; recall@k of the supporting paragraphs; latency percentiles.

`acc` is FlashRAG's `Sub_ExactMatch`: 1 when a normalised golden answer is a substring of the normalised prediction
(a plain substring, as FlashRAG does: "no" is contained in "not"; answers.parse_answer reduces yes/no answers to a
bare "yes" / "no" first)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np


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
