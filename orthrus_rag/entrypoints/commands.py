"""What `orthrus-rag run` and `orthrus-rag index` do, as plain functions of a composed config (tests call them
directly; the Hydra entry points in cli.py are thin)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from orthrus_rag.entrypoints.checks import validate
from orthrus_rag.entrypoints.clients import build_client

logger = logging.getLogger(__name__)


def load_examples(cfg: Any) -> list:
    from orthrus_rag.data import load_qa, make_synthetic

    d = cfg.dataset
    if d.name == "synthetic" and d.path is None:
        examples = make_synthetic(num_questions=d.num_questions, seed=d.seed)
        return examples[: d.limit] if d.limit else examples
    return load_qa(d.name, path=d.path, hub_id=d.hub_id, split=d.split, limit=d.limit)


def _pooling(cfg: Any, client: Any) -> tuple[Any, Any]:
    """Document and query pooling: the encoder's own pooling, or the configured one on the backbone."""
    from orthrus_rag.params import PoolingParams

    adapter = cfg.retriever.adapter
    if cfg.model.embedding_model is not None and adapter is None:
        base = dict(client.embedding_space.encoder_pooling)
    else:
        base = {"pooling": cfg.retriever.pooling, "normalize": True}
    # NOTE: corpora hold passages longer than an encoder's window; cut them as sentence-transformers does.
    # A query is what the next hop of a chain waits on: latency-critical (priority < 0) for the orthrus policy
    # An adapter whose card names query / document prefixes gets them by input type (EmbeddingSpace.formatted);
    # retriever.query_instruction, when set, replaces the query's
    return (PoolingParams(**base, truncate=True, adapter=adapter, input_type="document"),
            PoolingParams(**base, instruction=cfg.retriever.query_instruction, truncate=True, priority=-1,
                          adapter=adapter, input_type="query"))


def build_retriever(cfg: Any, client: Any, corpus: list, index_dir: Path | None,
                    reuse: bool = False):  # -> DenseRetriever
    """The configured index: `retriever.index_dir` loaded; on a resumed run the one saved in its folder (rebuilt
    if that is missing or unreadable); else built over `corpus` and saved to `index_dir`."""
    from orthrus_rag.retrievers import DenseRetriever, EngineEmbedder

    doc, query = _pooling(cfg, client)
    embedder = EngineEmbedder(client, doc, query)
    r = cfg.retriever
    if r.index_dir is not None:
        logger.info("loading index from %s", r.index_dir)
        return DenseRetriever.load(r.index_dir, embedder)
    if reuse and index_dir is not None and index_dir.is_dir():
        try:
            retriever = DenseRetriever.load(index_dir, embedder)
            if [p.title for p in retriever.passages] == [p.title for p in corpus]:
                logger.info("reusing the index saved in %s", index_dir)
                return retriever
            logger.warning("the index in %s holds other passages; rebuilding it", index_dir)
        except ValueError as exc:  # NOTE: e.g. the previous session was killed while saving it
            logger.warning("cannot reuse the index in %s (%s); rebuilding it", index_dir, exc)
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
    client = build_client(cfg)
    try:
        build_retriever(cfg, client, corpus, out)
    finally:
        asyncio.run(client.aclose())
    logger.info("index of %d passages saved to %s", len(corpus), out)
    return out


def build_pipeline(cfg: Any, client: Any, retriever: Any):  # -> IterRetGen
    from orthrus_rag.params import SamplingParams
    from orthrus_rag.pipelines import IterRetGen, default_concurrency

    p = cfg.pipeline
    admitted = default_concurrency(client.max_in_flight)
    concurrency = p.max_concurrency or default_concurrency(client.max_in_flight, cfg.scheduler.max_num_seqs)
    if concurrency > admitted:  # NOTE: more would fail questions with EngineQueueFull; let them wait instead
        logger.warning("pipeline.max_concurrency=%d is more than %s admits (%d questions); using %d",
                       concurrency, client.name, admitted, admitted)
        concurrency = admitted
    return IterRetGen(client, retriever, iterations=_iterations(cfg), k=cfg.retriever.k,
                      sampling_params=SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                                     adapter=p.generation_adapter),
                      chat_template=client.tokenizer if p.chat_template else None, max_concurrency=concurrency,
                      question_timeout_s=p.question_timeout_s, answer_format=p.answer_format)


def _iterations(cfg: Any) -> int:
    return 1 if cfg.pipeline.name == "standard_rag" else cfg.pipeline.iterations


def run_labels(cfg: Any, client: Any, max_concurrency: int) -> dict[str, Any]:
    """What a run is, for its summary and for `orthrus-rag summarize` tables."""
    d = cfg.dataset
    return {"dataset": d.name, "dataset_path": d.path, "limit": d.limit, "model": cfg.model.name,
            "embedding_model": cfg.model.embedding_model, "policy": cfg.scheduler.policy, "serving": client.name,
            "pipeline": cfg.pipeline.name, "iterations": _iterations(cfg), "index_type": cfg.retriever.index_type,
            "k": cfg.retriever.k, "max_concurrency": max_concurrency, "answer_format": cfg.pipeline.answer_format,
            "generation_adapter": cfg.pipeline.generation_adapter, "retriever_adapter": cfg.retriever.adapter}


class _Closing:
    """Closes the client exactly once: inside the run's event loop, or afterwards on a failure."""

    def __init__(self, client: Any) -> None:
        self.client, self.closed = client, False
        self.stop_observing: Any = None  # NOTE: the engine may outlive the run (a shared test engine)

    async def aclose(self) -> None:
        if self.stop_observing is not None:
            self.stop_observing()
            self.stop_observing = None
        if self.client is not None and not self.closed:
            self.closed = True
            await self.client.aclose()

    def close(self) -> None:
        if (self.client is not None and not self.closed) or self.stop_observing is not None:
            asyncio.run(self.aclose())


def run(cfg: Any, client: Any = None) -> dict[str, Any]:
    """Answer a dataset's questions with the configured pipeline, recording each into the run folder as it
    finishes (`run_dir`, or the folder `resume` names: its recorded questions are skipped); returns the summary.

    `client`: the `EngineClient` that serves the run (default: built from `cfg.deploy`); it is closed at the end
    either way."""
    from orthrus_rag.entrypoints.run_session import RunSession

    closing = _Closing(client)
    session = None
    try:
        validate(cfg)  # before any model loads
        session = RunSession(cfg.resume or cfg.run_dir, cfg)
        _run_session(cfg, session, closing)
        summary = session.summary()
        session.store.checkpoint(summary)
        return summary
    except BaseException:
        if session is not None:
            _save_partial(session)
        raise
    finally:
        closing.close()
        if session is not None:
            session.close()


def _run_session(cfg: Any, session: Any, closing: _Closing) -> None:
    from orthrus_rag.data import build_corpus

    examples = load_examples(cfg)
    remaining = session.remaining(examples)
    if not remaining:
        logger.info("every question of %s is recorded already", session.folder)
        return
    if closing.client is None:
        closing.client = build_client(cfg)
    client = closing.client
    retriever = None
    if cfg.pipeline.name != "no_retrieval":
        # NOTE: built before the async loop starts, so the corpus embeds with blocking calls
        retriever = build_retriever(cfg, client, build_corpus(examples), session.folder / "index",
                                    reuse=cfg.resume is not None)
    pipeline = build_pipeline(cfg, client, retriever)
    session.labels = run_labels(cfg, client, pipeline.max_concurrency)
    # NOTE: None (no step rows) where the steps run in other processes
    closing.stop_observing = client.observe_steps(session.observe)
    session.begin()

    async def answer() -> None:
        try:
            async with contextlib.aclosing(pipeline.stream(remaining)) as records:
                with session.progress():
                    async for rec in records:
                        session.record(rec)
        finally:
            await closing.aclose()

    asyncio.run(answer())


def _save_partial(session: Any) -> None:
    """After a failure, keep a summary of what was recorded (if the folder still takes one)."""
    from orthrus_rag.pipelines.run_store import RunStoreError

    if session.num_new == 0:
        return
    try:
        session.checkpoint()
    except RunStoreError as exc:
        logger.warning("no summary written: %s", exc)
