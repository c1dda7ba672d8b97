"""Structured configs for the `orthrus-rag` CLI (registered in Hydra's ConfigStore as `schema`): typos and
wrong types fail at compose time, and `validate` catches bad values before any model loads.

The engine's settings are the engine's own dataclasses (`model`, `cache`, `scheduler`: orthrus_rag/config.py), so a
new engine field is a CLI key with no edit here; `deploy` (DeployConf) is how the engine is run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orthrus_rag.engine.deploy import DEPLOYMENTS
from orthrus_rag.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from orthrus_rag.data.loaders import DATASETS as _DATASET_SPECS
from orthrus_rag.pipelines.answer_formats import check_answer_format
from orthrus_rag.pipelines.iter_retgen import PIPELINES
from orthrus_rag.retrievers.faiss_index import INDEX_TYPES

logger = logging.getLogger(__name__)
# NOTE: the names come from the modules that implement them, so a new dataset/index/pipeline needs no edit here
DATASETS = tuple(_DATASET_SPECS)
# one co-scheduled engine, a two-process deployment of it, or engine replicas on Ray Serve (entrypoints/ray/)
SERVINGS = ("engine", *DEPLOYMENTS, "ray")
ENGINE_NODES = ("model", "cache", "scheduler")  # AppConf nodes that are EngineConfig's parts, by the same name


@dataclass
class DatasetConf:
    name: str = "synthetic"
    path: str | None = None  # a local JSONL file (2Wiki / HotpotQA format); None: the hub (or the generator)
    hub_id: str | None = None
    split: str | None = None
    limit: int | None = None  # the first N questions
    num_questions: int = 60  # synthetic only
    seed: int = 0  # synthetic only


@dataclass
class DeployConf:
    """How the engine runs: one in-process engine, or a two-process deployment of it (the baselines)."""

    mode: str = "engine"  # engine: one co-scheduled engine; dedicated / disagg-pd: two worker processes; ray
    threads: list[int] | None = None  # torch threads per worker of a deployment (default 1 each)
    num_threads: int | None = None  # the one in-process engine's torch threads (ray: each replica's); None: default
    max_in_flight: int = 8192  # requests the async engine admits at once (more: EngineQueueFull / HTTP 429)
    # ray: engine replicas behind one endpoint; each reserves `num_threads` CPUs (default 1)
    replicas: int = 1
    min_replicas: int | None = None  # both set: Ray Serve autoscales between them, by `target_ongoing_requests`
    max_replicas: int | None = None
    target_ongoing_requests: float = 32.0
    upscale_delay_s: float = 30.0  # autoscaling: how long the load must stay above (below) target before Ray
    downscale_delay_s: float = 600.0  # adds (removes) a replica; Ray Serve's defaults
    retries: int = 2  # a call whose replica died is sent again this many times (then: HTTP 503 / a failed question)
    ray_address: str | None = None  # join this cluster ("auto", "ray://host:10001"); None: start a local Ray
    ray_num_cpus: int | None = None  # the local Ray's CPUs; None: the machine's
    gpus_per_replica: float = 0.0  # ray: GPUs each replica reserves (with model.device=cuda)


@dataclass
class RetrieverConf:
    index_type: str = "flat"
    k: int = 5
    nlist: int = 64
    nprobe: int = 8
    hnsw_m: int = 32
    index_dir: str | None = None  # load this prebuilt index (built by `orthrus-rag index`) instead of building
    pooling: str = "mean"
    query_instruction: str | None = None
    # the LoRA adapter documents and queries embed under (a name in model.adapters or an embedding adapter's);
    # None: the default route (the encoder, else the first embedding adapter, else the bare backbone)
    adapter: str | None = None


@dataclass
class PipelineConf:
    name: str = "iter_retgen"
    iterations: int = 2
    max_tokens: int = 96
    temperature: float = 0.0
    max_concurrency: int | None = None  # questions in flight; None: sized from the engine (see default_concurrency)
    question_timeout_s: float | None = None  # a question unanswered this long is recorded as failed; None: no limit
    chat_template: bool = True
    # how the final iteration writes its answer: free | constrained ("... So the answer is X." forced by a
    # grammar) | json ({"answer": ...}); see orthrus_rag/pipelines/answer_formats.py
    answer_format: str = "free"
    # the LoRA adapter every generation runs under (a name in model.adapters); None: the base model
    generation_adapter: str | None = None


@dataclass
class ServeConf:
    """`orthrus-rag serve`: the OpenAI-compatible server over the configured engine (entrypoints/openai/)."""

    host: str = "127.0.0.1"  # loopback by default; another address exposes the engine to the network
    port: int = 8000
    api_key: str | None = None  # None: the ORTHRUS_API_KEY environment variable, else no key
    served_model_name: str | None = None  # the generation model's name in the API; None: model.name
    default_max_tokens: int = 512  # when a request gives no max_tokens
    log_level: str = "info"


@dataclass
class AppConf:
    dataset: DatasetConf = field(default_factory=DatasetConf)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    deploy: DeployConf = field(default_factory=DeployConf)
    retriever: RetrieverConf = field(default_factory=RetrieverConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    serve: ServeConf = field(default_factory=ServeConf)
    # the run's folder (records.jsonl, summary.json, config.yaml, steps.jsonl, index/); a multirun: the sweep's
    # folder, one subfolder per job
    run_dir: str = "runs/${now:%Y-%m-%d_%H-%M-%S}"
    resume: str | None = None  # a run folder to continue: its recorded questions are skipped
    # which failed questions a resume asks again: retryable (the serving system's failures: a replica that died,
    # the question timeout), all, or none (every record stays as it is)
    retry_failed: str = "retryable"
    checkpoint_every: int = 100  # questions between rewrites of summary.json (and fsyncs of records.jsonl)
    seed: int = 0
    progress: bool = True


RETRY_FAILED = ("retryable", "all", "none")

# settings that change how a run goes, not what it computes: a resumed run may change them
OPERATIONAL_KEYS = ("run_dir", "resume", "retry_failed", "progress", "checkpoint_every", "pipeline.max_concurrency",
                    "pipeline.question_timeout_s", "deploy.num_threads", "deploy.max_in_flight", "deploy.retries",
                    "deploy.upscale_delay_s", "deploy.downscale_delay_s")


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=AppConf)


def _choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


def validate(cfg: Any) -> None:
    """Check values that the schema's types cannot, before anything heavy happens."""
    _choice(cfg.dataset.name, DATASETS, "dataset")
    if cfg.dataset.path is not None and not Path(cfg.dataset.path).is_file():
        raise ValueError(f"dataset.path: no such file: {cfg.dataset.path}")
    if cfg.dataset.limit is not None and cfg.dataset.limit < 1:
        raise ValueError(f"dataset.limit must be at least 1, got {cfg.dataset.limit}")
    if cfg.dataset.num_questions < 1:
        raise ValueError(f"dataset.num_questions must be at least 1, got {cfg.dataset.num_questions}")
    _check_deploy(cfg.deploy)
    _choice(cfg.retriever.index_type, INDEX_TYPES, "retriever.index_type")
    if cfg.retriever.k < 1:
        raise ValueError(f"retriever.k must be at least 1, got {cfg.retriever.k}")
    if cfg.retriever.index_dir is not None and not Path(cfg.retriever.index_dir).is_dir():
        raise ValueError(f"retriever.index_dir: no such folder: {cfg.retriever.index_dir}")
    _choice(cfg.pipeline.name, PIPELINES, "pipeline")
    if cfg.pipeline.iterations < 1:
        raise ValueError(f"pipeline.iterations must be at least 1, got {cfg.pipeline.iterations}")
    if cfg.pipeline.max_tokens < 1:
        raise ValueError(f"pipeline.max_tokens must be at least 1, got {cfg.pipeline.max_tokens}")
    check_answer_format(cfg.pipeline.answer_format)
    from orthrus_rag.models.registry import resolve_adapter_path

    for adapter in cfg.model.embedding_adapters:
        if not resolve_adapter_path(adapter).is_dir():
            raise ValueError(f"model.embedding_adapters: no such folder: {adapter}")
    for name, adapter in cfg.model.adapters.items():
        if not resolve_adapter_path(adapter).is_dir():
            raise ValueError(f"model.adapters.{name}: no such folder: {adapter}")
    _check_adapter_names(cfg)
    for key in ("nlist", "nprobe", "hnsw_m"):
        if cfg.retriever[key] < 1:
            raise ValueError(f"retriever.{key} must be at least 1, got {cfg.retriever[key]}")
    _check_owned_values(cfg)
    _check_run_settings(cfg)
    _check_serve(cfg.serve)


def _check_deploy(d: Any) -> None:
    _choice(d.mode, SERVINGS, "deploy.mode")
    if d.threads is not None and (len(d.threads) != 2 or any(t < 1 for t in d.threads)):
        raise ValueError(f"deploy.threads must be two positive thread counts (one per worker), got {list(d.threads)}")
    if d.mode == "engine" and d.threads is not None:
        raise ValueError("deploy.threads sets a deployment's workers (deploy=dedicated or disagg_pd); "
                         "one engine takes deploy.num_threads")
    if d.mode not in ("engine", "ray") and d.num_threads is not None:
        raise ValueError(f"deploy.num_threads sets one engine; the {d.mode} workers take deploy.threads")
    if d.replicas < 1:
        raise ValueError(f"deploy.replicas must be at least 1, got {d.replicas}")
    if d.gpus_per_replica < 0:
        raise ValueError(f"deploy.gpus_per_replica must be non-negative, got {d.gpus_per_replica}")
    if (d.min_replicas is None) != (d.max_replicas is None):
        raise ValueError("deploy.min_replicas and deploy.max_replicas go together (autoscaling between them)")
    if d.min_replicas is not None and not 0 <= d.min_replicas <= d.max_replicas:
        raise ValueError(f"deploy.min_replicas must be in [0, max_replicas], got {d.min_replicas} and {d.max_replicas}")
    if d.max_in_flight < 1:
        raise ValueError(f"deploy.max_in_flight must be at least 1, got {d.max_in_flight}")
    if d.retries < 0:
        raise ValueError(f"deploy.retries must be non-negative, got {d.retries}")
    if d.upscale_delay_s < 0 or d.downscale_delay_s < 0:
        raise ValueError(f"deploy.upscale_delay_s and downscale_delay_s must be non-negative, got "
                         f"{d.upscale_delay_s} and {d.downscale_delay_s}")


def _owned(prefix: str, build: Callable[[], Any]) -> Any:
    """`build()`, a ValueError from the type that owns the rule named by its key group (`scheduler: ...`)."""
    try:
        return build()
    except ValueError as exc:
        raise ValueError(f"{prefix}: {exc}") from None


def _check_owned_values(cfg: Any) -> None:
    """Values whose rules live in the engine's own types (SamplingParams, PoolingParams, the EngineConfig parts'
    __post_init__, the policy registry): build them here, without weights, so a bad one fails at compose time with
    that type's message, named by its key group."""
    from orthrus_rag.params import PoolingParams, SamplingParams

    _owned("pipeline", lambda: SamplingParams(max_tokens=cfg.pipeline.max_tokens,
                                              temperature=cfg.pipeline.temperature))
    _owned("retriever", lambda: PoolingParams(pooling=cfg.retriever.pooling))
    engine_config_from(cfg)


def _check_adapter_names(cfg: Any) -> None:
    """The adapters the pipeline and the retriever name are loaded, and of the right kind (engine/routing.py's
    rules, on the names the engine will load)."""
    from orthrus_rag.engine.routing import generation_slot, route_embedding
    from orthrus_rag.params import PoolingParams

    from omegaconf import OmegaConf

    loaded = _owned("model", lambda: OmegaConf.to_object(cfg.model)).loaded_adapters()
    slots = {name: i for i, name in enumerate(loaded, start=1)}
    kinds = {name: kind for name, (_, kind) in loaded.items()}
    _owned("pipeline.generation_adapter", lambda: generation_slot(cfg.pipeline.generation_adapter, slots, kinds))
    if cfg.retriever.adapter is not None:
        _owned("retriever.adapter", lambda: route_embedding(PoolingParams(adapter=cfg.retriever.adapter),
                                                            cfg.model.embedding_model is not None, slots, kinds))


def _check_serve(s: Any) -> None:
    if s.default_max_tokens < 1:
        raise ValueError(f"serve.default_max_tokens must be at least 1, got {s.default_max_tokens}")
    if not 0 <= s.port < 65536:
        raise ValueError(f"serve.port must be in [0, 65535], got {s.port}")


def build_engine(cfg: Any):  # -> Engine
    """The engine the config describes (weights loaded): what `run`, `index` and `serve` all start from."""
    from orthrus_rag.engine.engine import Engine

    return Engine.from_config(engine_config_from(cfg))


def engine_config_from(cfg: Any) -> EngineConfig:  # the one engine, or each worker's of a deployment
    """The `model`, `cache` and `scheduler` nodes as the engine's config (they are its dataclasses; their
    __post_init__ checks run here), with `deploy.num_threads` and `seed`. Loads nothing."""
    from omegaconf import OmegaConf

    from orthrus_rag.engine.core.policies import check_policy

    parts = {key: _owned(key, lambda key=key: OmegaConf.to_object(cfg[key])) for key in ENGINE_NODES}
    _owned("scheduler", lambda: check_policy(parts["scheduler"].policy))  # the registry owns policy names
    return EngineConfig(**parts, num_threads=cfg.deploy.num_threads, seed=cfg.seed)


def _check_run_settings(cfg: Any) -> None:
    p = cfg.pipeline
    if p.max_concurrency is not None and p.max_concurrency < 1:
        raise ValueError(f"pipeline.max_concurrency must be at least 1 (or null: sized from the engine), "
                         f"got {p.max_concurrency}")
    if p.question_timeout_s is not None and p.question_timeout_s <= 0:
        raise ValueError("pipeline.question_timeout_s must be positive (or null: no limit), "
                         f"got {p.question_timeout_s}")
    if cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {cfg.checkpoint_every}")
    _choice(cfg.retry_failed, RETRY_FAILED, "retry_failed")
    if cfg.resume is not None and not Path(cfg.resume).is_dir():
        raise ValueError(f"resume: no such run folder: {cfg.resume}")


# ---- resume: the saved config against the current one ----------------------------------------------------
def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _plain(cfg: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


# a run folder's config.yaml from before the engine's dataclasses became the config nodes (issue #17) names its
# settings by these keys; the old names are frozen, so the table is written out rather than derived
OLD_KEYS = {
    "engine.serving": "deploy.mode", "engine.threads": "deploy.threads",
    "engine.max_in_flight": "deploy.max_in_flight", "engine.max_pending": "deploy.max_in_flight",
    "model.num_threads": "deploy.num_threads", "model.embedding_adapter": "model.embedding_adapters",
    **{f"engine.{k}": f"scheduler.{k}" for k in (
        "policy", "max_num_batched_tokens", "max_num_seqs", "max_chunk_tokens", "min_share", "cost_budget",
        "step_time_target", "step_time_margin")},
    **{f"engine.{k}": f"cache.{k}" for k in ("block_size", "kv_cache_gib", "enable_prefix_caching")},
}


def upgrade_saved(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config (plain nested dicts) with its old keys (OLD_KEYS) renamed; a config already in today's
    keys comes back unchanged."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for old, new in OLD_KEYS.items():
        group, key = old.split(".")
        if key not in out.get(group, {}):
            continue
        value = out[group].pop(key)
        if new == "model.embedding_adapters":  # one optional folder then, a list of folders now
            value = [] if value is None else [value]
        new_group, new_key = new.split(".")
        out.setdefault(new_group, {})[new_key] = value
    if out.get("engine") == {}:
        del out["engine"]
    return out


def saved_config(saved: Any) -> Any:  # -> DictConfig
    """A run folder's saved config (config.yaml's text, or that loaded) in today's schema: old keys renamed, and
    settings it predates at their defaults, which that run used."""
    from omegaconf import OmegaConf

    plain = _plain(OmegaConf.create(saved) if isinstance(saved, str) else saved)
    return OmegaConf.merge(OmegaConf.structured(AppConf), upgrade_saved(plain))


def config_diff(saved: Any, current: Any) -> list[str]:
    """`key: saved -> current` for every setting that differs, the operational ones aside."""
    old, new = _flatten(_plain(saved_config(saved))), _flatten(_plain(current))
    keys = sorted((set(old) | set(new)) - set(OPERATIONAL_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def resumed_config(saved_yaml: str, current: Any, overridden: set[str]) -> Any:
    """The config a run was started with (its saved config.yaml), with `run_dir`, `resume` and the operational
    settings in `overridden` (those given on the command line) taken from `current`."""
    from omegaconf import OmegaConf

    cfg = saved_config(saved_yaml)
    for key in {"run_dir", "resume"} | (set(OPERATIONAL_KEYS) & overridden):
        OmegaConf.update(cfg, key, OmegaConf.select(current, key), merge=False)
    return cfg
