"""Long runs against a model-free engine (tests/fake_engine.py behind the real AsyncEngine): bounded concurrency
and memory, per-question timeouts, records streamed to disk, full disks, resume and exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from orthrus_rag.entrypoints import commands as app
from orthrus_rag.data.types import QAExample
from orthrus_rag.engine.async_engine import AsyncEngine
from orthrus_rag.pipelines import IterRetGen
from orthrus_rag.pipelines import run_store
from tests.fake_engine import FakeEngine, expected_scores, fake_client, write_dataset
from tests.test_app_config import _compose

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"latency_s", "finished_s", "retrieve_s", "generate_s", "wall_time_s", "throughput_qps", "sessions",
          "session", "engine"}


def _cfg(data: Path, run_dir: Path, *extra: str):
    return _compose("dataset=2wiki", f"dataset.path={data}", "pipeline=no_retrieval", f"run_dir={run_dir}",
                    "progress=false", *extra)


def _records(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: r["index"])


def _strip(obj):
    """Without timings (they differ between any two runs)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def test_10000_questions_against_a_queue_of_64_none_fails_for_lack_of_room(tmp_path):
    data = write_dataset(tmp_path / "d.jsonl", 10_000)
    backend = fake_client(max_in_flight=64)
    summary = app.run(_cfg(data, tmp_path / "run"), client=backend)
    assert summary["num_questions"] == 10_000 and summary["num_failed"] == 0 and summary["complete"]
    assert backend.engine.max_requests <= 64  # the queue never held more than it admits
    assert summary["config"]["max_concurrency"] == 64  # sized from the engine's queue
    want = expected_scores(range(10_000))
    assert summary["em"] == pytest.approx(want["em"]) and summary["acc"] == pytest.approx(want["acc"])
    assert len(_records(tmp_path / "run")) == 10_000
    steps = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    assert len(steps) == summary["engine"]["num_steps"] == backend.engine.num_steps  # every step, streamed
    assert summary["engine"]["tokens_per_step"]["total"] == len(steps)


def test_questions_in_flight_stay_bounded_and_memory_does_not_grow_with_the_dataset():
    """The stream pulls questions lazily and keeps no records: 10,000 questions peak like 1,000."""

    async def run(n: int) -> tuple[int, int]:
        engine = FakeEngine(max_num_seqs=16)
        async with AsyncEngine(engine, max_in_flight=64) as aengine:
            pipeline = IterRetGen(aengine, None)
            examples = ((i, QAExample(f"q{i}", f"What is item {i}?", [f"item {i}"])) for i in range(n))
            tracemalloc.start()
            count = 0
            async with contextlib.aclosing(pipeline.stream(examples)) as records:
                async for rec in records:
                    assert rec.error is None
                    count += 1
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert engine.max_requests <= 64 and count == n
        return count, peak

    _, small = asyncio.run(run(1_000))
    _, large = asyncio.run(run(10_000))
    assert large < 1.5 * small + 200_000, (small, large)


def test_a_question_past_its_timeout_is_recorded_failed_and_its_request_aborted(tmp_path):
    data = write_dataset(tmp_path / "d.jsonl", 6, hang={2})
    backend = fake_client()
    summary = app.run(_cfg(data, tmp_path / "run", "pipeline.question_timeout_s=0.5"), client=backend)
    assert summary["num_questions"] == 6 and summary["num_failed"] == 1
    assert summary["failures"] == {"TimeoutError": 1}
    assert summary["failed"][0]["id"] == "q2" and "question_timeout_s" in summary["failed"][0]["error"]
    assert len(backend.engine.aborted) == 1 and not backend.engine.requests  # its request left the engine
    failed = [r for r in _records(tmp_path / "run") if r["error"]]
    assert [r["id"] for r in failed] == ["q2"]


def test_cli_exit_codes_and_failures_named(tmp_path, monkeypatch, capsys):
    from orthrus_rag.entrypoints.cli import main

    monkeypatch.setattr(app, "build_client", lambda cfg: fake_client())
    ok = write_dataset(tmp_path / "ok.jsonl", 5)
    base = ["dataset=2wiki", "pipeline=no_retrieval", "progress=false"]
    assert main(["run", *base, f"dataset.path={ok}", f"run_dir={tmp_path / 'a'}"]) == 0
    bad = write_dataset(tmp_path / "bad.jsonl", 5, hang={1})
    assert main(["run", *base, f"dataset.path={bad}", f"run_dir={tmp_path / 'b'}",
                 "pipeline.question_timeout_s=0.3"]) == 1
    err = capsys.readouterr().err
    assert "1 of 5 questions failed (1 TimeoutError)" in err and "Traceback" not in err
    assert main(["run", *base, f"dataset.path={ok}", "pipeline.max_concurrency=0", f"run_dir={tmp_path / 'c'}"]) == 2
    assert main(["run", *base, "retriever.kk=3", f"run_dir={tmp_path / 'd'}"]) == 2  # Hydra's own config error
    assert main(["run", f"resume={tmp_path / 'missing'}"]) == 2 and not (tmp_path / "missing").exists()
    # an existing run is never written over
    assert main(["run", *base, f"dataset.path={ok}", f"run_dir={tmp_path / 'a'}"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_hub_failure_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys):
    from huggingface_hub.errors import LocalEntryNotFoundError

    from orthrus_rag.entrypoints.cli import main

    def offline(cfg):
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder; outgoing traffic has "
                                      "been disabled.")

    monkeypatch.setattr(app, "build_client", offline)
    data = write_dataset(tmp_path / "d.jsonl", 2)
    code = main(["run", "dataset=2wiki", f"dataset.path={data}", "pipeline=no_retrieval", "progress=false",
                 f"run_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: the hub could not provide") and "HF_HUB_OFFLINE=0" in err[0]


class _FullDisk:
    """A records.jsonl that takes `room` lines, then fails as a full disk does."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, text: str) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _full_disk_after(monkeypatch, room: int) -> None:
    real = run_store._open_append

    def opener(path: Path):
        f = real(path)
        return _FullDisk(f, room) if path.name == run_store.RECORDS else f

    monkeypatch.setattr(run_store, "_open_append", opener)


def test_full_disk_keeps_the_records_exits_1_and_resume_finishes_the_same_run(tmp_path, monkeypatch, capsys):
    from orthrus_rag.entrypoints.cli import main

    monkeypatch.setattr(app, "build_client", lambda cfg: fake_client())
    data = write_dataset(tmp_path / "d.jsonl", 300)
    args = ["dataset=2wiki", f"dataset.path={data}", "pipeline=no_retrieval", "progress=false", "checkpoint_every=50",
            "pipeline.max_concurrency=7"]
    assert main(["run", *args, f"run_dir={tmp_path / 'whole'}"]) == 0
    _full_disk_after(monkeypatch, 120)
    run = tmp_path / "run"
    assert main(["run", *args, f"run_dir={run}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "No space left on device" in err and "the disk is full" in err
    assert "120 records written before are kept" in err and f"resume={run}" in err
    assert len(_records(run)) == 120  # every record before the failure, whole
    assert json.loads((run / "summary.json").read_text())["num_questions"] == 120  # saved on the way out
    monkeypatch.undo()
    monkeypatch.setattr(app, "build_client", lambda cfg: fake_client())
    assert main(["run", f"resume={run}"]) == 0  # the saved config: no overrides needed
    assert _strip(_records(run)) == _strip(_records(tmp_path / "whole"))
    resumed, whole = (json.loads((d / "summary.json").read_text()) for d in (run, tmp_path / "whole"))
    assert _strip(resumed) == _strip(whole)
    assert [s["questions"] for s in resumed["sessions"]] == [120, 180]
    assert resumed["config"]["max_concurrency"] == 7  # a bare resume keeps the saved settings, operational too


def test_a_real_full_disk_on_a_tiny_tmpfs(tmp_path):
    """The same on a 64 KiB tmpfs (mounted in a private mount namespace; needs unshare and mount rights)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (unshare -m with mount rights); the patched-writer test covers this")
    data = write_dataset(tmp_path / "d.jsonl", 2_000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = ("import sys; sys.path.insert(0, %r)\n"
              "from orthrus_rag.entrypoints import commands as app; from orthrus_rag.entrypoints.cli import main\n"
              "from tests.fake_engine import fake_client\n"
              "app.build_client = lambda cfg: fake_client()\n"
              "sys.exit(main(['run', 'dataset=2wiki', 'dataset.path=%s', 'pipeline=no_retrieval', 'progress=false',"
              " 'run_dir=%s/run']))" % (str(ROOT), data, mnt))
    kept = tmp_path / "kept"
    out = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs "{mnt}" || exit 99; '
                          f'"{sys.executable}" -c "$0"; rc=$?; cp -r "{mnt}/run" "{kept}"; exit $rc', script],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "No space left on device" in last and f"resume={mnt / 'run'}" in last
    lines = (kept / "records.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line)["id"] for line in lines[:-1])  # whole records only
    assert f"The {len(lines) - 1} records written before are kept" in last


def test_resume_drops_a_torn_last_line_and_refuses_another_config(tmp_path, monkeypatch):
    data = write_dataset(tmp_path / "d.jsonl", 20)
    run = tmp_path / "run"
    app.run(_cfg(data, run), client=fake_client())
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(lines[:7]) + lines[7][:40])  # killed while writing record 8
    with pytest.raises(ValueError, match=r"pipeline.max_tokens: 96 -> 12"):
        app.run(_cfg(data, tmp_path / "x", f"resume={run}", "pipeline.max_tokens=12"), client=fake_client())
    summary = app.run(_cfg(data, tmp_path / "x", f"resume={run}", "pipeline.max_concurrency=3"),
                      client=fake_client())
    assert summary["num_questions"] == 20 and [r["index"] for r in _records(run)] == list(range(20))
    assert [s["questions"] for s in summary["sessions"]] == [20, 13]
    data.write_text(data.read_text().replace('"q3"', '"zz"'))  # the same file, edited
    with pytest.raises(ValueError, match="another dataset"):
        app.run(_cfg(data, tmp_path / "x", f"resume={run}"), client=fake_client())


def _old_style(saved: str) -> str:
    """A config.yaml as `orthrus-rag run` wrote it before the engine's dataclasses became the config nodes: the
    scheduler, cache and deploy settings under `engine:`, the threads and the one adapter under `model:`."""
    import yaml

    cfg = yaml.safe_load(saved)
    model, sched, cache, deploy = (cfg.pop(k) for k in ("model", "scheduler", "cache", "deploy"))

    def keep(node: dict, keys: tuple[str, ...]) -> dict:  # the fields the old schema had
        return {k: node[k] for k in keys}

    cfg["model"] = {**keep(model, ("name", "embedding_model", "dtype", "device", "kernels",
                                   "kernel_overrides")),
                    "embedding_adapter": None, "num_threads": deploy["num_threads"]}
    cfg["engine"] = {"serving": deploy["mode"], "threads": deploy["threads"], "max_in_flight": deploy["max_in_flight"],
                     **keep(sched, ("policy", "max_num_batched_tokens", "max_num_seqs", "max_chunk_tokens",
                                    "min_share", "cost_budget", "step_time_target", "step_time_margin")),
                     **keep(cache, ("block_size", "kv_cache_gib", "enable_prefix_caching"))}
    return yaml.safe_dump(cfg)


def test_a_run_folder_saved_with_the_old_keys_resumes(tmp_path, monkeypatch):
    """`orthrus-rag run resume=<folder>` on a folder whose config.yaml names `engine.policy`, `model.num_threads`,
    ...: the old keys map onto the new ones, and the run continues with its own settings."""
    from orthrus_rag.entrypoints.cli import main

    built = []
    monkeypatch.setattr(app, "build_client", lambda cfg: built.append(cfg) or fake_client())
    data = write_dataset(tmp_path / "d.jsonl", 20)
    run = tmp_path / "run"
    args = ["dataset=2wiki", f"dataset.path={data}", "pipeline=no_retrieval", "progress=false",
            "scheduler=hetero_fcfs", "scheduler.max_num_batched_tokens=128", "deploy.max_in_flight=50"]
    assert main(["run", *args, f"run_dir={run}"]) == 0
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(_old_style(saved))
    assert "engine:" in (run / "config.yaml").read_text() and "scheduler:" not in (run / "config.yaml").read_text()
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(lines[:8]))  # stopped after 8 questions
    assert main(["run", f"resume={run}"]) == 0
    cfg = built[-1]
    assert (cfg.scheduler.policy, cfg.scheduler.max_num_batched_tokens, cfg.deploy.max_in_flight) == \
        ("hetero-fcfs", 128, 50)
    assert [r["index"] for r in _records(run)] == list(range(20))
    with pytest.raises(ValueError, match="scheduler.policy: 'hetero-fcfs' -> 'orthrus'"):
        app.run(_cfg(data, tmp_path / "x", f"resume={run}"), client=fake_client())


def test_sweep_writes_one_run_folder_per_job_and_summarize_tables_them(tmp_path, monkeypatch, capsys):
    """`-m scheduler=orthrus,hetero_fcfs`: two jobs, two run folders under run_dir, each with its config."""
    from orthrus_rag.entrypoints.cli import main

    monkeypatch.setattr(app, "build_client", lambda cfg: fake_client(policy=cfg.scheduler.policy))
    data = write_dataset(tmp_path / "d.jsonl", 30)
    sweep = tmp_path / "sweep"
    assert main(["run", "-m", "scheduler=orthrus,hetero_fcfs", "dataset=2wiki", f"dataset.path={data}",
                 "pipeline=no_retrieval", "progress=false", f"run_dir={sweep}"]) == 0
    for job, policy in (("0", "orthrus"), ("1", "hetero-fcfs")):
        folder = sweep / job
        assert len(_records(folder)) == 30
        assert f"policy: {policy}" in (folder / "config.yaml").read_text()
        assert (folder / ".hydra" / "overrides.yaml").is_file()  # Hydra's files beside the records
    capsys.readouterr()
    assert main(["summarize", str(sweep)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| run | policy | retriever | dataset |") and len(table) == 4
    assert table[2].startswith("| 0 | orthrus | flat k=5 | 2wiki |") and "| 0.333 |" in table[2]
    assert table[3].startswith("| 1 | hetero-fcfs |")
    assert main(["summarize", str(tmp_path / "nothing")]) == 2


def test_concurrency_above_what_the_engine_admits_waits_instead_of_failing(tmp_path):
    data = write_dataset(tmp_path / "d.jsonl", 200)
    backend = fake_client(max_in_flight=8)
    summary = app.run(_cfg(data, tmp_path / "run", "pipeline.max_concurrency=100"), client=backend)
    assert summary["num_failed"] == 0 and summary["config"]["max_concurrency"] == 8
    assert backend.engine.max_requests <= 8


def test_resuming_a_finished_run_loads_nothing_and_keeps_its_summary(tmp_path, monkeypatch):
    data = write_dataset(tmp_path / "d.jsonl", 30)
    run = tmp_path / "run"
    first = app.run(_cfg(data, run), client=fake_client())

    def no_client(cfg):
        raise AssertionError("a finished run needs no engine")

    monkeypatch.setattr(app, "build_client", no_client)
    again = app.run(_cfg(data, run, f"resume={run}"))
    assert _strip(again) == _strip(first) and again["config"] == first["config"]
