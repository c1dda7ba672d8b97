"""What serves a pipeline run (`deploy.mode`): the one co-scheduled engine, or a two-process deployment, or
(in the benchmarks) a peer such as vLLM. A `Backend` hands the pipeline a generation client, embedders and the tokenizer
whose chat template renders prompts, so `app.run` is the same code for all of them."""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orthrus_rag.params import PoolingParams

if TYPE_CHECKING:
    from orthrus_rag.engine.clients import ClientBridge

logger = logging.getLogger(__name__)
SERVINGS = ("engine", "dedicated", "disagg-pd")


class Backend:
    """The interface; see `EngineBackend` and `ClientBackend`."""

    name: str
    tokenizer: Any  # the generation model's tokenizer (chat template)
    encoder_pooling: dict  # the separate embedding model's own pooling; {} when embeddings come from the backbone

    @property
    def client(self) -> Any:  # has `async generate(prompt, params)`: what a pipeline's generations go through
        raise NotImplementedError

    def embedder(self, document_params: PoolingParams, query_params: PoolingParams) -> Any:
        raise NotImplementedError

    @property
    def max_in_flight(self) -> int:
        """Requests it admits at once without refusing any (what a pipeline's concurrency is sized from)."""
        raise NotImplementedError

    def observe_steps(self, observer: Callable[[Any], None]) -> bool:
        """Call `observer` with every engine step's `StepStats` until `aclose`; False where steps are not seen."""
        return False

    def start(self) -> None:
        """Mark where the measured run begins (for `stats`)."""

    def stats(self) -> dict[str, Any] | None:
        """Per-step statistics of the run since `start`, where the backend can see its steps."""
        return None

    async def aclose(self) -> None:
        raise NotImplementedError


class EngineBackend(Backend):
    """One in-process `Engine` behind an `AsyncEngine`: embeddings and generations share its steps."""

    def __init__(self, engine: Any, max_in_flight: int = 8192) -> None:
        from orthrus_rag.engine.async_engine import AsyncEngine

        self.name = f"engine ({engine.config.scheduler.policy})"
        self.engine = engine
        self.aengine = AsyncEngine(engine, max_in_flight=max_in_flight)
        self.tokenizer = engine.tokenizer
        self.encoder_pooling = dict(engine.encoder_pooling)
        self._first_hits = 0
        self._observers: list[Callable[[Any], None]] = []
        self._steps: Any = None  # a StepAggregator from `start` on

    @property
    def client(self) -> Any:
        return self.aengine

    @property
    def max_in_flight(self) -> int:
        return self.aengine.max_in_flight

    def observe_steps(self, observer: Callable[[Any], None]) -> bool:
        self.engine.step_observers.append(observer)
        self._observers.append(observer)
        return True

    def embedder(self, document_params: PoolingParams, query_params: PoolingParams) -> Any:
        from orthrus_rag.retrievers import EngineEmbedder

        return EngineEmbedder(self.aengine, document_params=document_params, query_params=query_params)

    def start(self) -> None:
        from orthrus_rag.engine.stats import StepAggregator

        self._first_hits = getattr(self.engine.block_manager, "num_hit_tokens", 0)
        if self._steps is None:
            self._steps = StepAggregator()
            self.observe_steps(self._steps.add)

    def stats(self) -> dict[str, Any] | None:
        if self._steps is None:
            return None
        stats = self._steps.summary()
        hits = getattr(self.engine.block_manager, "num_hit_tokens", None)
        if hits is not None:  # prefix caching on: prompt tokens served from cached blocks
            stats["prefix_cache_hit_tokens"] = hits - self._first_hits
        return stats

    async def aclose(self) -> None:
        await self.aengine.shutdown()
        for observer in self._observers:  # NOTE: the engine may outlive this backend (a shared test engine)
            self.engine.step_observers.remove(observer)
        self._observers.clear()


class ClientBackend(Backend):
    """A `ServingClient` (a deployment's workers, a peer) behind a `ClientBridge`.

    `kind` names who computes the embeddings (part of an index's identity): "engine" when the workers run this
    project's engine (so an index built in-process serves here too), else the peer's name."""

    def __init__(self, name: str, bridge: "ClientBridge", tokenizer: Any, model: str,
                 embedding_model: str | None = None, adapters: list[str] | None = None,
                 encoder_pooling: dict | None = None, kind: str = "engine") -> None:
        self.name, self.bridge, self.tokenizer = name, bridge, tokenizer
        self.model, self.embedding_model, self.adapters, self.kind = model, embedding_model, adapters or [], kind
        self.encoder_pooling = dict(encoder_pooling or {})

    @property
    def client(self) -> Any:
        return self.bridge

    @property
    def max_in_flight(self) -> int:
        return self.bridge.max_in_flight

    def embedder(self, document_params: PoolingParams, query_params: PoolingParams) -> Any:
        from orthrus_rag.retrievers import ClientEmbedder

        from orthrus_rag.engine.routing import route_embedding

        # NOTE: the workers' engines name each adapter after its folder, in load order (slots from 1)
        slots = {Path(a).name: i for i, a in enumerate(self.adapters, start=1)}
        route = route_embedding(document_params, self.embedding_model is not None, slots)
        return ClientEmbedder(self.bridge, self.model, self.embedding_model if route.on_encoder else None,
                              kind=self.kind, adapters=self.adapters, adapter=route.adapter,
                              document_params=document_params, query_params=query_params)

    async def aclose(self) -> None:
        import asyncio

        await asyncio.to_thread(self.bridge.shutdown)  # joins threads and worker processes: off the loop


def encoder_pooling_of(embedding_model: str | None) -> dict:
    """The sentence-transformers pooling a separate embedding model ships with ({} for none)."""
    if embedding_model is None:
        return {}
    from orthrus_rag.models.bert import read_sentence_transformers_pooling
    from orthrus_rag.models.registry import resolve_model_path

    return read_sentence_transformers_pooling(resolve_model_path(embedding_model))


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from orthrus_rag.models.registry import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(model)))


def deployment_backend(serving: str, config: Any, threads: tuple[int, ...]) -> ClientBackend:
    """`dedicated` or `disagg-pd` workers built from an `EngineConfig`, behind a bridge."""
    from orthrus_rag.engine.clients import ClientBridge
    from orthrus_rag.engine.deploy import DEPLOYMENTS

    deployment = DEPLOYMENTS[serving](config, threads)
    mc = config.model
    try:
        tokenizer = load_tokenizer(mc.name)
        encoder_pooling = encoder_pooling_of(mc.embedding_model)
    except BaseException:
        deployment.shutdown()
        raise
    return ClientBackend(f"{serving} {threads}", ClientBridge(deployment, name=f"{serving}-bridge"), tokenizer,
                         mc.name, mc.embedding_model, list(mc.embedding_adapters), encoder_pooling)
