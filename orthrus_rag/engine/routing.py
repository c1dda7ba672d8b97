"""Where an embedding runs: the separate encoder, or the decoder backbone with a LoRA adapter (or none); and
which adapter a generation runs under.

The one owner of those rules (`route_embedding`, `generation_slot`); `EmbeddingSpace` carries what a client's
embeddings are and which adapters it serves, so the engine, the `Embedder` and the server all route through the
same functions. An adapter's kind ("generate", "embed" or "both") says which requests may name it; embedding
adapters loaded as `model.embedding_adapters` are "embed", and the first of them is the default embedding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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


def _can(kinds: Mapping[str, str], name: str, kind: str) -> bool:
    return kinds.get(name, "embed") in (kind, "both")  # NOTE: a slot without a kind is an embedding adapter


def route_embedding(params: PoolingParams | None, has_encoder: bool, adapter_slots: Mapping[str, int],
                    adapter_kinds: Mapping[str, str] | None = None) -> EmbeddingRoute:
    """The encoder when there is one and `params` name no adapter; else the backbone with the named adapter, or
    the first embedding-only one (the default embedding adapter), or none. An unknown adapter, or one that only
    generates, is a ValueError."""
    kinds = adapter_kinds or {}
    adapter = params.adapter if params is not None else None
    if adapter == NO_ADAPTER:
        return EmbeddingRoute(on_encoder=False)
    if has_encoder and adapter is None:
        return EmbeddingRoute(on_encoder=True)
    name = adapter or next((n for n in adapter_slots if kinds.get(n, "embed") == "embed"), None)
    if name is None:
        return EmbeddingRoute(on_encoder=False)
    if name not in adapter_slots:
        raise ValueError(f"unknown adapter {name!r}; loaded: {sorted(adapter_slots) or 'none'}")
    if not _can(kinds, name, "embed"):
        embedders = sorted(n for n in adapter_slots if _can(kinds, n, "embed"))
        raise ValueError(f"adapter {name!r} generates only; embedding adapters: {embedders or 'none'}")
    return EmbeddingRoute(on_encoder=False, adapter=name, slot=adapter_slots[name])


def generation_slot(adapter: str | None, adapter_slots: Mapping[str, int],
                    adapter_kinds: Mapping[str, str] | None = None) -> int:
    """The slot a generation runs under: 0 (the base model) for None; an unknown adapter, or one that only
    embeds, is a ValueError naming the generation adapters."""
    if adapter is None:
        return 0
    kinds = adapter_kinds or {}
    generators = sorted(n for n in adapter_slots if _can(kinds, n, "generate"))
    if adapter not in adapter_slots:
        raise ValueError(f"unknown adapter {adapter!r}; generation adapters: {generators or 'none'}")
    if not _can(kinds, adapter, "generate"):
        raise ValueError(f"adapter {adapter!r} embeds only; generation adapters: {generators or 'none'}")
    return adapter_slots[adapter]


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
    adapter_kinds: Mapping[str, str] = field(default_factory=dict)  # name -> generate | embed | both
    # name -> {"query": prefix, "document": prefix}: an embedding adapter's card (embedding_formats.py)
    adapter_prefixes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def has_encoder(self) -> bool:
        return self.embedding_model is not None

    def route(self, params: PoolingParams | None) -> EmbeddingRoute:
        """Where `params` embed: `route_embedding` (engine/routing.py) is the one owner of that rule."""
        return route_embedding(params, self.has_encoder, self.adapter_slots, self.adapter_kinds)

    def formatted(self, params: PoolingParams, route: EmbeddingRoute | None = None) -> PoolingParams:
        """`params` with the prefix that its adapter's card names for its `input_type` (the engine applies it, so
        callers pass the bare query or document); unchanged with an `instruction` given, no input type, or no
        card. Idempotent: the filled-in prefix is an instruction. `route`: `params`' route, when known already."""
        if params.input_type is None or params.instruction is not None:
            return params
        route = route or self.route(params)
        prefix = None if route.on_encoder else self.adapter_prefixes.get(route.adapter or "", {}).get(params.input_type)
        return replace(params, instruction=prefix) if prefix else params

    def embedding_adapters(self) -> list[str]:
        """The loaded adapters an embedding may name, in load order."""
        return [n for n in self.adapter_slots if _can(self.adapter_kinds, n, "embed")]

    def generation_adapters(self) -> list[str]:
        """The loaded adapters a generation may name, in load order."""
        return [n for n in self.adapter_slots if _can(self.adapter_kinds, n, "generate")]

    def generation_slot(self, adapter: str | None) -> int:
        return generation_slot(adapter, self.adapter_slots, self.adapter_kinds)

    def dimension(self, route: EmbeddingRoute) -> int | None:
        """The width of the states `route` pools (None where unknown here: ask the client with one text)."""
        return self.encoder_hidden_size if route.on_encoder else self.hidden_size

    def default_pooling(self) -> PoolingParams:
        """The pooling of an embedding submitted without params: the encoder's own, else mean + L2."""
        return PoolingParams(**dict(self.encoder_pooling)) if self.has_encoder else PoolingParams()
