"""The vLLM side of scripts/bench_engine.py without vLLM: variants, the decode-rate arithmetic, the child's
environment and result line, the table and its ratio column, and the clear message when vLLM is missing."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from scripts.peers import vllm_core_bench as vcb

pytestmark = pytest.mark.bench  # the vLLM peer side of the benchmarks, not the product: make test-bench


def test_variants_parse_and_combine() -> None:
    assert vcb.parse_variants("default,eager,fp32") == ["default", "eager", "fp32"]
    assert vcb.parse_variants(["default", "eager,default"]) == ["default", "eager"]  # order kept, no repeats
    assert vcb.variant_kwargs("default") == {}
    assert vcb.variant_kwargs("fp32+eager") == {"dtype": "float32", "enforce_eager": True}
    assert vcb.variant_kwargs("bf16") == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match="unknown vLLM variant 'fast'"):
        vcb.parse_variants("default,fast")
    with pytest.raises(ValueError, match="no vLLM variant"):
        vcb.parse_variants(" , ")


def test_decode_rate_subtracts_the_one_token_run() -> None:
    # 32 sequences x 63 decode tokens in 3.0 s - 0.48 s (the 1-token run: prefill + first token)
    assert vcb.decode_rate(32, 64, 3.0, 0.48) == pytest.approx(32 * 63 / 2.52)
    assert vcb.decode_rate(1, 2, 1.0, 1.0) > 1e6  # no division by zero
    with pytest.raises(ValueError):
        vcb.decode_rate(1, 1, 1.0, 0.5)


def test_cpus() -> None:
    assert vcb.parse_cpus("0") == [0]
    assert vcb.parse_cpus("0,2-4") == [0, 2, 3, 4]
    assert vcb.cpus_spec([0, 3]) == "0,3"
    assert vcb.default_cpus(1, [3, 1, 2]) == [1]
    assert vcb.default_cpus(2, [3, 1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="only 1 CPUs"):
        vcb.default_cpus(2, [0])


def test_child_env(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env = vcb.child_env([0], 2, tmp_path / "work", venv, base={"OMP_NUM_THREADS": "8", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert "OMP_NUM_THREADS" not in env and env["PATH"] == "/bin"
    assert env["LD_PRELOAD"].split(":")[-1] == str(venv / "lib" / "libiomp5.so")
    assert Path(env["VLLM_CACHE_ROOT"]).is_dir() and Path(env["VLLM_RPC_BASE_PATH"]).is_dir()
    assert "VLLM_LOGGING_LEVEL" not in vcb.child_env([0, 1], 0.5, tmp_path / "w2", venv, verbose=True, base={})


def test_parse_result_finds_the_json_line_among_logs() -> None:
    line = json.dumps({vcb.RESULT_KEY: 1, "variant": "default", "results": {"prefill_tok_s": 1.0}, "error": None})
    out = "INFO loading\n{not json\n" + line + "\n{\"other\": 1}\n"
    assert vcb.parse_result(out)["results"] == {"prefill_tok_s": 1.0}
    assert vcb.parse_result("INFO nothing here\n") is None


OURS = {"prefill_tok_s": 1200.0, "decode_tok_s_b1": 40.0, "decode_tok_s_b32": 800.0, "embed_per_s": 30.0}


def test_table_without_peers_is_the_original() -> None:
    table = vcb.format_table({"prefill_tok_s": 10.0, "embed_per_s": 2.0}, {"prefill_tok_s": 5.0})
    assert table.splitlines() == ["| metric | orthrus_rag | transformers | ratio |", "|---|---:|---:|---:|",
                                  "| prefill_tok_s | 10.0 | 5.0 | 2.00x |", "| embed_per_s | 2.0 | – | – |"]


def test_table_with_vllm_columns_and_ratio() -> None:
    peers = {
        "default": {"results": {"prefill_tok_s": 1600.0, "decode_tok_s_b1": 80.0, "decode_tok_s_b32": 800.0,
                                "embed_per_s": 60.0},
                    "meta": {"llm_kwargs": {}, "vllm_version": "0.32.0",
                             "generate": {"dtype": "bfloat16", "compilation": "DYNAMO_TRACE_ONCE (inductor)",
                                          "load_s": 70.0, "warmup_s": 1.0}},
                    "error": None},
        "fp32": {"results": {}, "meta": {}, "error": "RuntimeError: boom"},
    }
    lines = vcb.format_table(OURS, {}, peers).splitlines()
    assert lines[0] == "| metric | orthrus_rag | vllm default | vllm fp32 | orthrus / vllm default |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| prefill tok/s | 1,200.0 | 1,600.0 | error | 0.75x |"
    assert lines[3] == "| decode tok/s, batch 1 | 40.0 | 80.0 | error | 0.50x |"
    assert lines[4] == "| decode tok/s, batch 32 | 800.0 | 800.0 | error | 1.00x |"
    assert lines[5] == "| embeddings/s | 30.0 | 60.0 | error | 0.50x |"
    notes = "\n".join(lines[6:])
    assert "vllm default: LLM kwargs {}; generate: dtype bfloat16" in notes
    assert "vllm fp32: ERROR RuntimeError: boom" in notes


def test_table_with_transformers_and_a_missing_metric() -> None:
    peers = {"default": {"results": {"prefill_tok_s": 600.0}, "meta": {}, "error": None}}
    lines = vcb.format_table({"prefill_tok_s": 1200.0, "embed_per_s": 3.0}, {"prefill_tok_s": 400.0},
                             peers).splitlines()
    assert lines[0] == ("| metric | orthrus_rag | transformers | orthrus / transformers | vllm default | "
                        "orthrus / vllm default |")
    assert lines[2] == "| prefill tok/s | 1,200.0 | 400.0 | 3.00x | 600.0 | 2.00x |"
    assert lines[3] == "| embeddings/s | 3.0 | – | – | – | – |"


def _fake_python(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "venv" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_missing_vllm_is_a_message(tmp_path: Path) -> None:
    assert "does not exist" in vcb.peer_python_problem(tmp_path / "nope" / "python")
    assert "vllm is not installed" in vcb.peer_python_problem(_fake_python(tmp_path, "exit 3"))
    # the child itself, run without vllm, reports it in its result line
    problem = vcb.peer_python_problem(sys.executable)
    if problem is not None:  # this venv has no vllm (CI)
        assert "vllm is not installed" in problem


def test_run_variant_reads_the_child_line(tmp_path: Path) -> None:
    line = json.dumps({vcb.RESULT_KEY: 1, "variant": "eager", "results": {"embed_per_s": 5.0},
                       "meta": {"llm_kwargs": {"enforce_eager": True}}, "error": None})
    exe = _fake_python(tmp_path, "echo 'INFO log line'\necho '" + line + "'")
    res = vcb.run_variant(exe, {"model": "m"}, "eager", [0], timeout_s=30)
    assert res["error"] is None and res["results"] == {"embed_per_s": 5.0} and res["meta"]["wall_s"] >= 0
    silent = _fake_python(tmp_path / "b", "echo crashed; exit 1")
    res = vcb.run_variant(silent, {}, "default", [0], timeout_s=30)
    assert "exited 1 without a result" in res["error"] and res["results"] == {}


def test_bench_engine_refuses_early_without_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    be = pytest.importorskip("scripts.bench_engine")
    args = be.build_parser().parse_args(["--peers", "vllm", "--peer-variants", "default,fp32+eager", "--threads", "1"])
    assert args.peers == ["vllm"] and args.peer_variants == ["default", "fp32+eager"]
    assert be.build_parser().parse_args([]).peers == []
    with pytest.raises(SystemExit):
        be.build_parser().parse_args(["--peer-variants", "turbo"])
    affinity = os.sched_getaffinity(0)
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--threads", "1", "--peers", "vllm", "--peers-python",
                                      str(tmp_path / "missing" / "python"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="error: --peers vllm: .*does not exist"):
        be.main()  # before any engine is built or the process pinned
    assert os.sched_getaffinity(0) == affinity


def test_table_with_a_second_engine_run_takes_the_mean() -> None:
    """`--again`: the engine's run after the peers has its own column; the ratio is of the two runs' mean."""
    peers = {"default": {"results": {"prefill_tok_s": 1000.0, "embed_per_s": 10.0}, "meta": {}, "error": None}}
    lines = vcb.format_table({"prefill_tok_s": 900.0, "embed_per_s": 12.0}, {}, peers,
                             again={"prefill_tok_s": 1300.0, "embed_per_s": 8.0}).splitlines()
    assert lines[0] == ("| metric | orthrus_rag | orthrus_rag, after the peers | vllm default | "
                        "orthrus (mean of both runs) / vllm default |")
    assert lines[2] == "| prefill tok/s | 900.0 | 1,300.0 | 1,000.0 | 1.10x |"
    assert lines[3] == "| embeddings/s | 12.0 | 8.0 | 10.0 | 1.00x |"


def _dies(pid: int, within_s: float = 10.0) -> bool:
    """The process is gone (or a zombie nobody reaped) within `within_s`: SIGKILL lands asynchronously."""
    import time

    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_child_and_the_processes_it_started_die_with_it(tmp_path: Path) -> None:
    """vLLM's EngineCore and workers are the child's children: a timeout, or the end of the child, takes the whole
    process group (a plain subprocess timeout left them holding cores)."""
    import subprocess

    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            f" open({str(pid_file)!r}, 'w').write(str(p.pid)); print('ready', flush=True); time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        vcb.run_group([sys.executable, "-c", code], dict(os.environ), timeout_s=5)
    grandchild = int(pid_file.read_text())
    assert _dies(grandchild)
    # a child that exits on its own: its output and status come back, and what it left running dies too
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            f" open({str(pid_file)!r}, 'w').write(str(p.pid)); print('done')")
    assert vcb.run_group([sys.executable, "-c", code], dict(os.environ), timeout_s=30) == (0, "done\n")
    grandchild = int(pid_file.read_text())
    assert _dies(grandchild)
