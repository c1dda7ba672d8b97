"""scripts/bench_ingest.py (the ingest-while-serving benchmark): its window-rate arithmetic and ratios without
a model, and the whole script at a tiny scale (a dozen passages, a 2-second window) on the real models, asserting
that its JSON holds every row and every figure. Figures are timings and are not asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # tests the ingest benchmark script, not the product: make test-bench runs these

ROOT = Path(__file__).resolve().parents[1]
TINY = ["workload.words=8", "workload.max_tokens=4", "scheduler.max_num_batched_tokens=64",
        "scheduler.max_chunk_tokens=32", "cache.num_blocks=256", "threads.inproc=1", "threads.split=[1,1]"]
ROW_NAMES = ["idle ingest", "serving", "serving + ingest", "dedicated + ingest"]


@pytest.fixture(scope="module")
def bench_ingest():
    spec = importlib.util.spec_from_file_location("bench_ingest", ROOT / "scripts" / "bench_ingest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ingest"] = module  # NOTE: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_window_rate_interpolates_between_finished_batches(bench_ingest):
    log = bench_ingest.IngestLog(0.0, [(2.0, 100), (4.0, 100), (6.0, 100)])
    assert log.rate(2.0, 6.0) == pytest.approx(50.0)
    assert log.rate(1.0, 3.0) == pytest.approx(50.0)  # half of each batch's passages on either side
    assert log.rate(0.0, 10.0) == pytest.approx(30.0)  # unfinished: nothing more landed after 6 s
    log.finished = True
    assert log.rate(0.0, 10.0) == pytest.approx(50.0)  # finished at 6 s: measured up to its end
    assert log.rate(7.0, 10.0) is None  # finished before the window began
    assert bench_ingest.IngestLog(0.0).rate(0.0, 5.0) == 0.0


def test_a_row_is_compared_with_its_own_systems_baselines_when_they_ran(bench_ingest):
    def row(name, system, serves, ingests, p95=None, rate=None):
        r = {"name": name, "system": system, "serves": serves, "ingests": ingests}
        if serves:
            r["serving"] = {"kinds": {k: {"p95_s": p95, "throughput_rps": 10.0} for k in ("embed", "generate")}}
        if ingests:
            r["ingest"] = {"passages_per_s": rate}
        return r

    rows = [row("idle ingest", "orthrus", False, True, rate=100.0), row("serving", "orthrus", True, False, p95=1.0),
            row("serving + ingest", "orthrus", True, True, p95=1.05, rate=60.0),
            row("dedicated + ingest", "dedicated", True, True, p95=2.0, rate=40.0),
            row("dedicated idle ingest", "dedicated", False, True, rate=50.0)]
    bench_ingest.compare(rows)
    assert rows[2]["vs"]["embed_p95_s"] == pytest.approx(1.05) and rows[2]["vs"]["ingest"] == pytest.approx(0.6)
    assert rows[2]["vs"]["goal_met"] is True
    assert rows[3]["vs"]["serving_baseline"] == "serving"  # no dedicated serving row: the in-process one
    assert rows[3]["vs"]["ingest_baseline"] == "dedicated idle ingest"
    assert rows[3]["vs"]["ingest"] == pytest.approx(0.8) and rows[3]["vs"]["goal_met"] is False
    assert "vs" not in rows[0] and "vs" not in rows[1]
    table = bench_ingest.table(rows)
    assert len(table.splitlines()) == 2 + len(rows) and "| met |" in table and "| missed |" in table


def test_rows_runs_only_the_named_rows_in_their_order_and_refuses_an_unknown_one(bench_ingest, tmp_path,
                                                                                   monkeypatch, capsys):
    ran = []

    def fake_row(row, cfg, args, passages):  # NOTE: no engine: which rows run, and with how many passages
        ran.append((row.name, len(passages)))
        out = {"serving": {"kinds": {k: {"p50_s": 1.0, "p95_s": 2.0, "throughput_rps": 3.0}
                                     for k in ("embed", "generate")}}} if row.serves else {}
        return {**bench_ingest.asdict(row), **out, **({"ingest": {"passages_per_s": 5.0}} if row.ingests else {})}

    monkeypatch.setattr(bench_ingest, "run_row", fake_row)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"passage {i}"}) + "\n" for i in range(6)))
    base = ["--corpus", str(corpus), "--count", "4", "--idle-count", "2", "--out", str(tmp_path / "r.json"),
            "--scratch", str(tmp_path / "scratch")]
    assert bench_ingest.main(base + ["--rows", "serving + ingest", "idle ingest", "serving + ingest"]) == 0
    assert ran == [("serving + ingest", 4), ("idle ingest", 2)]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["serving + ingest", "idle ingest"]
    assert rows[0]["vs"]["ingest"] == pytest.approx(1.0) and rows[0]["vs"]["serving_baseline"] is None
    with pytest.raises(SystemExit):
        bench_ingest.main(base + ["--rows", "serving", "ingest only"])
    assert "no row named 'ingest only'" in capsys.readouterr().err


@pytest.mark.slow  # builds engines and a dedicated deployment (make test-fast skips it)
def test_the_script_writes_every_row_and_figure(bench_ingest, tmp_path, capsys):
    from orthrus_rag.data.generated_corpus import generate_passages

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.id, "contents": p.contents}) + "\n"
                              for p in generate_passages(12, 0, mean_words=30)))
    out = tmp_path / "results.json"
    args = ["--corpus", str(corpus), "--count", "10", "--batch-size", "4", "--window-s", "2", "--warmup-s", "0",
            "--clients", "2", "--ingest-timeout-s", "300", "--drain-timeout-s", "60", "--scratch",
            str(tmp_path / "scratch"), "--out", str(out)]
    for o in TINY:
        args += ["--override", o]
    assert bench_ingest.main(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["machine"]["isa"]) >= {"avx512f", "avx512_bf16", "amx_bf16"} and doc["machine"]["cpu_model"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ROW_NAMES
    assert not any("error" in r for r in rows.values())
    for r in rows.values():
        if r["serves"]:
            for kind in ("embed", "generate"):
                figures = r["serving"]["kinds"][kind]
                assert figures["completed"] > 0 and figures["errors"] == 0
                assert figures["throughput_rps"] > 0 and all(math.isfinite(figures[m]) for m in ("p50_s", "p95_s"))
        if r["ingests"]:
            ing = r["ingest"]
            assert ing["added"] == 10 and ing["finished"] and ing["error"] is None and ing["total_s"] > 0
            assert ing["passages_per_s"] is None or ing["passages_per_s"] > 0  # None: it finished in the warm-up
    for name in ("serving + ingest", "dedicated + ingest"):
        vs = rows[name]["vs"]
        assert vs["serving_baseline"] == "serving" and vs["ingest_baseline"] == "idle ingest"
        assert {"embed_p95_s", "generate_p95_s", "embed_throughput_rps", "generate_throughput_rps", "ingest",
                "goal_met"} <= set(vs)
    printed = capsys.readouterr().out
    assert "avx512_bf16=" in printed and all(f"| {name} |" in printed for name in ROW_NAMES)
    assert not any((tmp_path / "scratch").iterdir())  # each row's index removed
