"""The corpus sources (data/corpus.py): FlashRAG JSONL (plain and gzipped), a `datasets` stream, a folder of files
cut by the splitter, the dataset's own paragraphs; and bad input named by file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from orthrus_rag.data.corpus import CorpusError, corpus_identity, count_passages, iter_corpus
from orthrus_rag.data.types import Passage

from orthrus_rag.config.app import CorpusConf

ROWS = [{"id": "0", "contents": "\"Alpha Town\"\nAlpha Town is a town on the river."},
        {"id": "1", "contents": "Beta\nBeta is a village.", "extra": {"kept": False}},
        {"id": "2", "title": "Gamma", "text": "Gamma is a city."}]


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def conf(**kw: object) -> CorpusConf:
    return CorpusConf(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("gz", [False, True])
def test_flashrag_jsonl_reads_contents_and_title_text(tmp_path: Path, gz: bool) -> None:
    path = write_jsonl(tmp_path / ("c.jsonl.gz" if gz else "c.jsonl"), ROWS, gz=gz)
    passages = list(iter_corpus(conf(kind="jsonl", path=str(path))))
    assert passages == [Passage("0", "Alpha Town", "Alpha Town is a town on the river."),
                        Passage("1", "Beta", "Beta is a village."), Passage("2", "Gamma", "Gamma is a city.")]
    assert count_passages(conf(kind="jsonl", path=str(path))) == 3
    assert [p.id for p in iter_corpus(conf(kind="jsonl", path=str(path), limit=2))] == ["0", "1"]


def test_contents_repeating_the_title_field_loses_its_title_line(tmp_path: Path) -> None:
    """A row with `title` and FlashRAG's `contents` ("title\ntext"): the title line is not read as text; a
    first line that is not the title stays."""
    rows = [{"id": "a", "title": "Delta", "contents": "\"Delta\"\nDelta is a port."},
            {"id": "b", "title": "Epsilon", "contents": "Intro\nEpsilon is a lake."}]
    got = list(iter_corpus(conf(kind="jsonl", path=str(write_jsonl(tmp_path / "c.jsonl", rows)))))
    assert got == [Passage("a", "Delta", "Delta is a port."), Passage("b", "Epsilon", "Intro\nEpsilon is a lake.")]


def test_jsonl_renamed_fields_and_missing_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"body": "one two", "name": "T"}, {"body": "three", "name": "U"}])
    passages = list(iter_corpus(conf(kind="jsonl", path=str(path), text_field="body", title_field="name")))
    assert passages == [Passage("0", "T", "one two"), Passage("1", "U", "three")]


@pytest.mark.parametrize(("rows", "message"), [
    ([ROWS[0], "{not json"], r"c\.jsonl:2: not a JSON object"),
    ([ROWS[0], ROWS[1], {"id": "9", "contents": "   "}], r"c\.jsonl:3: empty passage"),
    ([{"id": "5", "body": "x"}], r"c\.jsonl:1: no 'contents' or 'text' field \(the record has body, id\)"),
    ([[1, 2]], r"c\.jsonl:1: expected a JSON object, got list"),
    ([{"id": "1", "contents": 7}], r"c\.jsonl:1: field 'contents' is a int"),
])
def test_bad_jsonl_lines_are_named(tmp_path: Path, rows: list, message: str) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(CorpusError, match=message):
        list(iter_corpus(conf(kind="jsonl", path=str(path))))


def test_an_unknown_configured_field_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", ROWS)
    with pytest.raises(CorpusError, match=r"c\.jsonl:1: no field 'body' \(the record has contents, id\)"):
        list(iter_corpus(conf(kind="jsonl", path=str(path), text_field="body")))


def test_missing_path_and_kind_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        list(iter_corpus(conf(kind="jsonl", path=str(tmp_path / "nope.jsonl"))))
    with pytest.raises(CorpusError, match="needs corpus.path"):
        list(iter_corpus(conf(kind="files")))
    with pytest.raises(CorpusError, match="unknown corpus kind 'csv'"):
        list(iter_corpus(conf(kind="csv")))


def test_hf_streams_a_datasets_loader(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", ROWS)
    passages = list(iter_corpus(conf(kind="hf", hub_id="json", data_files=[str(path)], split="train")))
    assert [(p.id, p.title) for p in passages] == [("0", "Alpha Town"), ("1", "Beta"), ("2", "Gamma")]


def test_hf_bad_row_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "0", "text": "fine"}, {"id": "1", "text": ""}])
    with pytest.raises(CorpusError, match=r"row 1: empty passage"):
        list(iter_corpus(conf(kind="hf", hub_id="json", data_files=[str(path)])))


def test_files_are_cut_with_overlap_and_titled_by_path(tmp_path: Path) -> None:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    words = [f"w{i}" for i in range(100)]
    (tmp_path / "docs" / "a.txt").write_text(" ".join(words), encoding="utf-8")
    (tmp_path / "docs" / "sub" / "b.md").write_text("# Head\n\nshort section\n\n## Two\n\nmore text", encoding="utf-8")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\x00\x01")
    passages = list(iter_corpus(conf(kind="files", path=str(tmp_path / "docs"), chunk_tokens=30, chunk_overlap=5)))
    a = [p for p in passages if p.title == "a.txt"]
    assert len(a) >= 4 and all(len(p.text.split()) <= 30 for p in a)
    first, second = a[0].text.split(), a[1].text.split()
    assert first[0] == "w0" and set(first[-5:]) & set(second[:10])  # neighbours share words
    assert {w for p in a for w in p.text.split()} == set(words)  # nothing lost
    assert [p.id for p in a] == [f"a.txt#{k}" for k in range(len(a))]
    b = [p for p in passages if p.title == "sub/b.md"]
    assert b and "short section" in " ".join(p.text for p in b)
    counted = list(iter_corpus(conf(kind="files", path=str(tmp_path / "docs"), chunk_tokens=30, chunk_overlap=5),
                               count_tokens=lambda t: 2 * len(t.split())))
    assert len([p for p in counted if p.title == "a.txt"]) > len(a)  # the token count decides the cut


def test_files_refuse_an_empty_folder_and_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="holds no .txt or .md files"):
        list(iter_corpus(conf(kind="files", path=str(tmp_path))))
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(CorpusError, match="chunk_overlap"):
        list(iter_corpus(conf(kind="files", path=str(tmp_path), chunk_tokens=10, chunk_overlap=10)))


def test_contexts_take_the_datasets_paragraphs() -> None:
    got = list(iter_corpus(conf(kind="contexts"), contexts=lambda: [Passage("p0", "T", "x")]))
    assert got == [Passage("p0", "T", "x")]
    with pytest.raises(CorpusError, match="needs the dataset"):
        list(iter_corpus(conf(kind="contexts")))


def test_identity_changes_with_the_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", ROWS)
    before = corpus_identity(conf(kind="jsonl", path=str(path)))
    write_jsonl(path, ROWS[:2])
    assert corpus_identity(conf(kind="jsonl", path=str(path))) != before
    assert corpus_identity(SimpleNamespace(kind="contexts"))["kind"] == "contexts"


def test_the_generated_corpus_is_seeded_sliceable_and_wiki_sized() -> None:
    from orthrus_rag.data.generated_corpus import generate_passages

    first = list(generate_passages(400, seed=3))
    assert first == list(generate_passages(400, seed=3)) and first != list(generate_passages(400, seed=4))
    assert list(generate_passages(10, seed=3, start=200)) == first[200:210]
    lengths = [len(p.text.split()) for p in first]
    assert 90 <= sum(lengths) / len(lengths) <= 120 and min(lengths) >= 20 and max(lengths) <= 260
    assert len({p.id for p in first}) == 400 and all(p.title and p.text.endswith(".") for p in first)


def test_make_corpus_exports_datasets_and_generated_passages_as_flashrag_jsonl(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_corpus", Path(__file__).parent.parent / "scripts" /
                                                  "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    qa = tmp_path / "qa.jsonl"
    rows = [{"question": "q?", "answer": "a", "context": [["Alpha", ["One.", "Two."]], ["Beta", ["Three."]]]},
            {"question": "r?", "answer": "b", "context": [["Beta", ["Three."]], ["Gamma", ["Four."]]]}]
    write_jsonl(qa, rows)
    out = tmp_path / "c.jsonl.gz"
    assert module.main(["--out", str(out), "--dataset", f"2wiki={qa}", "--dataset", f"hotpotqa={qa}",
                        "--generate", "5"]) == 0
    passages = list(iter_corpus(conf(kind="jsonl", path=str(out))))
    assert [(p.id, p.title, p.text) for p in passages[:3]] == [("2wiki-0", "Alpha", "One. Two."),
                                                               ("2wiki-1", "Beta", "Three."),
                                                               ("2wiki-2", "Gamma", "Four.")]
    assert len(passages) == 3 + 5 and passages[3].id == "gen-0-0"  # the second file's titles were all seen
