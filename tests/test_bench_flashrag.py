"""The FlashRAG side-by-side benchmark's own parts, without FlashRAG (it lives in the peers venv): the files the peer
writes for FlashRAG (its dataset and corpus shapes, the corpus read back here as the same passages), the per-question
meter's attribution, and the benchmark's scoring, pairing, failure reasons and measured child processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orthrus_rag.config.app import CorpusConf
from orthrus_rag.data.corpus import iter_corpus
from orthrus_rag.data.loaders import build_corpus, load_qa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))
sys.path.insert(0, str(ROOT / "scripts"))
pytestmark = pytest.mark.bench  # a benchmark peer, not the product (make test-bench)

import bench_flashrag  # noqa: E402
import flashrag_peer  # noqa: E402


def two_wiki(path: Path, n: int) -> Path:
    rows = [{"_id": f"q{i}", "question": f"Who directed film {i}?", "answer": f"Director {i}", "type": "compositional",
             "supporting_facts": [[f"Film {i}", 0]],
             "context": [[f"Film {i}", [f"Film {i} is a film.", f" It was directed by Director {i}."]],
                         ["Shared", ["A paragraph every question has."]]]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prepare_writes_flashrags_dataset_and_corpus(tmp_path: Path) -> None:
    questions = two_wiki(tmp_path / "dev.jsonl", 3)
    counts = flashrag_peer.prepare(str(questions), 2, tmp_path / "w")
    assert counts == {"questions": 2, "passages": 4}  # three films and the shared paragraph once: every question's
    data = [json.loads(line) for line in open(tmp_path / "w" / "data" / "2wiki" / "dev.jsonl")]
    assert [d["id"] for d in data] == ["q0", "q1"]
    assert set(data[0]) == {"id", "question", "golden_answers", "metadata"}
    assert data[0]["golden_answers"] == ["Director 0"] and data[0]["metadata"]["type"] == "compositional"
    corpus = [json.loads(line) for line in open(tmp_path / "w" / "corpus.jsonl")]
    assert all(set(row) == {"id", "contents"} for row in corpus)
    assert corpus[0]["contents"] == "Film 0\nFilm 0 is a film. It was directed by Director 0."
    # the same passages as a run over the questions' contexts searches
    read = list(iter_corpus(CorpusConf(kind="jsonl", path=str(tmp_path / "w" / "corpus.jsonl"))))
    assert read == build_corpus(load_qa("2wiki", questions))


def test_meter_attributes_batch_calls_by_position_and_item_calls_to_the_item() -> None:
    meter = flashrag_peer.Meter(3, lambda text: len(text.split()))

    class Batchy:  # FlashRAG's IterativePipeline: one call over every question
        retriever = SimpleNamespace(search=lambda q: [q], batch_search=lambda qs: [[q] for q in qs])
        generator = SimpleNamespace(generate=lambda prompts: ["a b", "c", "d e f"])

    batch = Batchy()
    meter.wrap(batch)
    batch.retriever.batch_search(["x", "y", "z"])
    batch.generator.generate(["p", "q", "r"])
    assert meter.retrievals == [1, 1, 1] and meter.tokens == [2, 1, 3]

    meter = flashrag_peer.Meter(2, lambda text: len(text.split()))

    class Itemwise:  # FLARE / IRCoT / Self-Ask: run_item per question, scores returned beside the texts
        retriever = SimpleNamespace(search=lambda q: [q], batch_search=lambda qs: [])
        generator = SimpleNamespace(generate=lambda prompt, **k: (["one two three"], [[0.9, 0.8, 0.7]]))

        def run_item(self, item: str) -> None:
            self.retriever.search(item)
            self.generator.generate(item, return_scores=True)
            if item == "second":
                self.retriever.search(item)

    item = Itemwise()
    meter.wrap(item)
    item.run_item("first")
    item.run_item("second")
    assert meter.retrievals == [1, 2] and meter.tokens == [3, 3]
    assert all(t is not None and t >= 0 for t in meter.latency) and meter.current is None


def test_scores_rows_and_pairs_per_question() -> None:
    result = {"records": [
        {"id": "a", "question": "qa", "golden_answers": ["Paris"], "prediction": "Paris", "retrievals": 1,
         "generated_tokens": 4, "latency_s": 1.0},
        {"id": "b", "question": "qb", "golden_answers": ["Rome"], "prediction": "It is Rome.", "retrievals": 3,
         "generated_tokens": 6, "latency_s": 3.0}]}
    theirs, retrievals = bench_flashrag.flashrag_records(result)
    assert retrievals == [1, 3]
    assert (theirs["a"].em, theirs["b"].em, theirs["b"].acc) == (1.0, 0.0, 1.0)
    row = bench_flashrag.row("flashrag-hf", "standard", list(theirs.values()), 4.0, 2.0)
    assert row["qps"] == 0.5 and row["em"] == 0.5 and row["generated_tokens_per_question"] == 5.0
    assert 2.9 < row["p99_s"] <= 3.0
    ours, _ = bench_flashrag.flashrag_records({"records": [dict(r, prediction="Rome") for r in result["records"]]})
    pair = bench_flashrag.paired("standard", ours, theirs, "flashrag-hf")
    assert pair["questions"] == 2 and pair["identical"] == 0
    assert pair["em"]["flashrag"] == 0.5 and pair["em"]["orthrus"] == 0.5 and pair["em"]["diff"] == 0.0
    text = bench_flashrag.table({"rows": [row]})
    assert "| standard | flashrag-hf | 2 | 0.500 |" in text


def test_measured_child_and_its_failure_reason(tmp_path: Path) -> None:
    wall, rss = bench_flashrag.measured([sys.executable, "-c", "x = bytearray(50 << 20)"], tmp_path / "ok.log")
    assert wall > 0 and rss >= 50
    with pytest.raises(bench_flashrag.RunFailed) as err:
        bench_flashrag.measured([sys.executable, "-c", "print('step 1'); raise ValueError('stop sequences: 22 > 4')"],
                                tmp_path / "bad.log")
    assert err.value.reason == "ValueError: stop sequences: 22 > 4"


def test_copy_corpus_takes_the_first_passages_of_a_gzipped_corpus(tmp_path: Path) -> None:
    import gzip

    source = tmp_path / "big.jsonl.gz"
    with gzip.open(source, "wt", encoding="utf-8") as f:
        for i in range(5):
            f.write(json.dumps({"id": str(i), "contents": f"T{i}\nText {i}."}) + "\n")
    work = bench_flashrag.copy_corpus(source, tmp_path / "w", 3)
    rows = [json.loads(line) for line in open(work / "corpus.jsonl")]
    assert [r["id"] for r in rows] == ["0", "1", "2"]


def test_cells_resume_only_what_this_machine_measured_for_these_questions(tmp_path: Path) -> None:
    """A cell measured once is read back (row and records) by a --resume run on the same machine and questions; a
    run without --resume, or on another machine, or with another limit, measures again."""
    folder = tmp_path / "results"
    folder.mkdir()
    questions = two_wiki(tmp_path / "dev.jsonl", 2)
    result = {"records": [{"id": "a", "question": "qa", "golden_answers": ["Paris"], "prediction": "Paris",
                           "retrievals": 1, "generated_tokens": 4, "latency_s": 1.0}]}
    (folder / "flashrag-hf-standard.json").write_text(json.dumps(result))
    here = {"cpu": "X", "isa": "AVX2", "cores": 2}
    calls = []

    def measure():
        calls.append(1)
        recs, _ = bench_flashrag.flashrag_records(result)
        return recs, bench_flashrag.row("flashrag-hf", "standard", list(recs.values()), 2.0, 1.0)

    first = bench_flashrag.Cells(folder, here, 2, str(questions), resume=False)
    assert not first.done("flashrag-hf", "standard")
    _, row = first.run("flashrag-hf", "standard", measure)
    again = bench_flashrag.Cells(folder, here, 2, str(questions), resume=True)
    assert again.done("flashrag-hf", "standard")
    recs, kept = again.run("flashrag-hf", "standard", measure)
    assert kept == row and recs["a"].prediction == "Paris" and len(calls) == 1
    for other in (bench_flashrag.Cells(folder, dict(here, isa="AMX"), 2, str(questions), resume=True),
                  bench_flashrag.Cells(folder, here, 3, str(questions), resume=True),
                  bench_flashrag.Cells(folder, here, 2, str(questions), resume=False)):
        assert not other.done("flashrag-hf", "standard")
    builds = [{"system": "flashrag", "seconds": 1.0}]
    assert again.index(lambda: builds) == builds
    assert again.index(lambda: pytest.fail("kept builds are not rebuilt")) == builds


def test_index_corpora_accumulate_and_a_remeasured_one_replaces_its_builds() -> None:
    results = {"command": ["python scripts/bench_flashrag.py --questions dev.jsonl --limit 40",
                           "python scripts/bench_flashrag.py --corpus runs/corpus/c20k.jsonl --out r.json"],
               "results": {"index_corpus": {"corpus": "c20k.jsonl", "limit": None,
                                            "builds": [{"system": "flashrag", "passages": 20000, "seconds": 9.0}]}}}
    big = [{"system": "flashrag", "passages": 200000, "seconds": 90.0}]
    out = bench_flashrag.add_index_corpus(results, "c200k.jsonl.gz", None, big,
                                          "python scripts/bench_flashrag.py --corpus runs/corpus/c200k.jsonl.gz")
    assert [c["corpus"] for c in out["results"]["index_corpora"]] == ["c20k.jsonl", "c200k.jsonl.gz"]
    assert "index_corpus" not in out["results"] and len(out["command"]) == 3
    again = [{"system": "flashrag", "passages": 20000, "seconds": 8.0}]
    out = bench_flashrag.add_index_corpus(out, "c20k.jsonl", None, again,
                                          "python scripts/bench_flashrag.py --corpus runs/corpus/c20k.jsonl --out r")
    assert [c["builds"][0]["seconds"] for c in out["results"]["index_corpora"]] == [8.0, 90.0]
    assert sum("c20k" in c for c in out["command"]) == 1 and out["command"][0].endswith("--limit 40")


def test_a_question_run_written_over_a_results_file_keeps_its_corpora_builds() -> None:
    q40 = "python scripts/bench_flashrag.py --questions dev.jsonl --limit 40 --out r.json"
    corpus = ["python scripts/make_corpus.py --out runs/corpus/c20k.jsonl --generate 18415",
              "python scripts/bench_flashrag.py --corpus runs/corpus/c20k.jsonl --out r.json"]
    builds = [{"corpus": "c20k.jsonl", "limit": None, "builds": [{"system": "flashrag", "passages": 20000}]}]
    earlier = {"command": [q40, *corpus], "results": {"rows": [{"questions": 40}], "index_corpora": builds}}
    q200 = "python scripts/bench_flashrag.py --questions dev.jsonl --limit 200 --out r.json"
    out = bench_flashrag.keep_index_corpora({"command": [q200], "results": {"rows": [{"questions": 200}]}}, earlier)
    assert out["command"] == [q200, *corpus]
    assert out["results"]["index_corpora"] == builds and out["results"]["rows"] == [{"questions": 200}]
    first = bench_flashrag.keep_index_corpora({"command": [q200], "results": {"rows": []}}, {})
    assert first["command"] == [q200] and "index_corpora" not in first["results"]


def test_index_builds_start_empty_and_keep_one_builder_when_the_other_fails(tmp_path: Path, monkeypatch) -> None:
    """A stale build of another corpus is cleared first; a builder that fails is recorded with its reason and the
    other's figures are kept."""
    (tmp_path / "corpus.jsonl").write_text('{"id": "0", "contents": "T\\nText."}\n')
    (tmp_path / "orthrus_index").mkdir()
    (tmp_path / "orthrus_index" / "stale").write_text("another corpus")
    seen = []

    def fake_measured(cmd, log):
        seen.append((cmd[-1], (tmp_path / "orthrus_index" / "stale").exists()))
        if "index" in cmd and "--work" in cmd:
            log.write_text("Traceback\nMemoryError: killed\n")
            raise bench_flashrag.RunFailed(log)
        return 2.0, 100.0

    monkeypatch.setattr(bench_flashrag, "measured", fake_measured)
    rows = bench_flashrag.index_builds(tmp_path, sys.executable)
    assert rows[0] == {"system": "flashrag", "passages": 1, "error": "MemoryError: killed"}
    assert rows[1]["system"] == "orthrus" and rows[1]["seconds"] == 2.0 and rows[1]["passages_per_s"] == 0.5
    assert seen[-1][1] is False  # the orthrus builder found its folder empty


def test_an_orthrus_cell_measured_again_starts_from_an_empty_run_folder(tmp_path: Path, monkeypatch) -> None:
    """An earlier run's records in the method's folder (another limit) would make `orthrus-rag run` refuse."""
    stale = tmp_path / "orthrus_runs" / "standard"
    stale.mkdir(parents=True)
    (stale / "records.jsonl").write_text('{"id": "old"}\n')
    seen = []

    def fake_measured(cmd, log):
        seen.append((stale / "records.jsonl").exists())
        stale.mkdir(parents=True, exist_ok=True)
        (stale / "summary.json").write_text(json.dumps({"wall_time_s": 1.0, "retrievals_per_question": 1.0}))
        return 1.0, 100.0

    monkeypatch.setattr(bench_flashrag, "measured", fake_measured)
    one = SimpleNamespace(em=1.0, f1=1.0, acc=1.0, generated_tokens=3, latency_s=0.5)
    monkeypatch.setattr("orthrus_rag.pipelines.compare.answered", lambda run_dir: {"q0": one})
    _, r = bench_flashrag.run_orthrus(tmp_path, "dev.jsonl", 2, "standard", [])
    assert seen == [False] and r["questions"] == 1 and r["qps"] == 1.0
