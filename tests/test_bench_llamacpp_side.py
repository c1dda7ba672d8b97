"""The llama.cpp side of scripts/bench_engine.py without llama.cpp: quantization names, model files made once by
llama-quantize, the tools' commands and output parsing, the table's best-over-best ratio, and errors reported in the
row instead of ending the run. Fake tools (shell scripts printing what the real ones print) stand in for the build."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from scripts.peers import llamacpp_bench as lcb

pytestmark = pytest.mark.bench  # the llama.cpp peer side of the benchmarks, not the product: make test-bench

BENCH_JSON = [{"n_prompt": 256, "n_gen": 0, "avg_ts": 512.5, "stddev_ts": 3.0}]
BATCHED = "\n".join(json.dumps({"pp": 32, "tg": 64, "pl": b, "speed_pp": 900.0, "speed_tg": 40.0 * b})
                    for b in (1, 8))
WORKLOAD = {"sections": ["prefill", "decode"], "batches": [1, 8], "prefill_len": 256, "decode_prompt_len": 32,
            "decode_tokens": 64}


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "calls.log"
    _tool(folder, "llama-bench", f"echo \"$@\" >> {log}\ncat <<'EOF'\n{json.dumps(BENCH_JSON)}\nEOF\n")
    _tool(folder, "llama-batched-bench", f"echo \"$@\" >> {log}\necho 'main: loading'\ncat <<'EOF'\n{BATCHED}\nEOF\n")
    # llama-quantize SRC DST TYPE (after --allow-requantize): writes DST, as the real one does
    _tool(folder, "llama-quantize", f"echo quantize \"$@\" >> {log}\nprintf '%s' \"$4\" > \"$3\"\n")
    return folder


def test_quantization_names():
    assert lcb.parse_quants("bf16,Q8_0,q4_k_m,Q8_0") == ["BF16", "Q8_0", "Q4_K_M"]
    with pytest.raises(ValueError, match="unknown llama.cpp quantization 'Q3'"):
        lcb.parse_quants("Q3")
    with pytest.raises(ValueError, match="no llama.cpp quantization"):
        lcb.parse_quants(" , ")
    assert lcb.file_quant("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert lcb.file_quant("model-q4_k_m.gguf") == "Q4_K_M"
    assert lcb.file_quant("model.BF16.gguf") == "BF16"
    assert lcb.file_quant("model.gguf") is None


def test_measure_runs_the_tools_pinned_and_makes_each_file_once(tools: Path, tmp_path: Path):
    source = tmp_path / "Smol.Q4_1.gguf"
    source.write_text("q4_1 weights")
    shipped = lcb.measure(tools, source, "Q4_1", WORKLOAD, [0])
    assert shipped["error"] is None
    assert shipped["results"] == {"prefill_tok_s": 512.5, "decode_tok_s_b1": 40.0, "decode_tok_s_b8": 320.0}
    assert shipped["meta"]["file"] == "Smol.Q4_1.gguf"  # the source itself: no requantizing
    q8 = lcb.measure(tools, source, "Q8_0", WORKLOAD, [0])
    assert q8["meta"]["file"] == "Smol.Q8_0.gguf" and (tools.parent / "models" / "Smol.Q8_0.gguf").read_text() == "Q8_0"
    lcb.measure(tools, source, "Q8_0", WORKLOAD, [0])
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert sum(c.startswith("quantize --allow-requantize") for c in calls) == 1  # made once, then reused
    decode = next(c for c in calls if "-npp" in c).split()
    assert decode[decode.index("-t") + 1] == "1" and decode[decode.index("-npl") + 1] == "1,8"
    assert int(decode[decode.index("-c") + 1]) >= 8 * (32 + 64)
    prefill = next(c for c in calls if "-p 256" in c).split()
    assert prefill[prefill.index("-n") + 1] == "0"


def test_a_failing_tool_is_an_error_in_its_row(tools: Path, tmp_path: Path):
    _tool(tools, "llama-bench", "echo 'Illegal instruction' >&2\nexit 132\n")
    source = tmp_path / "Smol.Q4_1.gguf"
    source.write_text("x")
    row = lcb.measure(tools, source, "Q4_1", WORKLOAD, [0])
    assert row["results"] == {} and "llama-bench exited 132" in row["error"] and "Illegal instruction" in row["error"]
    assert lcb.tools_problem(tmp_path) is not None and "make peers" in lcb.tools_problem(tmp_path)
    assert lcb.tools_problem(tools) is None


def test_table_gives_best_over_best():
    engine = {"none": {"decode_tok_s_b1": 30.0, "prefill_tok_s": 2400.0},
              "int4": {"decode_tok_s_b1": 75.0, "prefill_tok_s": 350.0}}
    llama = {"BF16": {"results": {"decode_tok_s_b1": 60.0, "prefill_tok_s": 600.0}, "meta": {"file": "a",
                                                                                              "file_bytes": 2**20}},
             "Q4_1": {"results": {}, "meta": {}, "error": "RuntimeError: boom"}}
    table = lcb.format_table(engine, llama)
    assert "| decode_tok_s_b1 | 30.0 | 75.0 | 60.0 | error | 1.25x |" in table
    assert "| prefill_tok_s | 2,400.0 | 350.0 | 600.0 | error | 4.00x |" in table
    assert "llama.cpp Q4_1: ERROR RuntimeError: boom" in table
