"""Structured configs for the `orthrus-rag` CLI (registered in Hydra's ConfigStore as `schema`): typos and
wrong types fail at compose time, and `validate` catches bad values before any model loads."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orthrus_rag.engine.deploy import DEPLOYMENTS
from orthrus_rag.data.loaders import DATASETS as _DATASET_SPECS
from orthrus_rag.pipelines.iter_retgen import PIPELINES
from orthrus_rag.retrievers.faiss_index import INDEX_TYPES

# NOTE: the names come from the modules that implement them, so a new dataset/index/pipeline needs no edit here
logger = logging.getLogger(__name__)
DATASETS = tuple(_DATASET_SPECS)
SERVINGS = ("engine", *DEPLOYMENTS)  # one co-scheduled engine, or a two-process deployment of it


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
class ModelConf:
    name: str = "smollm2-135m-instruct"
    embedding_model: str | None = "all-minilm-l6-v2"  # a separate encoder; None: embed with the backbone
    embedding_adapter: str | None = None  # PEFT adapter folder for backbone embeddings
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    device: str = "cpu"
    num_threads: int | None = None
    # auto: the faster of dense / oneDNN, timed once per machine and remembered; dense or onednn pin it
    linear_kernel: str = "auto"
    attention_backend: str = "auto"  # auto | grouped | reference (varlen: CUDA)


APP_ENGINE_FIELDS = ("serving", "threads", "max_in_flight")  # EngineConf fields that are not engine options


@dataclass
class EngineConf:
    serving: str = "engine"  # engine: one co-scheduled engine; dedicated / disagg-pd: two worker processes
    threads: list[int] | None = None  # torch threads per worker of a deployment (default 1 each)
    policy: str = "orthrus"
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    max_chunk_tokens: int = 256
    min_share: float = 0.1
    block_size: int = 16
    kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True  # share the KV of common prompt prefixes (few-shot demonstrations)
    max_in_flight: int = 8192
    # orthrus: size steps by a timed step-cost model; null: on CUDA only (true/false force it; false: reproducible)
    cost_budget: bool | None = None
    step_time_target: float | None = None  # seconds a step with decodes may take; None: their time x (1 + margin)
    step_time_margin: float = 1.0


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


@dataclass
class PipelineConf:
    name: str = "iter_retgen"
    iterations: int = 2
    max_tokens: int = 96
    temperature: float = 0.0
    max_concurrency: int | None = None  # questions in flight; None: sized from the engine (see default_concurrency)
    question_timeout_s: float | None = None  # a question unanswered this long is recorded as failed; None: no limit
    chat_template: bool = True


@dataclass
class ServeConf:
    """`orthrus-rag serve`: the OpenAI-compatible server over the configured engine (orthrus_rag/entrypoints/openai/)."""

    host: str = "127.0.0.1"  # loopback by default; another address exposes the engine to the network
    port: int = 8000
    api_key: str | None = None  # None: the ORTHRUS_API_KEY environment variable, else no key
    served_model_name: str | None = None  # the generation model's name in the API; None: model.name
    default_max_tokens: int = 512  # when a request gives no max_tokens
    log_level: str = "info"


@dataclass
class AppConf:
    dataset: DatasetConf = field(default_factory=DatasetConf)
    model: ModelConf = field(default_factory=ModelConf)
    engine: EngineConf = field(default_factory=EngineConf)
    retriever: RetrieverConf = field(default_factory=RetrieverConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    serve: ServeConf = field(default_factory=ServeConf)
    # the run's folder (records.jsonl, summary.json, config.yaml, steps.jsonl, index/); a multirun: the sweep's
    # folder, one subfolder per job
    run_dir: str = "runs/${now:%Y-%m-%d_%H-%M-%S}"
    resume: str | None = None  # a run folder to continue: its recorded questions are skipped
    checkpoint_every: int = 100  # questions between rewrites of summary.json (and fsyncs of records.jsonl)
    seed: int = 0
    progress: bool = True


# settings that change how a run goes, not what it computes: a resumed run may change them
OPERATIONAL_KEYS = ("run_dir", "resume", "progress", "checkpoint_every", "pipeline.max_concurrency",
                    "pipeline.question_timeout_s", "model.num_threads", "engine.max_in_flight")


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
    _choice(cfg.model.linear_kernel, ("auto", "dense", "onednn"), "model.linear_kernel")
    _choice(cfg.engine.serving, SERVINGS, "engine.serving")
    threads = cfg.engine.threads
    if threads is not None and (len(threads) != 2 or any(t < 1 for t in threads)):
        raise ValueError(f"engine.threads must be two positive thread counts (one per worker), got {list(threads)}")
    if cfg.engine.serving == "engine" and threads is not None:
        raise ValueError("engine.threads sets a deployment's workers (engine=dedicated or disagg_pd); "
                         "one engine takes model.num_threads")
    if cfg.engine.serving != "engine" and cfg.model.num_threads is not None:
        raise ValueError(f"model.num_threads sets one engine; the {cfg.engine.serving} workers take engine.threads")
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
    if cfg.model.embedding_adapter is not None and not Path(cfg.model.embedding_adapter).is_dir():
        raise ValueError(f"model.embedding_adapter: no such folder: {cfg.model.embedding_adapter}")
    for key in ("nlist", "nprobe", "hnsw_m"):
        if cfg.retriever[key] < 1:
            raise ValueError(f"retriever.{key} must be at least 1, got {cfg.retriever[key]}")
    _check_owned_values(cfg)
    _check_run_settings(cfg)
    _check_serve(cfg.serve)


def _check_owned_values(cfg: Any) -> None:
    """Values whose rules live in the engine's own types (SamplingParams, PoolingParams, EngineConfig): build them
    here, without weights, so a bad one fails at compose time with that type's message, named by its key."""
    from orthrus_rag.params import PoolingParams, SamplingParams

    for prefix, build in (("pipeline", lambda: SamplingParams(max_tokens=cfg.pipeline.max_tokens,
                                                               temperature=cfg.pipeline.temperature)),
                          ("retriever", lambda: PoolingParams(pooling=cfg.retriever.pooling)),
                          ("engine", lambda: engine_config_from(cfg))):
        try:
            build()
        except ValueError as exc:
            raise ValueError(f"{prefix}: {exc}") from None


def _check_serve(s: Any) -> None:
    if s.default_max_tokens < 1:
        raise ValueError(f"serve.default_max_tokens must be at least 1, got {s.default_max_tokens}")
    if not 0 <= s.port < 65536:
        raise ValueError(f"serve.port must be in [0, 65535], got {s.port}")


def build_engine(cfg: Any):  # -> Engine
    """The engine the config describes (weights loaded): what `run`, `index` and `serve` all start from."""
    from orthrus_rag.engine.engine import Engine

    return Engine.from_config(engine_config_from(cfg))


def build_client(cfg: Any):  # -> EngineClient
    """The `EngineClient` that `run`, `index` and `serve` go through. `engine.serving`: `engine` (one co-scheduled
    engine, an `AsyncEngine`) or a two-process deployment of it."""
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.clients import start_deployment

    if cfg.engine.serving == "engine":
        return AsyncEngine(build_engine(cfg), max_in_flight=cfg.engine.max_in_flight)
    threads = tuple(cfg.engine.threads) if cfg.engine.threads else (1, 1)
    logger.info("starting the %s deployment (threads %s)", cfg.engine.serving, threads)
    return start_deployment(cfg.engine.serving, engine_config_from(cfg), threads)


def engine_config_from(cfg: Any):  # -> EngineConfig: the one engine, or each worker's of a deployment
    """`cfg.model` and `cfg.engine` as an EngineConfig; every `engine.*` field but the app's own is an engine
    option by the same name (engine/options.py owns the names). Loads nothing."""
    from orthrus_rag.engine.options import engine_config as make

    m = cfg.model
    options = {k: cfg.engine[k] for k in cfg.engine if k not in APP_ENGINE_FIELDS}
    return make(m.name, [m.embedding_adapter] if m.embedding_adapter else [], m.embedding_model, dtype=m.dtype,
                device=m.device, num_threads=m.num_threads, seed=cfg.seed, linear_kernel=m.linear_kernel,
                attention_backend=m.attention_backend, **options)


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
    if cfg.engine.max_in_flight < 1:
        raise ValueError(f"engine.max_in_flight must be at least 1, got {cfg.engine.max_in_flight}")
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


def config_diff(saved: Any, current: Any) -> list[str]:
    """`key: saved -> current` for every setting that differs, the operational ones aside."""
    old, new = _flatten(_plain(saved)), _flatten(_plain(current))
    keys = sorted((set(old) | set(new)) - set(OPERATIONAL_KEYS))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def resumed_config(saved_yaml: str, current: Any, overridden: set[str]) -> Any:
    """The config a run was started with (its saved config.yaml), with `run_dir`, `resume` and the operational
    settings in `overridden` (those given on the command line) taken from `current`."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(AppConf), OmegaConf.create(saved_yaml))
    for key in {"run_dir", "resume"} | (set(OPERATIONAL_KEYS) & overridden):
        OmegaConf.update(cfg, key, OmegaConf.select(current, key), merge=False)
    return cfg
