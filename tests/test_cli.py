"""The console script's own behaviour: bad values stop a run before anything loads or is written, `--version`,
`serve` leaves no folder behind, and two different run folders are refused (no model is loaded here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orthrus_rag.entrypoints import commands as app
from orthrus_rag.entrypoints.cli import main


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if a command gets as far as building a backend (loading models)."""
    def refuse(cfg):  # noqa: ANN001
        raise AssertionError("a model would have loaded")
    monkeypatch.setattr(app, "build_client", refuse)


@pytest.mark.parametrize("override,named", [
    ("pipeline.temperature=nan", "temperature must be a finite number"),
    ("pipeline.temperature=-0.5", "temperature must be non-negative"),
    ("pipeline.max_tokens=0", "max_tokens"),
    ("retriever.pooling=median", "unknown pooling type 'median'"),
    ("retriever.nprobe=0", "retriever.nprobe"),
    ("scheduler.max_num_batched_tokens=0", "scheduler: max_num_batched_tokens"),
    ("scheduler.min_share=0.9", "scheduler: min_share"),
    ("cache.kv_cache_gib=-1", "cache: kv_cache_gib"),
    ("model.dtype=float8", "model: unknown dtype"),
    ("+model.kernel_overrides.attention=flash", "model: kernel_overrides: unknown choice 'flash' for attention"),
    ("scheduler.policy=fifo", "scheduler: unknown scheduling policy 'fifo'"),
    ("deploy.max_in_flight=0", "deploy.max_in_flight"),
    ("serve.port=70000", "serve.port"),
    ("serve.keep_alive_s=0", "serve.keep_alive_s"),
    ("pipeline.answer_format=yaml", "unknown answer_format 'yaml'"),
    ("pipeline.generation_adapter=sql", "pipeline.generation_adapter: unknown adapter 'sql'"),
    ("retriever.adapter=emb", "retriever.adapter: unknown adapter 'emb'"),
    ("+model.adapters.sql=/nonexistent", "model.adapters.sql: no such folder"),
    ("corpus=jsonl", "corpus=jsonl needs corpus.path"),
    ("corpus=files", "corpus=files needs corpus.path"),
    ("corpus.kind=csv", "unknown corpus kind 'csv'"),
    ("corpus.limit=0", "corpus.limit must be at least 1"),
    ("retriever.index_type=factory", "goes with index_type=factory"),
    ("retriever.shard_size=0", "retriever.shard_size"),
    ("retriever.train_size=0", "train_size must be at least 1"),
])
def test_bad_values_fail_before_any_model_loads_and_leave_no_folder(override, named, tmp_path, no_models, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", override, f"run_dir={run_dir}", "progress=false"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not run_dir.exists()  # not even Hydra's .hydra/: the same run_dir works once the value is fixed
    # and no log handler is left on the removed folder: the next record logged in this process would raise
    import logging

    logging.getLogger("orthrus_rag").error("a record after the failed run")
    assert not [h for h in logging.getLogger().handlers if str(run_dir) in str(getattr(h, "baseFilename", ""))]


def test_a_started_folder_is_kept_on_a_config_error(tmp_path, no_models):
    """Only a folder holding nothing but Hydra's start-up files is removed; anything else stays."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    assert main(["run", "pipeline.temperature=nan", f"run_dir={run_dir}", "progress=false"]) == 2
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("orthrus-rag ") and out.split()[1][0].isdigit()


def test_serve_writes_no_folder_into_the_current_one(tmp_path, monkeypatch):
    import orthrus_rag.entrypoints.openai

    served = []
    monkeypatch.setattr(orthrus_rag.entrypoints.openai, "serve", lambda cfg: served.append(cfg.serve.port))
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "serve.port=8123"]) == 0
    assert served == [8123]
    assert list(Path(tmp_path).iterdir()) == []  # no runs/<timestamp>/, no .hydra/, no serve.log


def test_two_different_run_folders_are_refused(tmp_path, no_models, capsys):
    a, b = tmp_path / "A", tmp_path / "B"
    assert main(["run", f"run_dir={a}", f"hydra.run.dir={b}"]) == 2
    assert "two different folders" in capsys.readouterr().err
    assert not a.exists() and not b.exists()
    assert main(["run", "-m", f"run_dir={a}", f"hydra.sweep.dir={b}", "scheduler=orthrus,hetero_fcfs"]) == 2
    assert not a.exists() and not b.exists()


def test_serve_bounds_onednns_shape_caches_before_any_model_loads(monkeypatch):
    """A server's steps repeat shapes, so it keeps oneDNN's caches at SERVING_SHAPE_CACHE_ENV (not off, as an index
    build does: a primitive costs more to build than a small step's GEMM); set before the client is built."""
    import orthrus_rag.entrypoints.clients as clients
    from orthrus_rag.memory import SERVING_SHAPE_CACHE_ENV

    for name in SERVING_SHAPE_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def stop(cfg):  # noqa: ANN001
        seen.update({name: os.environ.get(name) for name in SERVING_SHAPE_CACHE_ENV})
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(clients, "build_client", stop)
    with pytest.raises(SystemExit):  # NOTE: the console script reports the error and exits 1
        main(["serve", "serve.port=8124"])
    assert seen == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "128"}
