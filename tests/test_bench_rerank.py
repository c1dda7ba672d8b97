"""The reranking benchmark's own parts: the settings it runs, the rows it reads from run summaries, its table and
its plot (the runs themselves are `orthrus-rag run`, tested elsewhere)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
pytestmark = pytest.mark.bench

import bench_rerank  # noqa: E402


def test_settings_compare_no_reranking_with_each_reranker():
    s = bench_rerank.settings(["backbone", "backbone+r"], 50, 5)
    assert s["none"] == ["retriever.k=5"]
    assert s["backbone+r"] == ["retriever.k=50", "pipeline.top_k=5", "model.rerankers=[backbone+r]",
                               "pipeline.reranker=default"]


def test_a_setting_loads_only_the_adapter_it_names():
    adapters = {"r": "+model.adapters.r=/a", "q": "+model.adapters.q=/b"}
    assert bench_rerank.loads("backbone+r", adapters) == ["+model.adapters.r=/a"]
    assert bench_rerank.loads("backbone", adapters) == bench_rerank.loads("none", adapters) == []


def test_rows_table_and_plot(tmp_path):
    summary = {"num_questions": 4, "throughput_qps": 2.0, "latency_s": {"p99": 1.5}, "retrieve_s": {"mean": 0.1},
               "wall_time_s": 2.0, "recall@5": 0.5, "em": 0.25, "f1": 0.4, "acc": 0.5}
    rows = [bench_rerank.row(s, m, summary) for s in ("none", "backbone") for m in ("standard", "iter_retgen")]
    assert rows[0]["recall@5"] == 0.5 and rows[0]["p99_s"] == 1.5
    assert "| standard | none | 0.500 | 0.250 | 0.400 | 0.500 | 2.000 | 1.50 |" in bench_rerank.table(rows)
    results = {"machine": "test CPU", "measured": "2026-01-01", "plots": ["rerank.png"], "results": {"rows": rows}}
    (png,) = bench_rerank.plot_results(results, tmp_path)
    assert png.is_file() and png.stat().st_size > 1000


def test_report_only_reads_the_finished_runs_back(tmp_path):
    import json

    summary = {"num_questions": 4, "throughput_qps": 2.0, "latency_s": {"p99": 1.5}, "wall_time_s": 2.0,
               "recall@5": 0.5, "em": 0.25, "f1": 0.4, "acc": 0.5}
    for name in ("none-standard", "backbone-standard"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "results" / "rerank.json"
    assert bench_rerank.main(["--questions", "unused.jsonl", "--work", str(tmp_path), "--report-only",
                              "--rerankers", "backbone", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["rows"]
    assert [(r["setting"], r["method"]) for r in rows] == [("none", "standard"), ("backbone", "standard")]
    assert (tmp_path / "img" / "rerank.png").stat().st_size > 1000
