"""`orthrus-rag compare`: two runs paired per question (pipelines/compare.py), on run folders written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orthrus_rag.entrypoints.cli import main
from orthrus_rag.pipelines.compare import compare_runs, comparison_table
from orthrus_rag.pipelines.records import QARecord


def _run(folder: Path, em: list[int], recall: list[float | None], errors: set[int] = frozenset(),
         prediction: str = "p") -> Path:
    folder.mkdir(parents=True)
    with (folder / "records.jsonl").open("w") as f:
        for i, (e, r) in enumerate(zip(em, recall)):
            rec = QARecord(id=f"q{i}", question="?", golden_answers=["a"], type=None, supporting_titles=[],
                           prediction=f"{prediction}{i}" if i % 2 else "same", em=e, f1=0.5 * e, acc=e,
                           recall={"recall@5": r, "recall@used": r, "recall@10": r}, index=i,
                           error="boom" if i in errors else None)
            f.write(json.dumps(rec.to_json()) + "\n")
    return folder


def test_paired_differences_gains_losses_and_a_seeded_interval(tmp_path):
    n = 40
    base_em = [1 if i < 10 else 0 for i in range(n)]  # right on q0-q9
    other_em = [1 if 2 <= i < 16 else 0 for i in range(n)]  # loses q0, q1; gains q10-q15
    base = _run(tmp_path / "a", base_em, [0.5] * n)
    other = _run(tmp_path / "b", other_em, [0.5] * (n - 1) + [None], prediction="x")
    c = compare_runs(base, other, resamples=4000, seed=1)
    em = {m.name: m for m in c.metrics}["em"]
    assert (c.common, c.identical) == (n, n // 2)  # the even ones predict "same" in both
    assert (em.base, em.other, em.gained, em.lost) == (0.25, 0.35, 6, 2)
    # a net +4 of 40 from 8 discordant questions: the paired interval is ~3.92 standard errors of the mean
    # difference, sqrt(0.19 / 40) = 0.069, i.e. ~0.27 wide; unpaired (two means' errors) it would be ~0.40
    assert em.low < em.diff < em.high
    assert abs((em.high - em.low) - 3.92 * (0.19 / n) ** 0.5) < 0.04
    # recall@k by k, then a gathering method's recall@used
    assert [m.name for m in c.metrics][-3:] == ["recall@5", "recall@10", "recall@used"]
    rec5 = {m.name: m for m in c.metrics}["recall@5"]
    assert rec5.n == n - 1 and rec5.diff == 0 and rec5.low == rec5.high == 0.0  # None left out; equal: no spread
    again = compare_runs(base, other, resamples=4000, seed=1)
    assert [(m.low, m.high) for m in again.metrics] == [(m.low, m.high) for m in c.metrics]
    table = comparison_table(c)
    assert "em" in table and "6/2" in table and "40 questions answered in both" in table


def test_failed_questions_are_left_out_of_both_and_a_torn_line_is_skipped_untouched(tmp_path):
    base = _run(tmp_path / "a", [1, 1, 0, 0], [1.0] * 4, errors={1})
    other = _run(tmp_path / "b", [0, 1, 1, 0], [1.0] * 4)
    torn = (other / "records.jsonl").read_bytes() + b'{"id": "q9", "quest'
    (other / "records.jsonl").write_bytes(torn)
    c = compare_runs(base, other, resamples=100)
    assert (c.common, c.only_base, c.only_other) == (3, 0, 1)
    em = {m.name: m for m in c.metrics}["em"]
    assert (em.gained, em.lost) == (1, 1)  # q1 (failed in base) counts for neither
    assert (other / "records.jsonl").read_bytes() == torn  # a reader: nothing repaired or rewritten


def test_bad_input_is_named(tmp_path, capsys):
    a = _run(tmp_path / "a", [1], [1.0])
    with pytest.raises(ValueError, match="no records.jsonl"):
        compare_runs(a, tmp_path)
    b = _run(tmp_path / "b", [1], [1.0], errors={0})
    with pytest.raises(ValueError, match="share no answered question"):
        compare_runs(a, b)
    c = _run(tmp_path / "c", [1], [1.0])
    rows = (c / "records.jsonl").read_text().replace('"question": "?"', '"question": "another?"')
    (c / "records.jsonl").write_text(rows)
    with pytest.raises(ValueError, match="different questions under the same id \\(1 of 1, e.g. 'q0'\\)"):
        compare_runs(a, c)
    with pytest.raises(ValueError, match="resamples must be at least 1"):
        compare_runs(a, a, resamples=0)
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "is not a run folder" in capsys.readouterr().err
    assert main(["compare", str(a), str(a), "--resamples", "50"]) == 0
    assert "1 identical predictions" in capsys.readouterr().out
