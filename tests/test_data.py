"""Dataset loaders: the real 2Wiki sample, the local formats and their errors, the hub's offline error, synthetic."""

from __future__ import annotations

import json
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from orthrus_rag.data import DATASETS, Passage, QAExample, build_corpus, load_qa, make_synthetic
from orthrus_rag.data.loaders import DatasetUnavailableError

TWOWIKI = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "2wikimultihopqa_dev_first200.jsonl"


def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def _hotpot_record(i: int) -> dict:
    return {"_id": f"h{i}", "question": f"Q{i}?", "answer": f"A{i}", "type": "bridge",
            "supporting_facts": [["T1", 0], ["T2", 1], ["T1", 1]],
            "context": [["T1", [" First  sentence. ", "Second."]], ["T2", ["Only one."]]]}


@pytest.mark.skipif(not TWOWIKI.is_file(), reason=f"2Wiki sample not found at {TWOWIKI} (../shared/data/)")
def test_real_2wiki_sample_loads_with_its_types_gold_titles_and_corpus() -> None:
    examples = load_qa("2wiki", path=TWOWIKI)
    assert len(examples) == 200
    assert Counter(e.type for e in examples) == {"compositional": 90, "comparison": 48, "bridge_comparison": 40,
                                                 "inference": 22}
    first = examples[0]
    assert (first.id, first.golden_answers) == ("dev_0", ["Małgorzata Braunek"])
    assert first.supporting_titles == ["Polish-Russian War (film)", "Xawery Żuławski"]
    for ex in examples:
        titles = [p.title for p in ex.context]
        assert len(titles) == 10 and ex.golden_answers and 2 <= len(ex.supporting_titles) <= 4
        assert set(ex.supporting_titles) <= set(titles), ex.id
        assert all(p.text and "  " not in p.text for p in ex.context)
    corpus = build_corpus(examples)
    # NOTE: 2,000 context paragraphs in all; many titles recur across questions
    assert sum(len(e.context) for e in examples) == 2000
    assert len(corpus) == len({p.title for p in corpus}) == 1585
    assert [p.id for p in corpus[:3]] == ["p0", "p1", "p2"] and corpus[-1].id == "p1584"
    assert corpus[0].contents == f"{corpus[0].title}\n{corpus[0].text}"
    assert [e.id for e in load_qa("2wiki", path=str(TWOWIKI), limit=5)] == [e.id for e in examples[:5]]


def test_hotpot_flashrag_and_columnar_shapes_map_to_one_example_type(tmp_path: Path) -> None:
    flashrag = {"id": "f1", "question": "Who?", "golden_answers": ["X", "Mr X"],
                "metadata": {"type": "comparison", "supporting_facts": {"title": ["T2", "T1"], "sent_id": [0, 0]},
                             "context": {"title": ["T1", "T2"], "content": [["a  b", "c"], ["d"]]}}}
    columnar = {"id": "c1", "question": "What?", "answer": "Y", "level": "hard",
                "supporting_facts": {"title": ["T1"], "sent_id": [0]},
                "context": {"title": ["T1"], "sentences": [["e\n", "f"]]}}
    hotpot, fl, col = load_qa("hotpotqa", path=_write_jsonl(tmp_path / "m.jsonl", [_hotpot_record(0), flashrag,
                                                                                    "", columnar]))
    assert hotpot == QAExample("h0", "Q0?", ["A0"], "bridge", ["T1", "T2"],
                               [Passage("h0#0", "T1", "First sentence. Second."), Passage("h0#1", "T2", "Only one.")])
    assert (fl.id, fl.golden_answers, fl.type) == ("f1", ["X", "Mr X"], "comparison")
    assert fl.supporting_titles == ["T2", "T1"]
    assert [(p.title, p.text) for p in fl.context] == [("T1", "a b c"), ("T2", "d")]
    assert (col.golden_answers, col.type, col.context[0].text) == (["Y"], None, "e f")
    # the original HotpotQA / 2Wiki release is one JSON array
    array = tmp_path / "dev.json"
    array.write_text(json.dumps([_hotpot_record(i) for i in range(4)]), encoding="utf-8")
    assert [e.id for e in load_qa("hotpotqa", path=array, limit=2)] == ["h0", "h1"]


def test_limit_and_corpus_dedup_by_first_title(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [_hotpot_record(i) for i in range(5)])
    assert len(load_qa("2wiki", path=path)) == 5
    assert [e.id for e in load_qa("2wiki", path=path, limit=3)] == ["h0", "h1", "h2"]
    assert load_qa("2wiki", path=path, limit=0) == []
    a = QAExample("a", "q", ["x"], context=[Passage("a#0", "T", "first"), Passage("a#1", "U", "u")])
    b = QAExample("b", "q", ["x"], context=[Passage("b#0", "T", "second"), Passage("b#1", "V", "v")])
    assert build_corpus([a, b]) == [Passage("p0", "T", "first"), Passage("p1", "U", "u"), Passage("p2", "V", "v")]


def test_bad_name_missing_file_and_malformed_lines_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'squad'.*2wiki.*hotpotqa.*synthetic"):
        load_qa("squad")
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_qa("2wiki", path=missing)
    bad_json = _write_jsonl(tmp_path / "bad.jsonl", [_hotpot_record(0), "{not json"])
    with pytest.raises(ValueError, match=re.escape(f"{bad_json}: line 2")):
        load_qa("2wiki", path=bad_json)
    no_answer = _write_jsonl(tmp_path / "noans.jsonl", [{"question": "q?", "context": []}])
    with pytest.raises(ValueError, match=r"noans.jsonl: line 1: .*'answer'"):
        load_qa("2wiki", path=no_answer)
    bad_context = _write_jsonl(tmp_path / "ctx.jsonl", [{"question": "q?", "answer": "a", "context": [["T"]]}])
    with pytest.raises(ValueError, match=r"ctx.jsonl: line 1: .*context"):
        load_qa("hotpotqa", path=bad_context)
    with pytest.raises(ValueError, match="limit"):
        load_qa("2wiki", path=bad_json, limit=-1)


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, load_dataset: object) -> None:
    """Stand in for the `datasets` package so no test can reach the network."""
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_hub_without_network_tells_the_user_to_pass_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def offline(hub_id: str, config: str | None = None, split: str | None = None) -> None:
        calls.append((hub_id, config, split))
        raise ConnectionError(f"Couldn't reach '{hub_id}' on the Hub (OfflineModeIsEnabled)")

    _fake_datasets(monkeypatch, offline)
    with pytest.raises(DatasetUnavailableError, match=r"framolfese/2WikiMultihopQA.*dataset\.path=") as err:
        load_qa("2wiki")
    assert isinstance(err.value.__cause__, ConnectionError)
    with pytest.raises(DatasetUnavailableError, match="dataset.path="):
        load_qa("hotpotqa", split="train")
    with pytest.raises(DatasetUnavailableError, match="me/mirror"):
        load_qa("hotpotqa", hub_id="me/mirror")
    assert calls == [("framolfese/2WikiMultihopQA", None, "validation"), ("hotpotqa/hotpot_qa", "distractor", "train"),
                     ("me/mirror", None, "validation")]


def test_hub_rows_convert_like_local_records(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_datasets(monkeypatch, lambda hub_id, config=None, split=None: [_hotpot_record(i) for i in range(3)])
    assert [e.id for e in load_qa("hotpotqa", limit=2)] == ["h0", "h1"]


def test_synthetic_is_deterministic_per_seed() -> None:
    assert make_synthetic(40, seed=3) == make_synthetic(40, seed=3)
    assert make_synthetic(40, seed=3) != make_synthetic(40, seed=4)
    assert [e.id for e in load_qa("synthetic", limit=12)] == [e.id for e in make_synthetic(12)]
    assert set(DATASETS) == {"2wiki", "hotpotqa", "synthetic", "jsonl", "flashrag"}


def test_the_jsonl_dataset_reads_only_the_users_file(tmp_path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "a", "question": "Who wrote Emma?", "golden_answers": ["Jane Austen"]}\n')
    [example] = load_qa("jsonl", path=path)
    assert (example.id, example.golden_answers) == ("a", ["Jane Austen"])
    with pytest.raises(ValueError, match="give dataset.path=FILE"):
        load_qa("jsonl")


def test_synthetic_answers_follow_from_the_gold_paragraphs() -> None:
    examples = make_synthetic(100, seed=1)
    assert Counter(e.type for e in examples) == {"compositional": 45, "comparison": 25, "bridge_comparison": 20,
                                                 "inference": 10}
    assert len({e.question for e in examples}) == 100
    for ex in examples:
        by_title = {p.title: p.text for p in ex.context}
        assert len(ex.context) == len(by_title) == 10 and set(ex.supporting_titles) <= set(by_title)
        assert all(20 <= len(p.text.split()) <= 60 for p in ex.context)
        gold_text = " ".join(by_title[t] for t in ex.supporting_titles)
        if ex.type in ("compositional", "inference"):
            assert 2 == len(ex.supporting_titles) and any(a in gold_text for a in ex.golden_answers), ex
        elif ex.type == "comparison":
            assert ex.golden_answers[0] in ex.supporting_titles and len(ex.supporting_titles) == 2
        else:
            films = ex.supporting_titles[0::2]
            assert len(ex.supporting_titles) == 4 and ex.golden_answers[0] in films
        if "came out first" in ex.question:  # the answer is checkable from the paragraphs alone
            years = {t: int(re.search(r" is a (\d{4}) ", by_title[t]).group(1)) for t in ex.supporting_titles}
            assert years[ex.golden_answers[0]] == min(years.values())
