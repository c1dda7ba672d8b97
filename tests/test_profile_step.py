"""scripts/profile_step.py: the profiled steps carry the requested mix and the report adds up."""

from __future__ import annotations

import importlib.util
from pathlib import Path
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # builds engines; tests a profiling script (make test-bench)

ROOT = Path(__file__).resolve().parents[1]


def test_profile_step_reports_the_mix(smol_path):
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "scripts" / "profile_step.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main(["--model", str(smol_path), "--threads", "1", "--decodes", "3", "--prompt-len", "8",
                          "--embeds", "2", "--embed-len", "16", "--steps", "2", "--top", "3",
                          "--option", "cpu_decode_kernel=false"])
    assert len(result["step_ms"]) == 2 and all(t > 0 for t in result["step_ms"])
    first = result["tokens_per_step"][0]
    assert first["decode"] == 3 and first["embed"] == 32  # both embeddings ride with the three decodes
    assert 0.0 < result["gemm_share"] < 1.0
    assert 0.0 < result["op_ms_per_step"] <= max(result["step_ms"])  # ops run inside the timed steps
