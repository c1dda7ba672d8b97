"""Every config group composes; bad configs fail with a clear message before any model loads."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from orthrus_rag.entrypoints import commands as app
from orthrus_rag.config.app import DeployConf, register_configs
from orthrus_rag.config.build import engine_config_from
from orthrus_rag.entrypoints.checks import validate
from orthrus_rag.config.saved import OLD_KEYS, config_diff, resumed_config, upgrade_saved
from orthrus_rag.config import CacheConfig, ModelConfig, SchedulerConfig
from orthrus_rag.engine.core.policies import POLICIES

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
          for g in ("dataset", "corpus", "model", "scheduler", "deploy", "retriever", "pipeline", "experiment")}


def _compose(*overrides: str):
    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}", f"run_dir={tmp_path}"]
    if option in ("2wiki_dev200", "jsonl", "flashrag") and group != "corpus":  # NOTE: these read the user's question file
        overrides.append(f"dataset.path={tmp_path / 'd.jsonl'}")
        (tmp_path / "d.jsonl").write_text("")
    if group == "corpus" and option in ("jsonl", "files"):  # NOTE: these two name what they read
        (tmp_path / "c.jsonl").write_text("")
        overrides.append(f"corpus.path={tmp_path / 'c.jsonl' if option == 'jsonl' else tmp_path}")
    if group == "corpus" and option == "hf":
        overrides.append("corpus.hub_id=json")
    cfg = _compose(*overrides)
    validate(cfg)
    assert cfg.scheduler.policy in POLICIES


def test_typo_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        _compose("retriever.kk=3")
    with pytest.raises(ConfigCompositionException):
        _compose("dataset=nope")


@pytest.mark.parametrize("overrides,message", [
    (["dataset.name=squad"], "unknown dataset 'squad'"),
    (["dataset=2wiki", "dataset.path=/no/such/file.jsonl"], "no such file"),
    (["dataset=jsonl"], "dataset=jsonl reads your own questions: give dataset.path=FILE"),
    (["retriever.k=0"], "retriever.k must be at least 1"),
    (["retriever.k=-2"], "retriever.k must be at least 1"),
    (["pipeline.iterations=0"], "pipeline.iterations must be at least 1"),
    (["scheduler.policy=fifo"], "scheduler: unknown scheduling policy 'fifo'"),
    (["deploy.mode=slurm"], "unknown deploy.mode 'slurm'"),
    (["deploy=ray", "deploy.min_replicas=1"], "deploy.min_replicas and deploy.max_replicas go together"),
    (["deploy=dedicated", "deploy.threads=[1]"], "deploy.threads must be two positive"),
    (["deploy=disagg_pd", "deploy.threads=[0,1]"], "deploy.threads must be two positive"),
    (["deploy.threads=[1,1]"], "deploy.threads sets a deployment's workers"),
    (["deploy=dedicated", "deploy.num_threads=2"], "the dedicated workers take deploy.threads"),
    (["deploy.max_in_flight=0"], "deploy.max_in_flight must be at least 1"),
    (["model.embedding_adapters=[/no/such/adapter]"], "model.embedding_adapters: no such folder"),
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


# ---- one config: the engine's dataclasses are the nodes ---------------------------------------------------
ENGINE_CLASSES = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}


def test_the_engine_nodes_are_the_engine_classes():
    cfg = _compose()
    for node, cls in ENGINE_CLASSES.items():
        assert OmegaConf.get_type(cfg[node]) is cls
    assert OmegaConf.get_type(cfg.deploy) is DeployConf
    assert "engine" not in cfg  # no second copy of the engine's settings


@pytest.mark.parametrize("node", sorted(ENGINE_CLASSES))
def test_every_engine_field_is_a_cli_key_that_reaches_the_engine(node):
    """A field added to the engine's dataclass is a CLI key by its own name with no edit in orthrus_rag/config/: the
    node's keys are the class's fields, and an override of one lands in the EngineConfig built from it."""
    cls = ENGINE_CLASSES[node]
    assert list(_compose()[node]) == [f.name for f in dataclasses.fields(cls)]
    changed = {"model": ("max_model_len", 512), "cache": ("num_blocks", 77),
               "scheduler": ("encoder_token_weight", 0.5)}[node]  # none of these had an app-side copy
    config = engine_config_from(_compose(f"{node}.{changed[0]}={changed[1]}"))
    assert getattr(getattr(config, node), changed[0]) == changed[1]


def test_deploy_groups_compose_beside_any_scheduler():
    cfg = _compose("scheduler=hetero_fcfs", "deploy=dedicated")
    assert (cfg.deploy.mode, list(cfg.deploy.threads), cfg.scheduler.policy) == ("dedicated", [1, 1], "hetero-fcfs")
    assert _compose("deploy=disagg_pd").deploy.mode == "disagg-pd"
    one = _compose("deploy.num_threads=2", "deploy.max_in_flight=16", "seed=3")
    config = engine_config_from(one)
    assert (config.num_threads, config.seed, one.deploy.max_in_flight) == (2, 3, 16)
    assert _compose().model.embedding_model == "all-minilm-l6-v2"  # the CLI's default, from conf/model/smollm2.yaml


@pytest.mark.parametrize("override,message", [
    ("model.dtype=float8", "model: unknown dtype 'float8'"),
    ("model.kernels=fast", "model: unknown kernels 'fast'; expected auto or torch"),
    ("+model.kernel_overrides.layers=fast",
     "model: kernel_overrides: unknown choice 'fast' for layers; expected auto, split"),
    ("cache.block_size=0", "cache: block_size and num_blocks must be positive"),
    ("cache.kv_cache_gib=0", "cache: kv_cache_gib must be positive"),
    ("scheduler.min_share=0.9", "scheduler: min_share must be in"),
    ("scheduler.policy=fifo", "scheduler: unknown scheduling policy 'fifo'"),
    ("deploy.mode=slurm", "unknown deploy.mode 'slurm'"),
    ("deploy.replicas=0", "deploy.replicas must be at least 1"),
    ("deploy.gpus_per_replica=-1", "deploy.gpus_per_replica must be non-negative"),
    ("deploy.max_in_flight=0", "deploy.max_in_flight must be at least 1"),
])
def test_a_bad_value_in_each_node_is_refused_naming_its_key(override, message, tmp_path):
    with pytest.raises(ValueError) as exc:
        validate(_compose(override, f"run_dir={tmp_path}"))
    assert str(exc.value).startswith(message)


def test_a_wrong_type_in_an_engine_node_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        _compose("scheduler.max_num_seqs=many")
    with pytest.raises(ConfigCompositionException):
        _compose("engine.policy=orthrus")  # the old key is gone


# a run folder's config.yaml as written before the engine's dataclasses became the nodes
OLD_SAVED = """
model: {name: smollm2-135m-instruct, embedding_model: null, embedding_adapter: ADAPTER, dtype: auto, device: cpu,
        num_threads: 2, linear_kernel: dense, attention_backend: auto, cpu_decode_kernel: false, cpu_layer_loop: true}
engine: {serving: engine, threads: null, policy: hetero-fcfs, max_num_batched_tokens: 128, max_num_seqs: 32,
         max_chunk_tokens: 64, min_share: 0.2, block_size: 32, kv_cache_gib: 0.5, enable_prefix_caching: false,
         max_in_flight: 100, cost_budget: false, step_time_target: null, step_time_margin: 0.5}
run_dir: RUN
seed: 7
"""


def test_an_old_saved_config_maps_onto_the_new_keys(tmp_path):
    saved = OLD_SAVED.replace("ADAPTER", str(tmp_path)).replace("RUN", str(tmp_path / "run"))
    upgraded = upgrade_saved(OmegaConf.to_container(OmegaConf.create(saved)))
    assert "engine" not in upgraded and "num_threads" not in upgraded["model"]
    assert upgraded["model"]["embedding_adapters"] == [str(tmp_path)]  # the one folder, now a list
    # the implementation switches of old folders: one override each where they asked for other than the default
    assert upgraded["model"]["kernel_overrides"] == {"linears": "dense", "decode_attention": "sdpa"}
    assert not {"linear_kernel", "attention_backend", "cpu_decode_kernel", "cpu_layer_loop"} & set(upgraded["model"])
    assert upgraded["deploy"] == {"mode": "engine", "threads": None, "max_in_flight": 100, "num_threads": 2}
    assert upgraded["cache"] == {"block_size": 32, "kv_cache_gib": 0.5, "enable_prefix_caching": False}
    assert upgraded["scheduler"]["policy"] == "hetero-fcfs" and upgraded["scheduler"]["step_time_margin"] == 0.5
    assert set(OLD_KEYS.values()) <= {f"{g}.{k}" for g, node in upgraded.items() if isinstance(node, dict)
                                      for k in node}  # every new key is written
    assert upgrade_saved(upgrade_saved(upgraded)) == upgraded  # today's keys pass through unchanged
    assert upgrade_saved({"model": {"embedding_adapter": None}})["model"]["embedding_adapters"] == []

    current = _compose(f"run_dir={tmp_path / 'run'}", "seed=7", "model=smollm2_backbone",
                       f"model.embedding_adapters=[{tmp_path}]", "+model.kernel_overrides.linears=dense",
                       "+model.kernel_overrides.decode_attention=sdpa", "deploy.num_threads=2", "scheduler=hetero_fcfs",
                       "scheduler.max_num_batched_tokens=128", "scheduler.max_num_seqs=32",
                       "scheduler.max_chunk_tokens=64", "scheduler.min_share=0.2", "scheduler.cost_budget=false",
                       "scheduler.step_time_margin=0.5", "cache.block_size=32", "cache.kv_cache_gib=0.5",
                       "cache.enable_prefix_caching=false", "deploy.max_in_flight=100")
    # the settings the old schema did not have are at their defaults, which that run used: no difference
    assert [d for d in config_diff(OmegaConf.create(saved), current) if not d.startswith(("dataset", "pipeline",
                                                                                          "retriever", "serve"))] == []
    assert "scheduler.policy: 'hetero-fcfs' -> 'orthrus'" in config_diff(saved, _compose())
    resumed = resumed_config(saved, current, set())
    assert OmegaConf.get_type(resumed.scheduler) is SchedulerConfig
    assert (resumed.scheduler.policy, resumed.deploy.num_threads, list(resumed.model.embedding_adapters)) == \
        ("hetero-fcfs", 2, [str(tmp_path)])
    assert engine_config_from(resumed).cache.block_size == 32


@pytest.mark.parametrize("overrides,blocks", [
    ([], 1),  # MiniLM, the default embedder: no KV at all
    (["model=smollm2_backbone", "retriever.adapter=smollm2_embed"], app.INDEX_KV_TOKENS // 16),
    (["retriever=bm25", "model=smollm2_backbone"], 1),
    (["cache.num_blocks=77"], 77),  # the user's own size stays
])
def test_an_index_build_sizes_its_steps_and_kv_cache_for_embeddings_only(overrides, blocks, monkeypatch):
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)  # NOTE: also undoes what _index_engine sets, after the test
    cfg = _compose(*overrides)
    app._index_engine(cfg)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0" and os.environ["LRU_CACHE_CAPACITY"] == "1"
    assert cfg.cache.num_blocks == blocks
    assert cfg.scheduler.max_num_batched_tokens >= app.INDEX_STEP_TOKENS
    assert cfg.scheduler.max_num_seqs >= app.INDEX_STEP_SEQS
