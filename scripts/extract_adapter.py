"""Extract a LoRA adapter from a fully fine-tuned model and its base (truncated SVD of each Linear's difference).

    python scripts/extract_adapter.py BASE TUNED --rank 64 OUT

BASE and TUNED are anything `orthrus_rag` resolves (a built-in name, a checkpoint folder, a .gguf file or a hub
id), e.g. Qwen/Qwen3-0.6B and Qwen/Qwen3-Embedding-0.6B. OUT becomes a PEFT LoRA folder (adapter_config.json,
adapter_model.safetensors) plus `full_deltas.safetensors` (norms, embedding rows: applied by the engine, ignored
by PEFT) and `extraction_report.json`; the energy kept per layer is printed. TUNED's `orthrus_embedding.json`
(pooling and prefixes: scripts/train_embedding_adapter.py --full writes one) is copied along.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from orthrus_rag.embedding_formats import ADAPTER_CARD
from orthrus_rag.models.adapter_extraction import extract, read_checkpoint, write_adapter
from orthrus_rag.models.registry import resolve_model_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("tuned")
    ap.add_argument("out", type=Path)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base = read_checkpoint(resolve_model_path(args.base))
    tuned_path = resolve_model_path(args.tuned)
    tuned = read_checkpoint(tuned_path)
    lora, full, report = extract(base, tuned, args.rank)
    write_adapter(args.out, lora, full, args.rank, args.base, report)
    if (tuned_path / ADAPTER_CARD).is_file():  # NOTE: its pooling and prefixes, which the engine then applies
        shutil.copy(tuned_path / ADAPTER_CARD, args.out / ADAPTER_CARD)
    print(f"rank {args.rank}: energy kept per layer (share of ||tuned - base||_F^2 in the LoRA factors)")
    for layer, kept in report.per_layer().items():
        print(f"  layer {layer:>5}: {kept:.4f}")
    print(f"full deltas: {', '.join(m.name for m in report.full) or 'none'}")
    print(f"unchanged: {len(report.unchanged)}, skipped: {', '.join(report.skipped) or 'none'}")


if __name__ == "__main__":
    main()
