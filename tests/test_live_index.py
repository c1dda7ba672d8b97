"""LiveIndex: documents added and deleted while an index serves, on a deterministic fake embedder (no model):
what a search sees after each call, what a reopened folder holds, what a refused batch leaves, and the segment
merges."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from orthrus_rag.data.types import Passage
from orthrus_rag.retrievers import DenseRetriever, DocumentError, LiveIndex
from orthrus_rag.retrievers.live_segments import LIVE_DIR, LIVE_MANIFEST

from tests.test_retriever import HashEmbedder, make_corpus


def _saved(tmp_path: Path, index_type: str = "flat", n: int = 60) -> Path:
    base = DenseRetriever(HashEmbedder(), index_type=index_type, nlist=4, nprobe=4)
    base.build(make_corpus(n))
    base.save(tmp_path / "index")
    return tmp_path / "index"


def _new(i: int) -> Passage:
    return Passage(f"new-{i}", f"New {i}", f"zeta{i} omega{i} kappa{i}")


def _top(index: LiveIndex, query: str, k: int = 1) -> list[str]:
    return [p.id for p, _ in index.search(query, k)]


@pytest.mark.parametrize("index_type", ["flat", "ivf", "hnsw"])
def test_an_added_document_is_found_by_the_next_search_and_a_deleted_one_is_not(tmp_path: Path,
                                                                                 index_type: str) -> None:
    live = LiveIndex.open(_saved(tmp_path, index_type), HashEmbedder())
    assert _top(live, "zeta3 omega3 kappa3") != ["new-3"]
    assert live.add([_new(3)]) == ["new-3"]
    assert _top(live, "zeta3 omega3 kappa3") == ["new-3"]
    assert len(live) == 61
    live.delete(["new-3", "7"])  # a live document and one of the saved index
    assert "new-3" not in _top(live, "zeta3 omega3 kappa3", k=5)
    assert "7" not in _top(live, "alpha7 beta7 gamma7", k=5)
    assert _top(live, "alpha8 beta8 gamma8") == ["8"]
    assert len(live) == 59 and live.get("7") is None and live.get("8").id == "8"


def test_k_present_hits_come_back_past_the_tombstones(tmp_path: Path) -> None:
    live = LiveIndex.open(_saved(tmp_path), HashEmbedder())
    live.add([_new(i) for i in range(10)])
    live.delete([f"new-{i}" for i in range(8)] + [str(i) for i in range(20)])
    hits = live.search("zeta1 omega1 kappa1 common1", k=12)
    assert len(hits) == 12 and len({p.id for p, _ in hits}) == 12
    assert not {p.id for p, _ in hits} & ({f"new-{i}" for i in range(8)} | {str(i) for i in range(20)})
    scores = [s for _, s in hits]
    assert scores == sorted(scores, reverse=True)  # one ranking across both parts


def test_a_reopened_folder_holds_the_adds_and_deletes(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    live = LiveIndex.open(folder, HashEmbedder())
    for i in range(6):
        live.add([_new(i)])
    live.delete(["new-2", "5"])
    again = LiveIndex.open(folder, HashEmbedder())
    assert len(again) == len(live) == 64
    for i in (0, 1, 3, 4, 5):
        assert _top(again, f"zeta{i} omega{i} kappa{i}") == [f"new-{i}"]
    assert again.get("new-2") is None and again.get("5") is None
    query = "alpha9 beta9 gamma9 common3"
    assert [(p.id, round(s, 5)) for p, s in again.search(query, 8)] == \
        [(p.id, round(s, 5)) for p, s in live.search(query, 8)]


def test_a_deleted_id_can_be_added_again_and_survives_a_reopen(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    live = LiveIndex.open(folder, HashEmbedder())
    live.delete(["4"])
    live.add([Passage("4", "Four again", "rewritten lambda mu")])
    again = LiveIndex.open(folder, HashEmbedder())
    assert again.get("4").title == "Four again"
    assert _top(again, "rewritten lambda mu") == ["4"]
    assert "4" not in _top(again, "alpha4 beta4 gamma4", k=3)


@pytest.mark.parametrize("batch, status, named", [
    ([_new(1), Passage("new-2", "T", "  ")], 400, "documents[1] (id 'new-2'): the text is empty"),
    ([_new(1), _new(1)], 400, "documents[1]: the id 'new-1' is repeated in this batch"),
    ([_new(1), Passage("3", "T", "dup of a saved id")], 409, "documents[1]: a document with id '3' is present"),
    ([Passage("", "T", "no id")], 400, "documents[0]: the id must be a non-empty string"),
    ([], 400, "no documents to add"),
])
def test_a_bad_batch_is_refused_whole_naming_each_bad_document(tmp_path: Path, batch: list, status: int,
                                                                named: str) -> None:
    folder = _saved(tmp_path)
    live = LiveIndex.open(folder, HashEmbedder())
    live.add([_new(0)])
    before = sorted(os.listdir(folder / LIVE_DIR)), (folder / LIVE_DIR / LIVE_MANIFEST).read_text()
    with pytest.raises(DocumentError) as err:
        live.add(batch)
    assert err.value.status == status and named in str(err.value)
    assert len(live) == 61 and live.get("new-1") is None
    assert (sorted(os.listdir(folder / LIVE_DIR)), (folder / LIVE_DIR / LIVE_MANIFEST).read_text()) == before


def test_deleting_an_unknown_id_deletes_nothing(tmp_path: Path) -> None:
    live = LiveIndex.open(_saved(tmp_path), HashEmbedder())
    with pytest.raises(DocumentError) as err:
        live.delete(["3", "nope"])
    assert err.value.status == 404 and "no document with id 'nope'" in str(err.value)
    assert live.get("3") is not None and len(live) == 60


def test_segments_merge_as_a_binary_counter_and_stale_files_go(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    live = LiveIndex.open(folder, HashEmbedder())
    for i in range(11):
        live.add([_new(i)])
    manifest = json.loads((folder / LIVE_DIR / LIVE_MANIFEST).read_text())
    assert [s["n"] for s in manifest["segments"]] == [8, 2, 1]  # 11 = 0b1011
    files = sorted(os.listdir(folder / LIVE_DIR))
    assert files == sorted([LIVE_MANIFEST] + [f"{s['name']}{e}" for s in manifest["segments"]
                                              for e in (".arrow", ".npy")])
    again = LiveIndex.open(folder, HashEmbedder())
    assert [_top(again, f"zeta{i} omega{i} kappa{i}")[0] for i in range(11)] == [f"new-{i}" for i in range(11)]


def test_files_a_killed_add_left_are_ignored_and_removed(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    live = LiveIndex.open(folder, HashEmbedder())
    live.add([_new(0)])
    # what an add killed after writing its segment and before the manifest leaves behind
    (folder / LIVE_DIR / "segment-000099.arrow").write_bytes(b"half a shard")
    (folder / LIVE_DIR / f".{LIVE_MANIFEST}.tmp").write_text("{")
    again = LiveIndex.open(folder, HashEmbedder())
    assert len(again) == 61 and not (folder / LIVE_DIR / "segment-000099.arrow").exists()


def test_a_damaged_live_folder_is_refused_naming_it(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    live = LiveIndex.open(folder, HashEmbedder())
    live.add([_new(0)])
    (folder / LIVE_DIR / LIVE_MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="live.json is corrupt"):
        LiveIndex.open(folder, HashEmbedder())


def test_an_empty_index_is_created_and_filled(tmp_path: Path) -> None:
    live = LiveIndex.create(tmp_path / "new", HashEmbedder())
    assert len(live) == 0 and live.search("anything", 3) == []
    live.add([_new(1), _new(2)])
    assert _top(LiveIndex.open(tmp_path / "new", HashEmbedder()), "zeta2 omega2 kappa2") == ["new-2"]
    with pytest.raises(ValueError, match="holds an index already"):
        LiveIndex.create(tmp_path / "new", HashEmbedder())


def test_an_in_memory_index_takes_adds_without_a_folder() -> None:
    base = DenseRetriever(HashEmbedder())
    base.build(make_corpus(20))
    live = LiveIndex.in_memory(base)
    asyncio.run(live.aadd([_new(5)]))
    assert _top(live, "zeta5 omega5 kappa5") == ["new-5"]
    assert asyncio.run(live.asearch("zeta5 omega5 kappa5", 1))[0][0].id == "new-5"


def test_concurrent_adds_of_one_id_keep_exactly_one(tmp_path: Path) -> None:
    live = LiveIndex.open(_saved(tmp_path), HashEmbedder())
    results: list[object] = []

    def add(i: int) -> None:
        try:
            results.append(live.add([Passage("same", "T", f"variant {i}")]))
        except DocumentError as exc:
            results.append(exc.status)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(["same"]) == 1 and results.count(409) == 7
    assert len(live) == 61


def test_searches_during_adds_see_whole_batches(tmp_path: Path) -> None:
    """A batch's documents become visible together: a search never sees part of one."""
    live = LiveIndex.open(_saved(tmp_path), HashEmbedder())
    batches = [[Passage(f"b{j}-{i}", "T", f"batchword{j} item{i}") for i in range(4)] for j in range(15)]
    seen: list[int] = []
    stop = threading.Event()

    def search() -> None:
        while not stop.is_set():
            for j in range(15):
                hits = [p.id for p, _ in live.search(f"batchword{j}", 10) if p.id.startswith(f"b{j}-")]
                seen.append(len(hits))

    t = threading.Thread(target=search)
    t.start()
    for batch in batches:
        live.add(batch)
    stop.set()
    t.join()
    assert set(seen) <= {0, 4} and 4 in seen


def test_the_manifest_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails before it is on disk (a full disk, a kill before the flush) leaves the previous
    manifest whole: the new one is written beside it and renamed over it only once fsynced."""
    from orthrus_rag import atomic
    from orthrus_rag.retrievers import store

    path = tmp_path / "manifest.json"
    store.write_manifest(path, {"a": 1})

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        store.write_manifest(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["manifest.json"]


def test_query_vectors_of_another_width_are_refused(tmp_path: Path) -> None:
    live = LiveIndex.open(_saved(tmp_path), HashEmbedder())
    with pytest.raises(ValueError, match="dimension"):
        live._vectors([np.zeros(3)])
