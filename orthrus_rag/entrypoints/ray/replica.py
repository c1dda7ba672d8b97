"""`EngineReplica`: one engine and its asyncio loop inside a Ray Serve replica; its methods are what the ingress
and a run's client call through the deployment handle. Results are the engine's own outputs (pickled by Ray)."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput, ScoreOutput
from orthrus_rag.params import PoolingParams, RerankParams, SamplingParams

logger = logging.getLogger(__name__)


def _replica_tag() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 (outside Serve: a plain object, as in a unit test)
        return "local"


class EngineReplica:
    """Built by Ray Serve in each replica's process from the engine's config (`EngineConfig`, picklable)."""

    def __init__(self, engine_config: Any, max_in_flight: int) -> None:
        from orthrus_rag.engine.async_engine import AsyncEngine
        from orthrus_rag.engine.engine import Engine

        self.engine = Engine.from_config(engine_config)
        self.aengine = AsyncEngine(self.engine, max_in_flight=max_in_flight)
        self.tag = _replica_tag()
        # NOTE: the replica's own Prometheus figures (steps, KV blocks, requests), published to the board
        from orthrus_rag.entrypoints.openai.metrics import ServerMetrics
        from orthrus_rag.entrypoints.ray.board import publish_forever

        self.metrics = ServerMetrics(self.aengine, pending=lambda: self.aengine.num_in_flight,
                                     block_manager=self.engine.block_manager)
        self._stop = threading.Event()
        publish_forever(self.tag, self.metrics.render, self._stop)
        logger.info("engine replica %s ready: %s", self.tag, engine_config.model.name)

    # ---- what the ingress asks once ------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {"embedding_space": self.engine.embedding_space, "max_in_flight": self.aengine.max_in_flight,
                "reranker_names": self.aengine.reranker_names}

    # ---- requests ---------------------------------------------------------------------------------------------------
    # NOTE: request ids carry the replica's tag ("<replica>/<id>"): which replica served what, for logs and tests
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationOutput:
        return self._tagged(await self.aengine.generate(prompt, params))

    async def generate_stream(self, prompt: str | Sequence[int],
                              params: SamplingParams | None = None) -> AsyncIterator[GenerationOutput]:
        async for snapshot in self.aengine.generate_stream(prompt, params):
            yield self._tagged(snapshot)

    async def embed(self, text: str | Sequence[int], params: PoolingParams | None = None) -> EmbeddingOutput:
        return self._tagged(await self.aengine.embed(text, params))

    async def embed_many(self, texts: Sequence[str | Sequence[int]],
                         params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        return [self._tagged(o) for o in await self.aengine.embed_many(texts, params)]

    async def score_pairs(self, pairs: Sequence[tuple[str, str]],
                          params: RerankParams | None = None) -> list[ScoreOutput]:
        # NOTE: a rerank call's pairs go to one replica together: its engine packs them beside that replica's
        # decodes, and a call never waits on the slowest of several replicas
        return [self._tagged(o) for o in await self.aengine.score_pairs(pairs, params)]

    def _tagged(self, out: Any) -> Any:
        out.request_id = f"{self.tag}/{out.request_id}"
        return out

    def kv_blocks(self) -> dict[str, Any]:
        """This replica's tag and KV block use (what a test of a lost replica checks for leaks)."""
        bm = self.engine.block_manager
        return {"replica": self.tag, "free": bm.num_free_blocks, "total": bm.num_blocks,
                "unfinished": self.engine.has_unfinished()}

    # ---- what Ray Serve asks -----------------------------------------------------------------------------------
    def record_routing_stats(self) -> dict[str, Any]:
        """The replica's outstanding work for the request router: tokens still to compute (prompt and embedding
        tokens not yet run, and each generation's remaining budget), not request counts."""
        tokens = 0
        try:
            # NOTE: read from Ray's thread while the engine thread steps: a snapshot, approximate by a step
            for req in list(self.engine.scheduler.requests.values()):
                tokens += req.num_remaining_tokens
                if req.sampling_params is not None:
                    tokens += max(0, req.sampling_params.max_tokens - len(req.output_token_ids))
        except RuntimeError:  # the dict changed size while copied: report the requests only
            pass
        return {"outstanding_tokens": tokens, "pending": self.aengine.num_in_flight}

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose check raises: a dead engine thread cannot serve."""
        thread = getattr(self.aengine, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the engine loop thread has stopped")
