"""The shipped SmolLM2 embedding adapter is a loadable PEFT LoRA for SmolLM2's shapes, with its pooling card."""

from __future__ import annotations

import json
from pathlib import Path

import orthrus_rag
from orthrus_rag.layers.lora import load_peft_adapter

ADAPTER = Path(orthrus_rag.__file__).parent / "adapters" / "smollm2_embed"


def test_adapter_folder_loads_with_its_card() -> None:
    adapter = load_peft_adapter(ADAPTER)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert len(adapter.weights) == 30 * 7  # 30 layers x q/k/v/o/gate/up/down
    a, b = adapter.weights["model.layers.0.mlp.gate_proj"]
    assert a.shape == (8, 576) and b.shape == (1536, 8) and b.abs().sum() > 0  # trained: B is not zero
    card = json.loads((ADAPTER / "orthrus_embedding.json").read_text())
    assert card == {"pooling": "mean", "normalize": True, "query_instruction": "query: ",
                    "document_instruction": "passage: ", "append_eos": False}
    assert sum(f.stat().st_size for f in ADAPTER.iterdir()) <= 10 * 2**20
