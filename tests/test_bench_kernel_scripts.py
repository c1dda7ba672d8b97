"""scripts/bench_layer_chain.py and the elementwise inputs of scripts/bench_cpu_kernels.py: what they time is what
they say (every row reported, per-op times inside the total; rotary's inputs stay finite however often it runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.cpu_extension import kernels

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.bench,  # tests benchmark scripts, not the product (make test-bench)
              pytest.mark.skipif(kernels() is None, reason="the CPU extension cannot be built here")]


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()  # NOTE: the scripts set torch's threads for the whole process
    yield
    torch.set_num_threads(before)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layer_chain_reports_each_row_with_its_ops_inside_the_total():
    # fp32: oneDNN packs it on every x86 CPU (bf16 products need AVX-512; the script refuses bf16 without it)
    results = _script("bench_layer_chain").main(["--threads", "1", "--rows", "8", "--layers", "2", "--reps", "1",
                                                 "--dtype", "float32"])
    rows = {r["row"]: r for r in results}
    assert list(rows) == ["gemms alone", "elementwise alone", "chain", "chain without rotary", "chain without norms",
                          "chain without silu_mul"]
    assert set(rows["chain"]["ops_ms"]) == {"qkv product", "rotary", "o product", "add+norm", "gate/up product",
                                            "silu_mul", "down product"}
    assert "rotary" not in rows["chain without rotary"]["ops_ms"]
    assert "silu_mul" not in rows["chain without silu_mul"]["ops_ms"]
    assert "add+norm" not in rows["chain without norms"]["ops_ms"]
    assert rows["gemms alone"]["elementwise_ms"] == 0 and rows["elementwise alone"]["products_ms"] == 0
    for r in results:  # the timed ops ran inside the timed loop
        assert 0 < r["products_ms"] + r["elementwise_ms"] <= r["ms"] * 1.01


def test_the_elementwise_benchmarks_rotary_keeps_its_inputs_finite():
    # random cos / sin inputs grew q to inf and NaN within ~100 in-place calls, and timed NaNs
    bench = _script("bench_cpu_kernels")
    cos, sin = bench._rotation(64, torch.bfloat16)
    q = torch.randn(64, 9, 64).to(torch.bfloat16)
    norm = q.float().norm()
    for _ in range(300):
        cpu_elementwise.rotary(q, cos, sin)
    assert torch.isfinite(q).all()
    assert abs(q.float().norm() / norm - 1) < 0.25  # a rotation, up to 300 bf16 roundings (~7% here)


def test_the_layer_split_bench_times_both_forms_on_the_split_it_claims(smol_path):
    # fp32 packed on oneDNN: every x86 CPU runs it (the split form needs packed weights)
    results = _script("bench_layer_split").main(["--rows", "16", "20", "--decodes", "4", "--context", "40",
                                                 "--chunk-context", "24", "--python-loop", "--fp32-reference",
                                                 "--dtype", "float32", "--linear-kernel", "onednn", "--rounds",
                                                 "1", "--reps", "1"])
    assert [r["rows"] for r in results] == [16, 20]
    for r in results:
        assert len(r["whole_ms"]) == len(r["split_ms"]) == len(r["python_ms"]) == 1
        assert min(r["whole_ms"] + r["split_ms"] + r["python_ms"]) > 0
        assert r["dtype"] == "float32" and r["max_abs_diff"] < 1e-3 and r["chunk_context"] == 24
        assert r["python_equals_whole"]  # the C++ loop is the Python loop's result, bit for bit
        assert r["whole_rel_err_vs_fp32"] == 0 and r["split_rel_err_vs_fp32"] < 1e-5  # fp32 against itself
