"""Every iterative method resumes: a run cut after some of its records, resumed, ends with the records
and summary of an uninterrupted run (timings aside), on the real small models. test_resume.py kills a run with
SIGKILL; the record store a resume reads is the same whatever the method, so here the cut is the records file
truncated to what a kill leaves (whole lines, no summary)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orthrus_rag.entrypoints import commands as app
from orthrus_rag.entrypoints.cli import main
from tests.test_app_config import _compose
from tests.test_resume import _same
from tests.test_run_folder import _records, _strip

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

# NOTE: as test_resume's: one question at a time, the linear kernel pinned, steps sized by tokens and no prefix
# cache (see there), so both sessions run the same engine steps
ARGS = ["experiment=smoke", "dataset.num_questions=4", "pipeline.max_tokens=16", "pipeline.step_tokens=12",
        "pipeline.max_steps=3", "pipeline.max_follow_ups=2", "retriever.k=2", "pipeline.max_concurrency=1",
        "progress=false", "+model.kernel_overrides.linears=dense", "scheduler.cost_budget=false",
        "cache.enable_prefix_caching=false"]


@pytest.mark.parametrize("method", ["ircot", "flare", "self_ask"])
def test_a_cut_run_of_each_method_resumes_to_the_uninterrupted_one(tmp_path: Path, method: str):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    app.run(_compose(*ARGS, f"pipeline={method}", f"run_dir={whole}"))
    shutil.copytree(whole, cut)
    lines = (cut / "records.jsonl").read_text().splitlines(keepends=True)
    (cut / "records.jsonl").write_text("".join(lines[:2]))  # two questions recorded when the run stopped
    (cut / "summary.json").unlink()
    assert main(["run", f"resume={cut}"]) == 0  # the saved config, as a user resumes
    got, want = _strip(_records(cut)), _strip(_records(whole))
    assert [r["prediction"] for r in got] == [r["prediction"] for r in want]
    assert _same(got, want)  # every step's queries, passages and generations; scores to fp32 noise
    assert all(r["generated_tokens"] > 0 for r in got)
    resumed, uninterrupted = (json.loads((d / "summary.json").read_text()) for d in (cut, whole))
    assert resumed["num_questions"] == 4 and resumed["config"]["pipeline"] == method
    assert resumed["sessions"][-1]["questions"] == 2  # the resumed session asked only the two left
    assert _same(_strip(resumed), _strip(uninterrupted))
