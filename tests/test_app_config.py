"""Every config group composes; bad configs fail with a clear message before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from orthrus_rag.entrypoints import commands as app
from orthrus_rag.app_config import register_configs, validate

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
          for g in ("dataset", "model", "engine", "retriever", "pipeline", "experiment")}


def _compose(*overrides: str):
    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}", f"run_dir={tmp_path}"]
    if option == "2wiki_dev200":
        overrides.append(f"dataset.path={tmp_path / 'd.jsonl'}")
        (tmp_path / "d.jsonl").write_text("")
    cfg = _compose(*overrides)
    validate(cfg)
    assert cfg.engine.policy in ("orthrus", "qlen-priority", "hetero-fcfs", "unified-homo")


def test_typo_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        _compose("retriever.kk=3")
    with pytest.raises(ConfigCompositionException):
        _compose("dataset=nope")


@pytest.mark.parametrize("overrides,message", [
    (["dataset.name=squad"], "unknown dataset 'squad'"),
    (["dataset=2wiki", "dataset.path=/no/such/file.jsonl"], "no such file"),
    (["retriever.k=0"], "retriever.k must be at least 1"),
    (["retriever.k=-2"], "retriever.k must be at least 1"),
    (["pipeline.iterations=0"], "pipeline.iterations must be at least 1"),
    (["engine.policy=fifo"], "unknown scheduling policy 'fifo'"),
    (["engine.serving=ray"], "unknown engine.serving 'ray'"),
    (["engine=dedicated", "engine.threads=[1]"], "engine.threads must be two positive"),
    (["engine=disagg_pd", "engine.threads=[0,1]"], "engine.threads must be two positive"),
    (["engine.threads=[1,1]"], "engine.threads sets a deployment's workers"),
    (["engine=dedicated", "model.num_threads=2"], "the dedicated workers take engine.threads"),
])
def test_bad_config_fails_before_any_model_loads(overrides, message, monkeypatch, tmp_path):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for a bad config")

    monkeypatch.setattr("orthrus_rag.Engine.from_config", no_model)
    monkeypatch.setattr("orthrus_rag.engine.clients.start_deployment", no_model)
    cfg = _compose(*overrides, f"run_dir={tmp_path}")
    with pytest.raises(ValueError, match=message):
        app.run(cfg)


def test_cli_reports_a_bad_value_without_a_traceback(tmp_path, capsys):
    from orthrus_rag.entrypoints.cli import main

    assert main(["run", "pipeline.iterations=0", f"run_dir={tmp_path}"]) == 2
    assert "error: pipeline.iterations must be at least 1" in capsys.readouterr().err
