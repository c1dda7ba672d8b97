"""`validate`: every value of a composed config that its type cannot check, before any model loads. Each rule
is asked of its owner (the dataset registry, the FAISS index spec, the pipeline, the engine's dataclasses and policy
registry, the request params), so it is written once; only the settings of how a run goes are checked here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orthrus_rag.config.app import RETRY_FAILED
from orthrus_rag.config.build import engine_config_from, owned
from orthrus_rag.config.engine import ModelConfig


def _choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


def validate(cfg: Any) -> None:
    """Check values that the schema's types cannot, before anything heavy happens."""
    from orthrus_rag.data.loaders import DATASETS
    from orthrus_rag.pipelines.answers import check_answer_format
    from orthrus_rag.pipelines.flashrag_prompts import check_prompt_style
    from orthrus_rag.pipelines.method import check_settings
    from orthrus_rag.pipelines.registry import PIPELINES
    from orthrus_rag.retrievers.faiss_index import IndexSpec

    _choice(cfg.dataset.name, tuple(DATASETS), "dataset")
    if DATASETS[cfg.dataset.name].file_only and cfg.dataset.path is None:
        raise ValueError(f"dataset={cfg.dataset.name} reads your own questions: give dataset.path=FILE")
    if cfg.dataset.path is not None and not Path(cfg.dataset.path).is_file():
        raise ValueError(f"dataset.path: no such file: {cfg.dataset.path}")
    if cfg.dataset.limit is not None and cfg.dataset.limit < 1:
        raise ValueError(f"dataset.limit must be at least 1, got {cfg.dataset.limit}")
    if cfg.dataset.num_questions < 1:
        raise ValueError(f"dataset.num_questions must be at least 1, got {cfg.dataset.num_questions}")
    _check_deploy(cfg.deploy)
    r, p = cfg.retriever, cfg.pipeline
    owned("retriever", lambda: IndexSpec(index_type=r.index_type, nlist=r.nlist, nprobe=r.nprobe, hnsw_m=r.hnsw_m,
                                         ef_search=r.ef_search, factory=r.factory, train_size=r.train_size),
          keyed=True)
    if r.shard_size < 1:
        raise ValueError(f"retriever.shard_size must be at least 1, got {r.shard_size}")
    from orthrus_rag.retrievers.kinds import check_kind

    owned("retriever", lambda: check_kind(r.kind))
    owned("retriever", lambda: sparse_settings(r))
    _check_corpus(cfg.corpus)
    if r.index_dir is not None and not Path(r.index_dir).is_dir() and not cfg.serve.create_index:
        raise ValueError(f"retriever.index_dir: no such folder: {r.index_dir}")
    _choice(p.name, PIPELINES, "pipeline")
    owned("retriever", lambda: check_settings(k=r.k), keyed=True)
    owned("pipeline", lambda: check_settings(iterations=p.iterations, max_concurrency=p.max_concurrency,
                                             question_timeout_s=p.question_timeout_s), keyed=True)
    owned("pipeline", lambda: check_answer_format(p.answer_format))
    owned("pipeline", lambda: check_prompt_style(p.prompt_style, p.answer_format))
    from orthrus_rag.pipelines.rerank import check_reranking

    owned("pipeline", lambda: check_reranking(p.reranker, p.top_k, r.k, list(cfg.model.rerankers)), keyed=True)
    if p.name in ("ircot", "flare", "self_ask", "search_r1"):
        from orthrus_rag.pipelines.flare import check_flare
        from orthrus_rag.pipelines.ircot import check_ircot
        from orthrus_rag.pipelines.search_r1 import check_search_r1
        from orthrus_rag.pipelines.self_ask import check_self_ask

        rule = {"ircot": lambda: check_ircot(p.max_steps, p.max_passages, p.step_tokens),
                "flare": lambda: check_flare(p.max_steps, p.threshold, p.step_tokens),
                "self_ask": lambda: check_self_ask(p.max_follow_ups, p.step_tokens),
                "search_r1": lambda: check_search_r1(p.max_searches, p.step_tokens, p.tags, p.answer_format,
                                                         p.min_searches, p.constrain_format)}[p.name]
        owned("pipeline", rule, keyed=True)
    from orthrus_rag.engine.core.policies import check_policy

    engine = engine_config_from(cfg)  # the engine's parts check their own values
    owned("scheduler", lambda: check_policy(engine.scheduler.policy))  # the registry owns the policy names
    _check_adapter_folders(engine.model)
    _check_adapter_names(cfg, engine.model)
    _check_request_params(cfg)
    _check_run_settings(cfg)
    _check_serve(cfg.serve)
    _check_ingest(cfg)


def _check_ingest(cfg: Any) -> None:
    i = cfg.ingest
    if i.path is None:
        return
    if not Path(i.path).is_file():
        raise ValueError(f"ingest.path: no such file: {i.path}")
    if i.batch_size < 1:
        raise ValueError(f"ingest.batch_size must be at least 1, got {i.batch_size}")
    if cfg.retriever.kind != "dense":
        raise ValueError(f"ingest.path adds documents to a dense index; retriever.kind={cfg.retriever.kind} "
                         "cannot take adds (bm25s indexes are built once)")
    if cfg.pipeline.name == "no_retrieval":
        raise ValueError("ingest.path adds documents to the run's index, and pipeline=no_retrieval has none")


def sparse_settings(r: Any):  # -> SparseSettings
    """The retriever config's BM25 and fusion settings (checked by their owner as they are built)."""
    from orthrus_rag.retrievers.kinds import SparseSettings

    return SparseSettings(k1=r.bm25_k1, b=r.bm25_b, method=r.bm25_method, dense_weight=r.dense_weight,
                          bm25_weight=r.bm25_weight, rrf_k=r.rrf_k, candidates=r.candidates)


def _check_corpus(c: Any) -> None:
    from orthrus_rag.data.corpus import CORPUS_KINDS

    _choice(c.kind, CORPUS_KINDS, "corpus kind")
    if c.kind in ("jsonl", "files"):
        if not c.path:
            raise ValueError(f"corpus={c.kind} needs corpus.path")
        path = Path(c.path).expanduser()
        if c.kind == "jsonl" and not path.is_file():
            raise ValueError(f"corpus.path: no such file: {c.path}")
        if c.kind == "files" and not path.is_dir():
            raise ValueError(f"corpus.path: no such folder: {c.path}")
    if c.kind == "hf" and not c.hub_id:
        raise ValueError("corpus=hf needs corpus.hub_id")
    if c.limit is not None and c.limit < 1:
        raise ValueError(f"corpus.limit must be at least 1, got {c.limit}")
    if c.chunk_tokens < 1 or not 0 <= c.chunk_overlap < c.chunk_tokens:
        raise ValueError(f"corpus.chunk_tokens must be >= 1 and 0 <= corpus.chunk_overlap < chunk_tokens, got "
                         f"{c.chunk_tokens} and {c.chunk_overlap}")


def _check_adapter_folders(model: ModelConfig) -> None:
    from orthrus_rag.models.registry import resolve_adapter_path

    for adapter in model.embedding_adapters:
        if not resolve_adapter_path(adapter).is_dir():
            raise ValueError(f"model.embedding_adapters: no such folder: {adapter}")
    for name, adapter in model.adapters.items():
        if not resolve_adapter_path(adapter).is_dir():
            raise ValueError(f"model.adapters.{name}: no such folder: {adapter}")


def _check_deploy(d: Any) -> None:
    from orthrus_rag.engine.deploy import DEPLOYMENTS

    # one co-scheduled engine, a two-process deployment of it, or engine replicas on Ray Serve (entrypoints/ray/)
    _choice(d.mode, ("engine", *DEPLOYMENTS, "ray"), "deploy.mode")
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


def _check_request_params(cfg: Any) -> None:
    """The requests a run sends, built without weights: SamplingParams and PoolingParams own their rules."""
    from orthrus_rag.params import PoolingParams, SamplingParams

    owned("pipeline", lambda: SamplingParams(max_tokens=cfg.pipeline.max_tokens,
                                             temperature=cfg.pipeline.temperature))
    owned("retriever", lambda: PoolingParams(pooling=cfg.retriever.pooling))


def _check_adapter_names(cfg: Any, model: ModelConfig) -> None:
    """The adapters the pipeline and the retriever name are loaded, and of the right kind (params.py's
    rules, on the names the engine will load)."""
    from orthrus_rag.params import PoolingParams, generation_slot, route_embedding

    loaded = model.loaded_adapters()
    slots = {name: i for i, name in enumerate(loaded, start=1)}
    kinds = {name: kind for name, (_, kind) in loaded.items()}
    owned("pipeline.generation_adapter", lambda: generation_slot(cfg.pipeline.generation_adapter, slots, kinds))
    if cfg.retriever.adapter is not None:
        owned("retriever.adapter", lambda: route_embedding(PoolingParams(adapter=cfg.retriever.adapter),
                                                           model.embedding_model is not None, slots, kinds))


def _check_serve(s: Any) -> None:
    if s.default_max_tokens < 1:
        raise ValueError(f"serve.default_max_tokens must be at least 1, got {s.default_max_tokens}")
    if not 0 <= s.port < 65536:
        raise ValueError(f"serve.port must be in [0, 65535], got {s.port}")
    if not s.keep_alive_s > 0:
        raise ValueError(f"serve.keep_alive_s must be a positive number of seconds, got {s.keep_alive_s}")


def _check_run_settings(cfg: Any) -> None:
    if cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {cfg.checkpoint_every}")
    _choice(cfg.retry_failed, RETRY_FAILED, "retry_failed")
    if cfg.resume is not None and not Path(cfg.resume).is_dir():
        raise ValueError(f"resume: no such run folder: {cfg.resume}")


