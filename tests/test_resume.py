"""A real run (SmolLM2 + MiniLM on the synthetic set) killed with SIGKILL part-way and resumed ends with the same
records and summary as an uninterrupted run (timings aside)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from orthrus_rag import app
from tests.test_app_config import _compose
from tests.test_run_folder import _records, _strip

ROOT = Path(__file__).resolve().parents[1]
# NOTE: bit-identical runs: one question at a time (with several in flight, which questions share a step depends
# on where the run was cut), the linear kernel pinned (`auto` times both at load, so processes may pick
# differently) and steps sized by tokens, not by measured time; fp32 sums otherwise differ in the last bits
ARGS = ["experiment=smoke", "dataset.num_questions=4", "pipeline.max_tokens=8", "retriever.k=2",
        "pipeline.max_concurrency=1", "progress=false", "engine.max_num_batched_tokens=128", "checkpoint_every=2",
        "model.linear_kernel=dense", "engine.cost_budget=false"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "orthrus_rag.cli", "run", *args]


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def test_sigkill_then_resume_gives_the_records_and_summary_of_an_uninterrupted_run(tmp_path):
    killed = tmp_path / "killed"
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen(_cli(*ARGS, f"run_dir={killed}"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while _lines(killed / "records.jsonl") < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "log").read_text()[-2000:]
    assert 2 <= _lines(killed / "records.jsonl") < 4  # killed part-way
    out = subprocess.run(_cli(f"resume={killed}"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]

    whole = tmp_path / "whole"
    app.run(_compose(*ARGS, f"run_dir={whole}"))
    assert len(_records(killed)) == 4
    assert _strip(_records(killed)) == _strip(_records(whole))
    resumed, uninterrupted = (json.loads((d / "summary.json").read_text()) for d in (killed, whole))
    assert _strip(resumed) == _strip(uninterrupted)
    assert len(resumed["sessions"]) == 2 and resumed["sessions"][-1]["questions"] < 4
    assert "reusing the index" in out.stdout + out.stderr  # the first session's index, not a rebuilt one
