"""How decoder embedding models format and pool their inputs, as `PoolingParams` the engine applies.

Each model was trained with one input format; embedding with another costs retrieval quality silently. The
engine prefixes `instruction` and appends the end token itself, so callers pass the bare query or document.
"""

from __future__ import annotations

import json
from pathlib import Path

from orthrus_rag.params import INPUT_TYPES, PoolingParams

# An embedding adapter's card: its pooling and its query / document prefixes (scripts/train_embedding_adapter.py
# writes it beside the PEFT files)
ADAPTER_CARD = "orthrus_embedding.json"

QWEN3_EMBEDDING_END = "<|endoftext|>"
QWEN3_DEFAULT_TASK = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_embedding_params(query: bool, task: str = QWEN3_DEFAULT_TASK, **overrides: object) -> PoolingParams:
    """Qwen3-Embedding: the final hidden state of an appended "<|endoftext|>" (last-token pooling: a causal
    model's last position is the only one that has seen the whole input), L2-normalised. Queries read
    "Instruct: {task}\\nQuery:{query}" (no space after "Query:", as in the model card); documents are plain text.
    """
    instruction = f"Instruct: {task}\nQuery:" if query else None
    return PoolingParams(pooling="last", normalize=True, instruction=instruction, append_eos=True,
                         end_token=QWEN3_EMBEDDING_END, **overrides)


def e5_mistral_params(query: bool, task: str = QWEN3_DEFAULT_TASK, **overrides: object) -> PoolingParams:
    """e5-mistral-7b-instruct: last-token pooling on an appended EOS ("</s>"), L2-normalised; queries read
    "Instruct: {task}\\nQuery: {query}" (with a space), documents are plain text."""
    instruction = f"Instruct: {task}\nQuery: " if query else None
    return PoolingParams(pooling="last", normalize=True, instruction=instruction, append_eos=True, **overrides)


def read_adapter_prefixes(folder: str | Path) -> dict[str, str]:
    """{"query": prefix, "document": prefix} from an adapter folder's card (the kinds it names); {} without one."""
    card = Path(folder) / ADAPTER_CARD
    if not card.is_file():
        return {}
    data = json.loads(card.read_text())
    return {kind: data[f"{kind}_instruction"] for kind in INPUT_TYPES if data.get(f"{kind}_instruction")}


def adapter_prefixes(folders: dict[str, str | Path]) -> dict[str, dict[str, str]]:
    """{adapter name: its card's prefixes} of the adapters (name -> folder or shipped name) that have a card: what
    the engine loads and what a deployment's client reports, from one place."""
    from orthrus_rag.models.registry import resolve_adapter_path

    return {name: p for name, folder in folders.items() if (p := read_adapter_prefixes(resolve_adapter_path(folder)))}
