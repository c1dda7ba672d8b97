"""scripts/gpu_bench.py end to end on the CPU at a tiny shape: every section runs, compares its outputs and the
table is written; a failed comparison makes the script exit non-zero."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--shape", "tiny", "--kv-cache-gib", "0.02", "--budget", "256", "--decode-batch", "4",
        "--prompt-len", "16", "--new-tokens", "8", "--embed-count", "8", "--embed-len", "32",
        "--mixed-generations", "4", "--mixed-embeddings", "8", "--policies", "orthrus", "hetero-fcfs"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench():
    return _load("gpu_bench")


def test_gpu_bench_dry_run_on_cpu(bench, tmp_path, smol_path):
    result = bench.main(TINY + ["--tokenizer", str(smol_path), "--out", str(tmp_path)])
    rows = result["results"]
    parity = [r for r in rows if r["section"] == "parity" and "check" not in r]
    assert {r["budget"] for r in parity} == {64, 4096}
    assert all(r["tokens_identical_frac"] == 1.0 for r in parity if "tokens_identical_frac" in r)
    assert all(r["embedding_cosine_min"] > 0.9999 for r in parity if "embedding_cosine_min" in r)
    systems = {(r["section"], r.get("system")) for r in rows}
    assert {("decode", "orthrus_rag"), ("decode", "transformers"), ("embed", "orthrus_rag"),
            ("embed", "transformers"), ("mixed", "orthrus"), ("mixed", "hetero-fcfs"),
            ("mixed", "apart (same engine)"), ("mixed", "transformers (generate, then embed)"),
            ("mixed", "dedicated (two processes, one device)")} <= systems
    assert all(r["tok_s"] > 0 for r in rows if r["section"] == "decode" and "tok_s" in r)
    checks = [r for r in rows if "check" in r]
    # every section compares outputs: tokens and embeddings in parity and mixed (each policy and dedicated)
    assert {r["section"] for r in checks} == {"parity", "decode", "embed", "mixed"}
    mixed = [r["check"] for r in checks if r["section"] == "mixed"]
    assert {m.split(":")[0] for m in mixed} == {"orthrus", "hetero-fcfs", "dedicated"} and len(mixed) == 6
    assert all(r["passed"] for r in checks) and result["failures"] == []
    assert json.loads((tmp_path / "results.json").read_text())["env"]["device"] == "cpu"
    table = (tmp_path / "table.md").read_text()
    assert "| decode | transformers |" in table and "| mixed | orthrus |" in table


def test_a_failed_parity_check_exits_non_zero(bench, tmp_path, smol_path, monkeypatch):
    real = bench.hf_greedy

    def wrong(hf, prompt, new, dev):  # a reference that disagrees from the first token on
        return [(t + 1) % hf.config.vocab_size for t in real(hf, prompt, new, dev)]

    monkeypatch.setattr(bench, "hf_greedy", wrong)
    status = bench.cli(TINY + ["--sections", "parity", "--tokenizer", str(smol_path), "--out", str(tmp_path)])
    assert status == 1
    failures = json.loads((tmp_path / "results.json").read_text())["failures"]
    assert len(failures) == 2 and all("greedy" in f for f in failures)  # budgets 64 and 4,096; embeddings pass


class _Judge:
    """A transformers stand-in whose next-token logits are fixed: token 1 leads token 2 by `gap`."""

    config = SimpleNamespace(vocab_size=8)

    def __init__(self, gap: float, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.logits = torch.tensor([0.0, 5.0, 5.0 - gap, 1.0, 0.0, -1.0, 0.0, 2.0])

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits.expand(1, ids.shape[1], -1))


def test_a_divergence_passes_only_at_a_near_tie(bench):
    cpu = torch.device("cpu")
    assert bench.divergence(_Judge(5e-4), [3], [4, 2, 0], [4, 1, 5], cpu) is None  # fp32: within 1e-3
    assert "logit gap" in bench.divergence(_Judge(0.5), [3], [4, 2, 0], [4, 1, 5], cpu)
    assert "logit gap" in bench.divergence(_Judge(5e-4), [3], [4, 7], [4, 1], cpu)  # 7 is not in the top-2
    std = float(_Judge(0.0).logits.std())
    assert bench.divergence(_Judge(0.05 * std, torch.bfloat16), [3], [2], [1], cpu) is None  # bf16: relative
    assert bench.divergence(_Judge(0.2 * std, torch.bfloat16), [3], [2], [1], cpu) is not None
    assert bench.divergence(_Judge(1.0), [3], [4, 1], [4, 1, 5], cpu) == "lengths 2 vs 3"
    bench.FAILURES.clear()
    assert not bench.compare_embeddings("embed", "x", [torch.tensor([1.0, 0.0])], [torch.tensor([0.0, 1.0])], 0.999)
    assert bench.FAILURES and bench.compare_embeddings("embed", "y", [torch.ones(3)], [2 * torch.ones(3)], 0.999)


def test_gpu_ingest_dry_run_on_cpu(tmp_path, smol_path):
    """scripts/gpu_ingest.py (the ingest-while-serving table on a GPU) at a tiny shape: each row carries only its own
    traffic, the bulk ingest runs beside serving, and the ratios and files are written."""
    ingest = _load("gpu_ingest")
    result = ingest.main(["--device", "cpu", "--shape", "tiny", "--kv-cache-gib", "0.02", "--budget", "256",
                          "--clients", "4", "--ingest-window", "4", "--query-len", "16", "--prompt-len", "16",
                          "--new-tokens", "4", "--passage-len", "32", "--warmup-s", "0.5", "--window-s", "1.5",
                          "--tokenizer", str(smol_path), "--out", str(tmp_path)])
    rows = result["rows"]
    assert set(rows["idle ingest"]) & {"embed", "generate"} == set() and rows["idle ingest"]["ingest"]["per_s"] > 0
    assert "ingest" not in rows["serving"] and all(rows["serving"][k]["per_s"] > 0 for k in ("embed", "generate"))
    both = rows["serving + ingest"]
    assert all(both[k]["per_s"] > 0 for k in ("embed", "generate", "ingest"))
    r = result["ratios"]
    assert r["ingest_x_idle"] == both["ingest"]["per_s"] / rows["idle ingest"]["ingest"]["per_s"]
    assert r["generate_p95_x"] == both["generate"]["p95_s"] / rows["serving"]["generate"]["p95_s"]
    assert json.loads((tmp_path / "results.json").read_text())["env"]["device"] == "cpu"
    assert "| serving + ingest |" in (tmp_path / "table.md").read_text()


def test_gpu_ingest_goal_needs_both_p95s_and_the_ingest_rate():
    ingest = _load("gpu_ingest")

    def rows(p95: float, rate: float) -> dict:
        kind = {"per_s": 10.0, "p50_s": 0.1, "p95_s": 0.2}
        return {"idle ingest": {"ingest": {"per_s": 100.0, "p50_s": 1, "p95_s": 1}},
                "serving": {"embed": kind, "generate": kind},
                "serving + ingest": {"embed": kind, "generate": {**kind, "p95_s": 0.2 * p95},
                                     "ingest": {"per_s": rate, "p50_s": 1, "p95_s": 1}}}

    assert ingest.ratios(rows(1.05, 60.0))["goal_met"]
    assert not ingest.ratios(rows(1.2, 60.0))["goal_met"]  # a kind's p95 past 1.1x
    assert not ingest.ratios(rows(1.0, 40.0))["goal_met"]  # ingest under half the idle rate
    starved = rows(1.0, 60.0)
    del starved["serving + ingest"]["embed"]  # no embedding finished beside the ingest
    assert not ingest.ratios(starved)["goal_met"]
