"""What `orthrus-rag run` and `orthrus-rag index` do, as plain functions of a composed config (tests call them
directly; the Hydra entry points in cli.py are thin)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from orthrus_rag.app_config import validate

logger = logging.getLogger(__name__)


def load_examples(cfg: Any) -> list:
    from orthrus_rag.data import load_qa, make_synthetic

    d = cfg.dataset
    if d.name == "synthetic" and d.path is None:
        examples = make_synthetic(num_questions=d.num_questions, seed=d.seed)
        return examples[: d.limit] if d.limit else examples
    return load_qa(d.name, path=d.path, hub_id=d.hub_id, split=d.split, limit=d.limit)


def build_engine(cfg: Any):  # -> Engine
    from orthrus_rag import Engine

    return Engine.from_config(engine_config(cfg))


def engine_config(cfg: Any):  # -> EngineConfig: the one engine, or each worker's of a deployment
    """`cfg.model` and `cfg.engine` as an EngineConfig; every `engine.*` field but the app's own is an engine
    option by the same name (engine/options.py owns the names)."""
    from orthrus_rag.app_config import APP_ENGINE_FIELDS
    from orthrus_rag.engine.options import engine_config as make

    m = cfg.model
    options = {k: cfg.engine[k] for k in cfg.engine if k not in APP_ENGINE_FIELDS}
    return make(m.name, [m.embedding_adapter] if m.embedding_adapter else [], m.embedding_model, dtype=m.dtype,
                device=m.device, num_threads=m.num_threads, seed=cfg.seed, **options)


def build_backend(cfg: Any):  # -> Backend
    """`engine.serving`: `engine` (one co-scheduled engine) or a two-process deployment of it."""
    from orthrus_rag.backends import EngineBackend, deployment_backend

    if cfg.engine.serving == "engine":
        return EngineBackend(build_engine(cfg), max_pending=cfg.engine.max_pending)
    threads = tuple(cfg.engine.threads) if cfg.engine.threads else (1, 1)
    logger.info("starting the %s deployment (threads %s)", cfg.engine.serving, threads)
    return deployment_backend(cfg.engine.serving, engine_config(cfg), threads)


def _pooling(cfg: Any, backend: Any) -> tuple[Any, Any]:
    """Document and query pooling: the encoder's own pooling, or the configured one on the backbone."""
    from orthrus_rag.params import PoolingParams

    if cfg.model.embedding_model is not None:
        base = dict(backend.encoder_pooling)
    else:
        base = {"pooling": cfg.retriever.pooling, "normalize": True}
    # NOTE: corpora hold passages longer than an encoder's window; cut them as sentence-transformers does
    return (PoolingParams(**base, truncate=True),
            PoolingParams(**base, instruction=cfg.retriever.query_instruction, truncate=True))


def build_retriever(cfg: Any, backend: Any, corpus: list, index_dir: Path | None):  # -> DenseRetriever
    from orthrus_rag.retrievers import DenseRetriever

    doc, query = _pooling(cfg, backend)
    embedder = backend.embedder(doc, query)
    r = cfg.retriever
    if r.index_dir is not None:
        logger.info("loading index from %s", r.index_dir)
        return DenseRetriever.load(r.index_dir, embedder)
    retriever = DenseRetriever(embedder, index_type=r.index_type, nlist=r.nlist, nprobe=r.nprobe, hnsw_m=r.hnsw_m)
    logger.info("embedding %d passages into a %s index", len(corpus), r.index_type)
    retriever.build(corpus)
    if index_dir is not None:
        retriever.save(index_dir)
    return retriever


def index(cfg: Any) -> Path:
    """Build and save the retrieval index of a dataset's corpus (`orthrus-rag index`)."""
    from orthrus_rag.data import build_corpus

    validate(cfg)
    corpus = build_corpus(load_examples(cfg))
    out = Path(cfg.run_dir) / "index"
    backend = build_backend(cfg)
    try:
        build_retriever(cfg, backend, corpus, out)
    finally:
        asyncio.run(backend.aclose())
    logger.info("index of %d passages saved to %s", len(corpus), out)
    return out


def run(cfg: Any, backend: Any = None) -> dict[str, Any]:
    """Answer a dataset's questions with the configured pipeline; write records and a summary to run_dir.

    `backend`: what serves the run (default: built from `cfg.engine`); it is closed at the end either way."""
    from orthrus_rag.data import build_corpus
    from orthrus_rag.params import SamplingParams
    from orthrus_rag.pipelines import IterRetGen, summarize, write_run

    closed = False

    async def _close() -> None:
        nonlocal closed
        if backend is not None and not closed:
            closed = True
            await backend.aclose()

    try:
        validate(cfg)  # before any model loads
        examples = load_examples(cfg)
        run_dir = Path(cfg.run_dir)
        backend = backend if backend is not None else build_backend(cfg)
        retriever = None
        if cfg.pipeline.name != "no_retrieval":
            # NOTE: built before the async loop starts, so the corpus embeds with blocking calls
            retriever = build_retriever(cfg, backend, build_corpus(examples), run_dir / "index")
        p = cfg.pipeline
        iterations = 1 if p.name == "standard_rag" else p.iterations
        pipeline = IterRetGen(backend.generator, retriever, iterations=iterations, k=cfg.retriever.k,
                              sampling_params=SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature),
                              chat_template=backend.tokenizer if p.chat_template else None,
                              max_concurrency=p.max_concurrency)
        backend.start()

        async def _main() -> tuple[list, float]:
            try:
                start = time.perf_counter()
                records = await pipeline.run(examples, progress=cfg.progress)
                return records, time.perf_counter() - start  # NOTE: not counting the shutdown of workers
            finally:
                await _close()

        records, wall = asyncio.run(_main())
    finally:
        if not closed:  # a failure before the pipeline ran: release workers and peers too
            asyncio.run(_close())
    summary = summarize(records, wall)
    stats = backend.stats()
    if stats is not None:
        summary["engine"] = stats
    summary["config"] = {"dataset": cfg.dataset.name, "model": cfg.model.name,
                         "embedding_model": cfg.model.embedding_model, "policy": cfg.engine.policy,
                         "serving": backend.name, "pipeline": p.name, "iterations": iterations,
                         "k": cfg.retriever.k}
    write_run(run_dir, records, summary)
    if hasattr(backend, "steps"):
        (run_dir / "steps.jsonl").write_text("".join(json.dumps(vars(s)) + "\n" for s in backend.steps()))
    return summary
