"""FlashRAG's formats both ways: `dataset=flashrag` reads its dataset files (a bad record exits 2 naming its line,
before any model loads), and `orthrus-rag export` writes a run's records in its result shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orthrus_rag.data import load_qa
from orthrus_rag.data.types import Passage
from orthrus_rag.entrypoints.cli import main
from orthrus_rag.pipelines.export import FLASHRAG_FILE, export_run
from orthrus_rag.pipelines.records import IterationRecord, QARecord
from orthrus_rag.retrievers.passage_store import shard_name, write_shard

FLASHRAG_ROWS = [
    {"id": "test_0", "question": "Who wrote Emma?", "golden_answers": ["Jane Austen", "Austen"],
     "metadata": {"type": "bridge"}},
    {"id": "test_1", "question": "Which river flows north?", "golden_answers": ["Nile"], "metadata": {}},
]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_flashrag_dataset_file_is_read_and_a_bad_record_is_named(tmp_path: Path, capsys) -> None:
    good = _write(tmp_path / "test.jsonl", FLASHRAG_ROWS)
    examples = load_qa("flashrag", path=good)
    assert [(e.id, e.question, e.golden_answers, e.type) for e in examples] == [
        ("test_0", "Who wrote Emma?", ["Jane Austen", "Austen"], "bridge"), ("test_1", "Which river flows north?",
                                                                            ["Nile"], None)]
    with pytest.raises(ValueError, match="give dataset.path=FILE"):
        load_qa("flashrag")
    bad = _write(tmp_path / "bad.jsonl", [FLASHRAG_ROWS[0], {"id": "x", "question": "Q?", "golden_answers": []}])
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: cannot read example: missing 'golden_answers'"):
        load_qa("flashrag", path=bad)
    # the CLI stops before any model loads, with exit 2 and the line
    assert main(["run", "dataset=flashrag", f"dataset.path={bad}", f"run_dir={tmp_path / 'run'}",
                 "progress=false"]) == 2
    assert "bad.jsonl: line 2" in capsys.readouterr().err


def _run_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    (folder / "index" / "passages").mkdir(parents=True)
    write_shard(folder / "index" / "passages" / shard_name(0),
                [Passage("p0", "Emma", "Emma is a novel by Jane Austen."), Passage("p1", "Nile", "The Nile flows north."),
                 Passage("p2", "Austen", "Jane Austen was an English novelist.")])
    steps = [IterationRecord(1, "Who wrote Emma?", [{"id": "p0", "title": "Emma", "score": 0.9},
                                                    {"id": "p1", "title": "Nile", "score": 0.2}], "prompt 1", "g1",
                             "", 0.1, 0.2),
             IterationRecord(2, "Emma author", [{"id": "p2", "title": "Austen", "score": 0.8},
                                                {"id": "p0", "title": "Emma", "score": 0.7},
                                                {"id": "p9", "title": "Lost", "score": 0.1}], "prompt 2",
                             "So the answer is Jane Austen.", "Jane Austen", 0.1, 0.2)]
    records = [QARecord("test_1", "Which river flows north?", ["Nile"], None, [], index=1, error="RuntimeError: boom"),
               QARecord("test_0", "Who wrote Emma?", ["Jane Austen"], "bridge", ["Emma"], iterations=steps,
                        prediction="Jane Austen", em=1.0, f1=1.0, acc=1.0, recall={"recall@2": 1.0}, index=0)]
    (folder / "records.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return folder


def test_export_writes_flashrag_items_with_their_retrieval_results(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    items = json.loads(export_run(folder).read_text())
    assert [i["id"] for i in items] == ["test_0", "test_1"]  # dataset order
    first = items[0]
    assert set(first) == {"id", "question", "golden_answers", "metadata", "output"}
    assert first["metadata"] == {"supporting_titles": ["Emma"], "type": "bridge"}
    out = first["output"]
    assert (out["pred"], out["raw_pred"], out["prompt"]) == ("Jane Austen", "So the answer is Jane Austen.", "prompt 2")
    assert out["metric_score"] == {"em": 1.0, "f1": 1.0, "acc": 1.0, "recall@2": 1.0}
    docs = out["retrieval_result"]
    assert [d["id"] for d in docs] == ["p0", "p1", "p2", "p9"]  # every step's, in order, each once
    assert docs[0]["contents"] == "Emma\nEmma is a novel by Jane Austen." and docs[0]["score"] == 0.9
    assert "contents" not in docs[3] and docs[3]["title"] == "Lost"  # not in the index: id and title only
    failed = items[1]["output"]
    assert failed["pred"] == "" and failed["error"] == "RuntimeError: boom" and failed["retrieval_result"] == []


def test_the_export_command(tmp_path: Path, capsys) -> None:
    folder = _run_folder(tmp_path)
    assert main(["export", str(folder)]) == 0 and (folder / FLASHRAG_FILE).is_file()
    assert main(["export", str(folder), "--out", str(tmp_path / "x.json")]) == 0 and (tmp_path / "x.json").is_file()
    assert main(["export", str(tmp_path / "nope")]) == 2
    assert "holds no records.jsonl" in capsys.readouterr().err
