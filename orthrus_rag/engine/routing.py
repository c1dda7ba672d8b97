"""Where an embedding runs: the separate encoder, or the decoder backbone with a LoRA adapter (or none).

The one owner of that rule: the engine calls it for every embedding request, the in-process embedder and a
deployment's backend call it to name what built an index's vectors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
