"""What `orthrus-rag run` and `orthrus-rag index` do, as plain functions of a composed config (tests call them
directly; the Hydra entry points in cli.py are thin)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from orthrus_rag.engine.clients.protocol import execution_plan
from orthrus_rag.entrypoints.checks import validate
from orthrus_rag.entrypoints.clients import build_client
from orthrus_rag.entrypoints.embedding import build_embedder, on_encoder

logger = logging.getLogger(__name__)


def load_examples(cfg: Any) -> list:
    from orthrus_rag.data import load_qa, make_synthetic

    d = cfg.dataset
    if d.name == "synthetic" and d.path is None:
        examples = make_synthetic(num_questions=d.num_questions, seed=d.seed)
        return examples[: d.limit] if d.limit else examples
    return load_qa(d.name, path=d.path, hub_id=d.hub_id, split=d.split, limit=d.limit)


def build_retriever(cfg: Any, client: Any, examples: list, index_dir: Path | None,
                    reuse: bool = False):  # -> Retriever (retrievers/kinds.py)
    """The configured retriever (`retriever.kind`: dense, bm25 or hybrid): `retriever.index_dir` opened; else
    built over the configured corpus into `index_dir`. The dataset's own paragraphs (`corpus=contexts`) index in
    memory (a dense index reused on a resumed run when the folder holds the same passages); any other corpus
    streams through the resumable `IndexBuilder`."""
    from orthrus_rag.entrypoints.checks import sparse_settings
    from orthrus_rag.retrievers.kinds import build_in_memory, open_retriever

    r = cfg.retriever
    embedder = build_embedder(cfg, client) if r.kind != "bm25" else None
    settings = sparse_settings(r)
    if r.index_dir is not None:
        logger.info("opening the %s index in %s", r.kind, r.index_dir)
        return open_retriever(r.index_dir, r.kind, embedder, settings, {"nprobe": r.nprobe, "ef_search": r.ef_search})
    if cfg.corpus.kind != "contexts":
        if index_dir is None:
            raise ValueError(f"corpus={cfg.corpus.kind} needs a folder to build its index in, or retriever.index_dir")
        _build_index(cfg, client, embedder, examples, index_dir)
        return open_retriever(index_dir, r.kind, embedder, settings)
    from orthrus_rag.data import build_corpus

    corpus = build_corpus(examples)
    dense = _dense_in_memory(cfg, embedder, corpus, index_dir, reuse) if embedder is not None else None
    return build_in_memory(corpus, r.kind, dense, settings)


def _dense_in_memory(cfg: Any, embedder: Any, corpus: list, index_dir: Path | None, reuse: bool):  # -> DenseRetriever
    from orthrus_rag.retrievers import DenseRetriever

    r = cfg.retriever
    if reuse and index_dir is not None and index_dir.is_dir():
        try:
            retriever = DenseRetriever.load(index_dir, embedder)
            if [p.title for p in retriever.passages] == [p.title for p in corpus]:
                logger.info("reusing the index saved in %s", index_dir)
                return retriever
            logger.warning("the index in %s holds other passages; rebuilding it", index_dir)
        except ValueError as exc:  # NOTE: e.g. the previous session was killed while saving it
            logger.warning("cannot reuse the index in %s (%s); rebuilding it", index_dir, exc)
    retriever = DenseRetriever(embedder, index_type=r.index_type, nlist=r.nlist, nprobe=r.nprobe, hnsw_m=r.hnsw_m,
                               ef_search=r.ef_search, factory=r.factory, train_size=r.train_size)
    logger.info("embedding %d passages into a %s index", len(corpus), r.index_type)
    retriever.build(corpus)
    if index_dir is not None:
        retriever.save(index_dir)
    return retriever


def _build_index(cfg: Any, client: Any, embedder: Any, examples: list | None, folder: Path):  # -> BuildReport
    """The configured corpus through the resumable, sharded `IndexBuilder` into `folder` (no embedder: BM25
    only)."""
    from orthrus_rag.data.corpus import count_passages, iter_corpus

    tokenizer = getattr(client, "tokenizer", None)
    count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer is not None else None
    builder = _builder(cfg, embedder, folder)
    return builder.build(iter_corpus(cfg.corpus, lambda: _contexts(cfg, examples), count),
                         total=count_passages(cfg.corpus))


def _contexts(cfg: Any, examples: list | None) -> list:
    """`corpus=contexts`: the dataset's own paragraphs."""
    from orthrus_rag.data import build_corpus

    return build_corpus(examples if examples is not None else load_examples(cfg))


def _builder(cfg: Any, embedder: Any, folder: Path):  # -> IndexBuilder
    """The configured index's builder into `folder` (`embedder` None: BM25 only)."""
    from orthrus_rag.data.corpus import corpus_identity
    from orthrus_rag.entrypoints.checks import sparse_settings
    from orthrus_rag.retrievers.faiss_index import IndexSpec
    from orthrus_rag.retrievers.index_build import IndexBuilder

    r = cfg.retriever
    spec = IndexSpec(r.index_type, nlist=r.nlist, nprobe=r.nprobe, hnsw_m=r.hnsw_m, ef_search=r.ef_search,
                     factory=r.factory, train_size=r.train_size)
    sparse = sparse_settings(r).bm25() if r.kind != "dense" else None
    return IndexBuilder(folder, embedder, spec, corpus_identity(cfg.corpus), shard_size=r.shard_size,
                        on_disk=r.on_disk, seed=cfg.seed, progress=cfg.progress, sparse=sparse)


# an index build's steps carry embeddings only: no decode's latency to protect, so they are as large as a serving
# step is not (the scheduler's defaults, 256 tokens and 64 sequences, are for mixed serving)
INDEX_STEP_TOKENS, INDEX_STEP_SEQS = 4096, 256
# ... and it decodes nothing, so its KV cache holds only the backbone embeddings in flight: two full steps' tokens
# keep the steps full (the serving default, 1 GiB, was over a third of a build's resident memory:
# docs/benchmarks/corpus-embedding.md).
# Embeddings on a separate encoder hold no KV at all (it attends within a step): one block.
INDEX_KV_TOKENS = 2 * INDEX_STEP_TOKENS


def _index_engine(cfg: Any) -> None:
    """An index build's engine settings: embedding-only steps (at least INDEX_STEP_TOKENS tokens and
    INDEX_STEP_SEQS sequences) and, unless `cache.num_blocks` is set, a KV cache of what those steps use; oneDNN's
    per-shape caches off (a build's steps never repeat a shape: orthrus_rag/memory.py)."""
    from orthrus_rag.memory import bound_shape_caches

    bound_shape_caches()  # NOTE: before the engine loads: oneDNN reads these once, at its first primitive
    s, c = cfg.scheduler, cfg.cache
    s.max_num_batched_tokens = max(s.max_num_batched_tokens, INDEX_STEP_TOKENS)
    s.max_num_seqs = max(s.max_num_seqs, INDEX_STEP_SEQS)
    if c.num_blocks is None:
        c.num_blocks = 1 if on_encoder(cfg) or cfg.retriever.kind == "bm25" else -(-INDEX_KV_TOKENS // c.block_size)


def index(cfg: Any) -> Path:
    """Build and save the retrieval index of the configured corpus (`orthrus-rag index`): streamed in shards of
    `retriever.shard_size` passages, each embedded as one batch in embedding-only steps (`_index_engine`);
    `resume=<run_dir>` continues a killed build from its last finished shard. The run folder keeps config.yaml, so
    a bare `resume=` knows the corpus. A finished folder resumed with another `retriever=` (another FAISS index,
    or hybrid to add BM25) assembles that index from the stored shards: nothing is embedded again."""
    from omegaconf import OmegaConf

    from orthrus_rag.atomic import atomic_write
    from orthrus_rag.pipelines.run_store import CONFIG

    validate(cfg)
    _index_engine(cfg)
    folder = Path(cfg.resume or cfg.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / CONFIG).is_file():
        (folder / CONFIG).write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    out = folder / "index"
    if cfg.deploy.mode == "ray":
        report = _build_on_ray(cfg, out)
    else:
        report = _build_here(cfg, out)
    with atomic_write(folder / CONFIG, "w") as f:  # NOTE: what built the folder last, for the next bare resume=
        f.write(OmegaConf.to_yaml(cfg))
    logger.info("index of %d passages saved to %s (%d shards, %d resumed; %.1f passages/s)", report.num_passages,
                out, report.num_shards, report.resumed_shards, report.passages_per_s)
    return out


def _build_on_ray(cfg: Any, out: Path):  # -> BuildReport
    """The corpus read by Ray Data and embedded by an actor pool of engines (entrypoints/ray/index_build.py)."""
    from orthrus_rag.entrypoints.ray.index_build import build_on_ray

    if cfg.retriever.kind == "bm25":
        raise ValueError("deploy=ray embeds on a pool of engines; retriever.kind=bm25 embeds nothing (build it "
                         "without deploy=ray)")
    count = None
    if cfg.corpus.kind == "files":  # NOTE: the splitter counts the generation model's tokens, as a local build
        from orthrus_rag.engine.clients.deployment_client import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.name)
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    from orthrus_rag.data.corpus import count_passages

    return build_on_ray(cfg, lambda embedder: _builder(cfg, embedder, out), lambda: _contexts(cfg, None), count,
                        count_passages(cfg.corpus))


def _build_here(cfg: Any, out: Path):  # -> BuildReport
    client = build_client(cfg)
    try:
        # NOTE: a shard is one batch: the engine's steps are embedding-only and full while it builds
        embedder = (build_embedder(cfg, client, batch_size=cfg.retriever.shard_size)
                    if cfg.retriever.kind != "bm25" else None)
        return _build_index(cfg, client, embedder, None, out)
    finally:
        asyncio.run(client.aclose())


def build_pipeline(cfg: Any, client: Any, retriever: Any):  # -> Method
    from orthrus_rag.params import SamplingParams
    from orthrus_rag.pipelines import default_concurrency
    from orthrus_rag.pipelines.registry import make_method

    p = cfg.pipeline
    admitted = default_concurrency(client.max_in_flight)
    concurrency = p.max_concurrency or default_concurrency(client.max_in_flight, cfg.scheduler.max_num_seqs)
    if concurrency > admitted:  # NOTE: more would fail questions with EngineQueueFull; let them wait instead
        logger.warning("pipeline.max_concurrency=%d is more than %s admits (%d questions); using %d",
                       concurrency, client.name, admitted, admitted)
        concurrency = admitted
    own = {"iter_retgen": {"iterations": p.iterations},
           "ircot": {"max_steps": p.max_steps, "max_passages": p.max_passages, "step_tokens": p.step_tokens},
           "flare": {"max_steps": p.max_steps, "threshold": p.threshold, "step_tokens": p.step_tokens},
           "self_ask": {"max_follow_ups": p.max_follow_ups, "step_tokens": p.step_tokens,
                        "force_follow_up": p.force_follow_up},
           "search_r1": {"max_searches": p.max_searches, "min_searches": p.min_searches,
                         "step_tokens": p.step_tokens, "tags": p.tags,
                         "constrain_format": p.constrain_format, "continuation": p.continuation}}.get(p.name, {})
    reranker = None
    if p.reranker is not None and retriever is not None:
        from orthrus_rag.pipelines.rerank import Reranking

        reranker = Reranking(client, p.reranker, cfg.retriever.k)
    return make_method(p.name, client, retriever, k=p.top_k if reranker is not None else cfg.retriever.k,
                       reranker=reranker,
                       chat_template=client.tokenizer if p.chat_template else None,
                       sampling_params=SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                                      adapter=p.generation_adapter),
                       max_concurrency=concurrency, question_timeout_s=p.question_timeout_s,
                       answer_format=p.answer_format, prompt_style=p.prompt_style, **own)


def _iterations(cfg: Any) -> int:
    """The most generations a question runs: Iter-RetGen's iterations (standard RAG: 1), IRCoT's and FLARE's step
    limit, Self-Ask's follow-ups and its answer."""
    p = cfg.pipeline
    limits = {"standard_rag": 1, "ircot": p.max_steps, "flare": p.max_steps, "self_ask": p.max_follow_ups + 1,
              "search_r1": p.max_searches + 1}
    return limits.get(p.name, p.iterations)


def run_labels(cfg: Any, client: Any, max_concurrency: int) -> dict[str, Any]:
    """What a run is, for its summary and for `orthrus-rag summarize` tables."""
    d = cfg.dataset
    return {"dataset": d.name, "dataset_path": d.path, "limit": d.limit, "corpus": cfg.corpus.kind,
            "corpus_path": cfg.corpus.path or cfg.corpus.hub_id, "model": cfg.model.name,
            "embedding_model": cfg.model.embedding_model, "policy": cfg.scheduler.policy, "serving": client.name,
            "pipeline": cfg.pipeline.name, "iterations": _iterations(cfg), "retriever": cfg.retriever.kind,
            "index_type": cfg.retriever.index_type,
            "k": cfg.retriever.k, "max_concurrency": max_concurrency, "answer_format": cfg.pipeline.answer_format,
            "prompt_style": cfg.pipeline.prompt_style,
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
    examples = load_examples(cfg)
    remaining = session.remaining(examples)
    if not remaining:
        logger.info("every question of %s is recorded already", session.folder)
        return
    logger.info("answering %d questions with %s; records.jsonl and summary.json go to %s", len(remaining),
                cfg.pipeline.name, session.folder)
    if closing.client is None:
        closing.client = build_client(cfg)
    client = closing.client
    from orthrus_rag.pipelines.run_store import PLAN

    if (plan := execution_plan(client)) is not None:  # NOTE: a deployment's workers each have their own
        session.store.write_atomic(PLAN, plan.dumps())
    retriever = None
    if cfg.pipeline.name != "no_retrieval":
        # NOTE: built before the async loop starts, so the corpus embeds with blocking calls
        retriever = build_retriever(cfg, client, examples, session.folder / "index", reuse=cfg.resume is not None)
    report = None
    if cfg.ingest.path is not None:
        from orthrus_rag.entrypoints.ingest import IngestReport, as_live

        # NOTE: adds land in the index's own folder: retriever.index_dir, else the run's index/
        retriever = as_live(retriever, Path(cfg.retriever.index_dir or session.folder / "index"))
        report = IngestReport()
    pipeline = build_pipeline(cfg, client, retriever)
    session.labels = run_labels(cfg, client, pipeline.max_concurrency)
    # NOTE: None (no step rows) where the steps run in other processes
    closing.stop_observing = client.observe_steps(session.observe)
    session.begin()

    async def answer() -> None:
        ingesting = None
        if report is not None:
            from orthrus_rag.entrypoints.ingest import ingest, ingest_passages

            i = cfg.ingest
            ingesting = asyncio.ensure_future(ingest(retriever, ingest_passages(i), i.batch_size, i.truncate, report))
        try:
            async with contextlib.aclosing(pipeline.stream(remaining)) as records:
                with session.progress():
                    async for rec in records:
                        session.record(rec)
            if ingesting is not None:
                if not ingesting.done():
                    logger.info("the questions are answered; waiting for the ingest (%d documents added)",
                                report.added)
                await ingesting
        finally:
            if ingesting is not None and not ingesting.done():
                ingesting.cancel()
                with contextlib.suppress(BaseException):
                    await ingesting
            session.ingest = report.to_dict() if report is not None else None
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
