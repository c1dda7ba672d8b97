"""scripts/profiling.py: what each command times is what it says. `step`: the profiled steps carry the requested
mix and the report adds up; `kernels`: the elementwise inputs stay finite however often rotary runs; `layer-split`:
both forms timed, on the split it claims."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.cpu_extension import kernels

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench  # tests a profiling script, not the product (make test-bench)
needs_extension = pytest.mark.skipif(kernels() is None, reason="the CPU extension cannot be built here")


@pytest.fixture(scope="module")
def profiling():
    spec = importlib.util.spec_from_file_location("profiling_script", ROOT / "scripts" / "profiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()  # NOTE: the commands set torch's threads for the whole process
    yield
    torch.set_num_threads(before)


def test_step_reports_the_mix(profiling, smol_path):
    result = profiling.main(["step", "--model", str(smol_path), "--threads", "1", "--decodes", "3", "--prompt-len",
                             "8", "--embeds", "2", "--embed-len", "16", "--steps", "2", "--top", "3",
                             "--option", 'kernel_overrides={"decode_attention": "sdpa"}'])
    assert len(result["step_ms"]) == 2 and all(t > 0 for t in result["step_ms"])
    first = result["tokens_per_step"][0]
    assert first["decode"] == 3 and first["embed"] == 32  # both embeddings ride with the three decodes
    assert 0.0 < result["gemm_share"] < 1.0
    assert 0.0 < result["op_ms_per_step"] <= max(result["step_ms"])  # ops run inside the timed steps


@needs_extension
def test_the_kernels_rotary_keeps_its_inputs_finite(profiling):
    # random cos / sin inputs grew q to inf and NaN within ~100 in-place calls, and timed NaNs
    cos, sin = profiling._rotation(64, torch.bfloat16)
    q = torch.randn(64, 9, 64).to(torch.bfloat16)
    norm = q.float().norm()
    for _ in range(300):
        cpu_elementwise.rotary(q, cos, sin)
    assert torch.isfinite(q).all()
    assert abs(q.float().norm() / norm - 1) < 0.25  # a rotation, up to 300 bf16 roundings (~7% here)


@needs_extension
def test_layer_split_times_both_forms_on_the_split_it_claims(profiling, smol_path):
    # fp32 packed on oneDNN: every x86 CPU runs it (the split form needs packed weights)
    results = profiling.main(["layer-split", "--model", str(smol_path), "--rows", "16", "20", "--decodes", "4",
                              "--context", "40", "--chunk-context", "24", "--python-loop", "--fp32-reference",
                              "--dtype", "float32", "--linear-kernel", "onednn", "--rounds", "1", "--reps", "1"])
    assert [r["rows"] for r in results] == [16, 20]
    for r in results:
        assert len(r["whole_ms"]) == len(r["split_ms"]) == len(r["python_ms"]) == 1
        assert min(r["whole_ms"] + r["split_ms"] + r["python_ms"]) > 0
        assert r["dtype"] == "float32" and r["max_abs_diff"] < 1e-3 and r["chunk_context"] == 24
        assert r["python_equals_whole"]  # the C++ loop is the Python loop's result, bit for bit
        assert r["whole_rel_err_vs_fp32"] == 0 and r["split_rel_err_vs_fp32"] < 1e-5  # fp32 against itself


def test_memory_counts_each_form_of_the_weights(profiling):
    """`memory`: an int4 engine holds its linears quantized, no packed copies, and only the token embeddings and
    norms dense."""
    int4 = profiling.main(["memory", "--quantization", "int4"])
    assert int4["weights_quantized_mb"] > 50 and int4["weights_packed_copies_mb"] == 0
    assert int4["weights_dense_mb"] < 60  # the bf16 token embeddings, and norms
    assert int4["peak_mib"] >= int4["resident_after_load_mib"] > 0


def test_rss_sums_the_matching_processes_and_keeps_their_peak(profiling):
    """Two sleeping children that hold known memory: their sum, its peak once one has exited, and none of a pattern
    nothing matches."""
    import subprocess
    import sys

    # NOTE: every page written, so all of it is resident
    code = ("import sys, time; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096]); "
            "time.sleep(float(sys.argv[2]))")
    kids = [subprocess.Popen([sys.executable, "-c", code, str(mib), str(s), "rss-probe-marker"])
            for mib, s in ((64, 3.0), (32, 1.5))]
    try:
        out = profiling.main(["rss", "--match", "rss-probe-marker", "--match", "no-such-process-anywhere",
                              "--seconds", "2.5", "--interval", "0.2"])
    finally:
        for kid in kids:
            kid.kill()
    probe = out["rss-probe-marker"]
    assert probe["processes"] >= 1 and 96 <= probe["peak_mib"] < 96 + 2 * 60  # two interpreters of < 60 MiB each
    assert 64 <= probe["last_mib"] < probe["peak_mib"]  # the 32 MiB one exited first
    assert out["no-such-process-anywhere"] == {"peak_mib": 0.0, "last_mib": 0.0, "processes": 0}
