"""scripts/bench_quality.py: the perplexity is llama-perplexity's (each chunk's second half, given its first), the
greedy agreement counts what it says, and a run without peers writes its table, results and plot."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench  # tests a measuring script, not the product (make test-bench)


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("bench_quality_script", ROOT / "scripts" / "bench_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_perplexity_scores_each_chunks_second_half(quality):
    ctx = 8  # positions 5, 6, 7 are scored (first = 4; llama-perplexity scores first + 1 .. ctx - 1)
    chunk = [None, -9.0, -9.0, -9.0, -9.0, -1.0, -2.0, -3.0]
    assert quality.perplexity([chunk, chunk], ctx) == pytest.approx(math.exp(2.0))


def test_agreement_counts_identical_outputs_and_common_prefixes(quality):
    got = quality.agreement([[1, 2, 3], [1, 9, 3], [7, 2, 3]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert got == {"identical": pytest.approx(1 / 3), "mean_common_prefix": pytest.approx((3 + 1 + 0) / 3)}


@pytest.mark.slow
def test_a_run_writes_its_table_results_and_plot(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Sentence {i} says that the river runs past mill number {i}." for i in range(200)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_quality.py"), "--text", str(text),
                           "--quantizations", "none", "int8", "--ctx", "64", "--chunks", "2", "--prompts", "2",
                           "--tokens", "4", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())["results"]["engine"]
    assert results["none"]["identical"] == 1.0 and 1.0 < results["none"]["perplexity"] < 1000
    assert results["int8"]["perplexity"] != results["none"]["perplexity"]
    assert "| orthrus_rag | int8 |" in (out / "table.md").read_text() and (out / "quality.png").is_file()
