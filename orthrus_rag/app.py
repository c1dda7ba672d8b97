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

    m, e = cfg.model, cfg.engine
    return Engine.from_pretrained(
        m.name, embedding_adapter=m.embedding_adapter, embedding_model=m.embedding_model, dtype=m.dtype,
        device=m.device, num_threads=m.num_threads, seed=cfg.seed, policy=e.policy,
        max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
        max_chunk_tokens=e.max_chunk_tokens, min_share=e.min_share, block_size=e.block_size,
        kv_cache_gib=e.kv_cache_gib)


def _pooling(cfg: Any, engine: Any) -> tuple[Any, Any]:
    """Document and query pooling: the encoder's own pooling, or the configured one on the backbone."""
    from orthrus_rag.params import PoolingParams

    if cfg.model.embedding_model is not None:
        base = dict(engine.encoder_pooling)
    else:
        base = {"pooling": cfg.retriever.pooling, "normalize": True}
    # NOTE: corpora hold passages longer than an encoder's window; cut them as sentence-transformers does
    return (PoolingParams(**base, truncate=True),
            PoolingParams(**base, instruction=cfg.retriever.query_instruction, truncate=True))


def build_retriever(cfg: Any, engine: Any, corpus: list, index_dir: Path | None):  # -> DenseRetriever
    from orthrus_rag.retrievers import DenseRetriever, EngineEmbedder

    doc, query = _pooling(cfg, getattr(engine, "engine", engine))
    embedder = EngineEmbedder(engine, document_params=doc, query_params=query)
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
    build_retriever(cfg, build_engine(cfg), corpus, out)
    logger.info("index of %d passages saved to %s", len(corpus), out)
    return out


def run(cfg: Any) -> dict[str, Any]:
    """Answer a dataset's questions with the configured pipeline; write records and a summary to run_dir."""
    from orthrus_rag.data import build_corpus
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.stats import summarize_steps
    from orthrus_rag.params import SamplingParams
    from orthrus_rag.pipelines import IterRetGen, summarize, write_run

    validate(cfg)  # before any model loads
    examples = load_examples(cfg)
    run_dir = Path(cfg.run_dir)
    engine = build_engine(cfg)
    aengine = AsyncEngine(engine, max_pending=cfg.engine.max_pending)
    retriever = None
    if cfg.pipeline.name != "no_retrieval":
        # NOTE: built before the async loop starts, so the corpus embeds on the engine directly
        retriever = build_retriever(cfg, aengine, build_corpus(examples), run_dir / "index")
    p = cfg.pipeline
    iterations = 1 if p.name == "standard_rag" else p.iterations
    pipeline = IterRetGen(aengine, retriever, iterations=iterations, k=cfg.retriever.k,
                          sampling_params=SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature),
                          chat_template=engine.tokenizer if p.chat_template else None,
                          max_concurrency=p.max_concurrency)
    first_step = engine.num_steps

    async def _main() -> list:
        try:
            return await pipeline.run(examples, progress=cfg.progress)
        finally:
            await aengine.shutdown()

    start = time.perf_counter()
    records = asyncio.run(_main())
    wall = time.perf_counter() - start
    summary = summarize(records, wall)
    steps = [s for s in engine.step_stats if s.step >= first_step]
    summary["engine"] = summarize_steps(steps)
    summary["config"] = {"dataset": cfg.dataset.name, "model": cfg.model.name,
                         "embedding_model": cfg.model.embedding_model, "policy": cfg.engine.policy,
                         "pipeline": p.name, "iterations": iterations, "k": cfg.retriever.k}
    write_run(run_dir, records, summary)
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(vars(s)) + "\n" for s in steps))
    return summary
