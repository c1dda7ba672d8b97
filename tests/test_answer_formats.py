"""`pipeline.answer_format`: the final iteration's constraint and how its answer is read back (fast, no model), and a
run on the real small models where every final answer is found in all three formats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orthrus_rag.pipelines.answers import (ANSWER_TOKENS, CHARS_PER_TOKEN, check_answer_format,
                                                  final_constraint, parse_final)


def test_constraints_per_format():
    assert final_constraint("free", 96) is None
    spec = final_constraint("constrained", 96)
    assert spec.kind == "regex"
    pattern = re.compile(spec.regex)
    assert pattern.fullmatch("X was born in 1900. So the answer is Paris.")
    assert pattern.fullmatch("So the answer is St. Louis, Missouri.")
    assert not pattern.fullmatch("X was born in 1900.")  # the end is refused until the sentence is written
    assert not pattern.fullmatch("X.\nSo the answer is Paris.")  # one line: no invented next demonstration
    assert not pattern.fullmatch("X was born in 196So the answer is A.")  # the reasoning ends its sentence first
    assert not pattern.fullmatch("x" * ((96 - ANSWER_TOKENS) * CHARS_PER_TOKEN + 1) + " So the answer is A.")
    assert final_constraint("json", 96).json["required"] == ["answer"]
    with pytest.raises(ValueError, match="unknown answer_format 'xml'; expected one of free, constrained, json"):
        check_answer_format("xml")


@pytest.mark.parametrize("generation,fmt,question,answer,found", [
    (" Paris is in France. So the answer is Paris.", "constrained", None, "Paris", True),
    # the forced phrase is the last one; the model may write on past its full stop
    ("Maybe so the answer is Rome. So the answer is Paris. Paris is big.", "constrained", None, "Paris", True),
    ("So the answer is St. Louis.", "constrained", None, "St. Louis", True),
    ("Both are French. So the answer is No.", "constrained", "Are they both German?", "no", True),
    ("cut short by the budget", "constrained", None, "cut short by the budget", False),
    ('{"answer": "Ilse Maralt"}', "json", None, "Ilse Maralt", True),
    ('{"answer": "Yes"}', "json", "Were both films released in 1999?", "yes", True),
    ('{"answer": "Ilse', "json", None, '{"answer": "Ilse', False),  # cut: the fallback rules read it
    ("Anna wrote it. So the answer is Anna.", "free", None, "Anna", True),
])
def test_parse_final(generation, fmt, question, answer, found):
    parsed = parse_final(generation, fmt, question)
    assert (parsed.answer, parsed.found) == (answer, found)


@pytest.mark.slow  # SmolLM2 + MiniLM
@pytest.mark.parametrize("fmt", ["free", "constrained", "json"])
def test_every_final_answer_is_found_when_constrained(fmt, tmp_path: Path):
    from orthrus_rag.entrypoints import commands as app
    from tests.test_app_config import _compose

    cfg = _compose("experiment=smoke", "dataset.num_questions=6", "pipeline.max_tokens=64", "retriever.k=2",
                   f"run_dir={tmp_path}", "progress=false", f"pipeline.answer_format={fmt}")
    summary = app.run(cfg)
    assert summary["num_questions"] == 6 and summary["num_failed"] == 0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    finals = [r["iterations"][-1] for r in records]
    if fmt == "constrained":
        assert all(f["answer_found"] for f in finals)
        assert all(re.search(r"So the answer is [^\n]+\.$", f["generation"]) for f in finals)
        assert all("\n" not in f["generation"] for f in finals)
    elif fmt == "json":
        for f in finals:
            assert f["answer_found"], f["generation"]
            assert json.loads(f["generation"])["answer"].strip() == f["answer"] or f["answer"] in ("yes", "no")
    # the first iteration is never constrained (its text is the next query), and the format is recorded
    assert "answer_format: " + fmt in (tmp_path / "config.yaml").read_text()
    assert summary["config"]["answer_format"] == fmt
