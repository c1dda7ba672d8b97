"""Where an embedding runs: the separate encoder, or the decoder backbone with a LoRA adapter (or none).

The one owner of that rule (`route_embedding`); `EmbeddingSpace` carries what a client's embeddings are, so the
engine, the `Embedder` and the server all route through the same function."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orthrus_rag.params import PoolingParams

NO_ADAPTER = ""  # `PoolingParams.adapter` naming the bare backbone (e.g. to score tokens), past any encoder


@dataclass(frozen=True)
class EmbeddingRoute:
    on_encoder: bool
    adapter: str | None = None  # a loaded LoRA adapter's name (backbone only)
    slot: int = 0  # the adapter's slot in the backbone; 0: no adapter

    @property
    def name(self) -> str:
        """"encoder", "decoder" or "decoder+<adapter>"."""
        if self.on_encoder:
            return "encoder"
        return f"decoder+{self.adapter}" if self.adapter else "decoder"


def route_embedding(params: PoolingParams | None, has_encoder: bool,
                    adapter_slots: Mapping[str, int]) -> EmbeddingRoute:
    """The encoder when there is one and `params` name no adapter; else the backbone with the named adapter, or
    the first loaded one (the default embedding adapter), or none. An unknown adapter is a ValueError."""
    adapter = params.adapter if params is not None else None
    if adapter == NO_ADAPTER:
        return EmbeddingRoute(on_encoder=False)
    if has_encoder and adapter is None:
        return EmbeddingRoute(on_encoder=True)
    name = adapter or next(iter(adapter_slots), None)
    if name is None:
        return EmbeddingRoute(on_encoder=False)
    if name not in adapter_slots:
        raise ValueError(f"unknown adapter {name!r}; loaded: {sorted(adapter_slots) or 'none'}")
    return EmbeddingRoute(on_encoder=False, adapter=name, slot=adapter_slots[name])


@dataclass(frozen=True)
class EmbeddingSpace:
    """Who computes a client's embeddings and with what: part of an index's identity.

    `kind` is "engine" for this project's engine in any deployment (its vectors are the same in-process or in a
    worker) or a peer's name. `adapter_slots` names the loaded LoRA adapters in load order (slots from 1);
    `encoder_pooling` is the separate encoder's own pooling ({} when embeddings come from the backbone)."""

    model: str
    embedding_model: str | None = None
    adapters: tuple[str, ...] = ()  # the adapter folders as configured (what the identity records)
    adapter_slots: Mapping[str, int] = field(default_factory=dict)
    encoder_pooling: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "engine"
    hidden_size: int | None = None  # the backbone's width, where known without asking (in-process)
    encoder_hidden_size: int | None = None

    @property
    def has_encoder(self) -> bool:
        return self.embedding_model is not None

    def route(self, params: PoolingParams | None) -> EmbeddingRoute:
        """Where `params` embed: `route_embedding` (engine/routing.py) is the one owner of that rule."""
        return route_embedding(params, self.has_encoder, self.adapter_slots)

    def dimension(self, route: EmbeddingRoute) -> int | None:
        """The width of the states `route` pools (None where unknown here: ask the client with one text)."""
        return self.encoder_hidden_size if route.on_encoder else self.hidden_size

    def default_pooling(self) -> PoolingParams:
        """The pooling of an embedding submitted without params: the encoder's own, else mean + L2."""
        return PoolingParams(**dict(self.encoder_pooling)) if self.has_encoder else PoolingParams()
