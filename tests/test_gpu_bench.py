"""scripts/gpu_bench.py end to end on the CPU at a tiny shape: every section runs and the table is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run_on_cpu(tmp_path, smol_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--device", "cpu", "--shape", "tiny", "--tokenizer", str(smol_path), "--kv-cache-gib",
                         "0.02", "--budget", "256", "--decode-batch", "4", "--prompt-len", "16", "--new-tokens", "8",
                         "--embed-count", "8", "--embed-len", "32", "--mixed-generations", "4",
                         "--mixed-embeddings", "8", "--policies", "orthrus", "hetero-fcfs", "--out", str(tmp_path)])
    rows = result["results"]
    parity = [r for r in rows if r["section"] == "parity"]
    assert {r["budget"] for r in parity} == {64, 4096}
    assert all(r["tokens_identical_frac"] == 1.0 for r in parity if "tokens_identical_frac" in r)
    assert all(r["embedding_cosine_min"] > 0.9999 for r in parity if "embedding_cosine_min" in r)
    systems = {(r["section"], r.get("system")) for r in rows}
    assert {("decode", "orthrus_rag"), ("decode", "transformers"), ("embed", "orthrus_rag"),
            ("embed", "transformers"), ("mixed", "orthrus"), ("mixed", "hetero-fcfs"),
            ("mixed", "apart (same engine)"), ("mixed", "transformers (generate, then embed)"),
            ("mixed", "dedicated (two processes, one device)")} <= systems
    assert all(r["tok_s"] > 0 for r in rows if r["section"] == "decode")
    assert json.loads((tmp_path / "results.json").read_text())["env"]["device"] == "cpu"
    table = (tmp_path / "table.md").read_text()
    assert "| decode | transformers |" in table and "| mixed | orthrus |" in table
