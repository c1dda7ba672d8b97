"""Answer normalisation, EM/F1 over golden answers, recall@k, answer extraction."""

from __future__ import annotations

import pytest

from orthrus_rag.pipelines.evaluate import exact_match, f1_score, normalize_answer, percentiles, recall_at_k
from orthrus_rag.pipelines.answers import extract_answer
from orthrus_rag.pipelines.prompts import build_prompt
from orthrus_rag.data.types import Passage


def test_normalisation_drops_case_punctuation_articles():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a pear") == "apple pear"


def test_em_and_f1_take_the_best_golden_answer():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert f1_score("Beatles band", ["Beatles"]) == pytest.approx(2 / 3)
    assert f1_score("Paris", ["London", "paris"]) == 1.0
    assert f1_score("no", ["yes"]) == 0.0 and f1_score("yes", ["yes"]) == 1.0
    assert f1_score("", ["x"]) == 0.0


def test_recall_at_k():
    assert recall_at_k(["a", "b", "c"], ["a", "c"], 2) == 0.5
    assert recall_at_k(["a", "b", "c"], ["a", "c"], 3) == 1.0
    assert recall_at_k(["a"], [], 5) is None


def test_percentiles():
    p = percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)


@pytest.mark.parametrize("generation,answer", [
    ("X was directed by Y. The mother of Y is Z. So the answer is Anna Berg.", "Anna Berg"),
    ("So the answer is: J. R. R. Tolkien.", "J. R. R. Tolkien"),
    ("So the answer is 3.5 million. Extra text", "3.5 million"),
    ("Paris\nmore", "Paris"),
    ("so the answer is \"Night Over Salden\"", "Night Over Salden"),
])
def test_extract_answer(generation, answer):
    assert extract_answer(generation) == answer


def test_prompt_has_demos_passages_and_question():
    p = build_prompt("Who is X?", [Passage("p1", "Title One", "Some text.")])
    assert p.count("So the answer is") == 4  # the instruction and three demonstrations
    assert "Title One: Some text." in p and p.endswith("Question: Who is X?\nAnswer:")
    assert "Title One" not in build_prompt("Who is X?", None)
