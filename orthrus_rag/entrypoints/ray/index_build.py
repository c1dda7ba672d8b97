"""`orthrus-rag index deploy=ray`: the corpus read as a Ray Dataset and embedded by a pool of engines, for corpora
that outgrow one machine's embedding rate.

The corpus file is read by Ray Data (`read_json` for `corpus=jsonl`, `read_parquet` for `corpus=hf` over parquet
`data_files`; the other kinds, read here as `iter_corpus` reads them, enter as items), each record becomes a passage
by the rule `corpus=jsonl` uses, and `map_batches` embeds them over an actor pool of `deploy.replicas` engines
(`ActorPoolStrategy`, `deploy.num_threads` CPUs each, `deploy.gpus_per_replica` GPUs). The driver takes the
batches back in corpus order (Ray Data's `preserve_order`), cut into the build's shards, and the `IndexBuilder`
writes and assembles them exactly as a one-process build does: the same shards, the same passages, and vectors
equal to the one-process build's within the dtype's tolerance (batches are composed differently). The driver
loads no model: one Ray task reads the embedder's identity (what a query must match) from a replica's engine.

A resumed build reads the corpus again and drops the passages already embedded before they reach the actors
(`split_at_indices`, which holds the corpus's text, not its vectors, in Ray's object store meanwhile).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from orthrus_rag.data.types import Passage

logger = logging.getLogger(__name__)


class IdentityOnly:
    """The `Embedder` an IndexBuilder needs on the driver: what built the vectors, no model (the actors embed)."""

    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = identity

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        raise RuntimeError("a Ray build embeds on its actors, not on the driver")

    embed_query = aembed_documents = aembed_query = embed_documents  # type: ignore[assignment]


class EmbedActor:
    """One engine of the pool: `__call__` embeds a batch's passages (title and text, as `Passage.contents`)."""

    def __init__(self, cfg_yaml: str) -> None:
        from omegaconf import OmegaConf

        from orthrus_rag.config.build import engine_config_from
        from orthrus_rag.engine.async_engine import AsyncEngine
        from orthrus_rag.engine.engine import Engine
        from orthrus_rag.entrypoints.embedding import build_embedder
        from orthrus_rag.memory import bound_shape_caches

        cfg = OmegaConf.create(cfg_yaml)
        bound_shape_caches()  # NOTE: a build's steps never repeat a shape (orthrus_rag/memory.py)
        self.client = AsyncEngine(Engine.from_config(engine_config_from(cfg)))
        self.embedder = build_embedder(cfg, self.client, batch_size=cfg.retriever.shard_size)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [Passage(str(i), str(t), str(x)).contents for i, t, x in zip(batch["id"], batch["title"],
                                                                               batch["text"])]
        return {**batch, "vector": self.embedder.embed_documents(texts)}


def embedder_identity(cfg_yaml: str) -> dict[str, Any]:
    """What the actors' vectors are (a Ray task, so the driver loads no model)."""
    actor = EmbedActor(cfg_yaml)
    identity = dict(actor.embedder.identity)
    import asyncio

    asyncio.run(actor.client.aclose())
    return identity


def _passage_row(conf: dict[str, Any]):
    from orthrus_rag.data.corpus import CorpusError, _row_passage

    def row(record: dict[str, Any]) -> dict[str, Any]:
        pid = record.get(conf["id_field"] or "id")
        if pid is None:  # NOTE: a record's line number (a one-process build's fallback id) is not known here
            raise CorpusError(f"a Ray build needs every record's id (field {conf['id_field'] or 'id'!r}; set "
                              f"corpus.id_field); this one has {', '.join(sorted(record))}")
        p = _row_passage(record, str(pid), conf["id_field"], conf["title_field"], conf["text_field"])
        return {"id": p.id, "title": p.title, "text": p.text}

    return row


def corpus_dataset(corpus: Any, contexts: Any, count_tokens: Any) -> Any:
    """The corpus as a Ray Dataset of id / title / text rows, in corpus order."""
    import ray

    from orthrus_rag.data.corpus import iter_corpus

    fields = {k: getattr(corpus, k) for k in ("id_field", "title_field", "text_field")}
    if corpus.kind == "jsonl":
        ds = ray.data.read_json(str(corpus.path), lines=True).map(_passage_row(fields))
    elif corpus.kind == "hf" and corpus.hub_id == "parquet" and corpus.data_files:
        ds = ray.data.read_parquet(list(corpus.data_files)).map(_passage_row(fields))
    else:  # NOTE: the dataset's paragraphs, a folder cut by the splitter, a hub dataset: read as one build reads them
        ds = ray.data.from_items([{"id": p.id, "title": p.title, "text": p.text}
                                  for p in iter_corpus(corpus, contexts, count_tokens)])
    return ds.limit(corpus.limit) if corpus.limit is not None and corpus.kind in ("jsonl", "hf") else ds


def embedded_shards(ds: Any, cfg_yaml: str, shard_size: int, replicas: int, cpus: float, gpus: float):
    """`IndexBuilder.build`'s `embedded`: given the passages done, the rest embedded by the actor pool, in
    shards of `shard_size`, in corpus order."""

    def shards(skip: int) -> Iterator[tuple[list[Passage], np.ndarray]]:
        import ray

        rest = ds.split_at_indices([skip])[1] if skip else ds
        vectors = rest.map_batches(EmbedActor, fn_constructor_args=(cfg_yaml,), batch_size=shard_size,
                                   compute=ray.data.ActorPoolStrategy(size=replicas), num_cpus=cpus,
                                   num_gpus=gpus or None, batch_format="numpy", udf_modifying_row_count=False)
        for batch in vectors.iter_batches(batch_size=shard_size, batch_format="numpy"):
            passages = [Passage(str(i), str(t), str(x)) for i, t, x in zip(batch["id"], batch["title"],
                                                                            batch["text"])]
            yield passages, np.ascontiguousarray(np.stack(batch["vector"]), dtype=np.float32)

    return shards


def build_on_ray(cfg: Any, make_builder: Any, contexts: Any, count_tokens: Any, total: int | None):
    """The configured corpus indexed on Ray (joining `deploy.ray_address`, else a local Ray of
    `deploy.ray_num_cpus` CPUs, at least one more than the actors hold, stopped at the end) by the `IndexBuilder` that `make_builder(embedder)` gives."""
    import ray
    from omegaconf import OmegaConf

    from orthrus_rag.entrypoints.ray.app import _init_ray

    d, r = cfg.deploy, cfg.retriever
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    cpus = float(d.num_threads or 1)
    num_cpus = d.ray_num_cpus
    if d.ray_address is None:
        # NOTE: the actors hold their CPUs for the whole build; Ray Data's read and map tasks need one more, or
        # they wait forever (a 2-CPU local Ray with 2 one-CPU actors deadlocked)
        num_cpus = max(num_cpus or os.cpu_count() or 1, int(math.ceil(d.replicas * cpus)) + 1)
    started = _init_ray(d.ray_address, num_cpus)
    try:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        identity = ray.get(ray.remote(num_cpus=cpus, num_gpus=d.gpus_per_replica or None)(embedder_identity)
                           .remote(cfg_yaml))
        builder = make_builder(IdentityOnly(identity))
        ds = corpus_dataset(cfg.corpus, contexts, count_tokens)
        logger.info("indexing on Ray: %d engine actor(s), %g CPU(s) each", d.replicas, cpus)
        return builder.build(None, total=total, embedded=embedded_shards(ds, cfg_yaml, r.shard_size, d.replicas,
                                                                          cpus, d.gpus_per_replica))
    finally:
        if started:
            ray.shutdown()
