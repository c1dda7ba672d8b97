"""Retrieval quality of embedding configurations on a QA file: recall@k of the supporting paragraphs.

    python scripts/eval_embedding_recall.py --data dev.jsonl \
        --configs minilm bare-mean prompteol adapter --adapter runs/adapters/smollm2-embed --out recall.json
    python scripts/eval_embedding_recall.py --data ... --configs adapter --adapter runs/extracted/r8 ... \
        --reference runs/full-ft     # extracted adapters against the fully fine-tuned model they came from

The corpus is the union of the file's context paragraphs (de-duplicated by title, as the pipelines build it);
each question is embedded alone (no previous generation) and searched exactly (inner product of L2-normalised
vectors, what a FAISS flat index computes). All configurations run on one engine in one run:
- `minilm`: all-minilm-l6-v2, the separate encoder (mean pooling + L2);
- `bare-mean`: SmolLM2 with no adapter, mean pooling + L2 (the engine's decoder default);
- `prompteol`: SmolLM2 with no adapter, training-free: PromptEOL's prompt ('This sentence : "X" means in one
  word:"'), the last prompt token's hidden state (no EOS appended), L2;
- `adapter`: SmolLM2 + each LoRA adapter given by --adapter (several: one row each, all loaded in one engine),
  pooled as its `orthrus_embedding.json` says, its query / document prefixes applied by the engine
  (`PoolingParams.input_type`).
- `--reference FOLDER`: a fully fine-tuned checkpoint (scripts/train_embedding_adapter.py --full) embeds the same
  texts on its own engine, pooled as the first adapter's card says; every adapter row then also reports the mean
  cosine of its vectors to the reference's (how much of the full fine-tune an extracted adapter keeps).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from orthrus_rag import Engine, PoolingParams
from orthrus_rag.data.loaders import build_corpus, load_qa
from orthrus_rag.pipelines.evaluate import recall_at_k

logger = logging.getLogger("eval_embedding_recall")
PROMPTEOL = 'This sentence : "{}" means in one word:"'
CONFIGS = ("minilm", "bare-mean", "prompteol", "adapter")


def _card_pooling(adapter_dir: Path, adapter: str | None) -> tuple[PoolingParams, PoolingParams, str]:
    """Pooled as the adapter's card says (`adapter=None`: a full model's own weights, the prefixes given here)."""
    card = json.loads((adapter_dir / "orthrus_embedding.json").read_text())
    if adapter is None:
        return (PoolingParams(pooling=card["pooling"], instruction=card.get("document_instruction")),
                PoolingParams(pooling=card["pooling"], instruction=card.get("query_instruction")), "{}")
    return (PoolingParams(pooling=card["pooling"], adapter=adapter, input_type="document"),
            PoolingParams(pooling=card["pooling"], adapter=adapter, input_type="query"), "{}")


def _pooling(config: str, adapter_dir: Path | None) -> tuple[PoolingParams, PoolingParams, str]:
    """(document params, query params, text template) of one configuration."""
    if config == "minilm":
        # NOTE: truncated at 256 tokens, as sentence-transformers does (a few 2Wiki paragraphs are longer)
        params = PoolingParams(pooling="mean", truncate=True)
        return params, params, "{}"
    if config == "bare-mean":
        return PoolingParams(pooling="mean", adapter=""), PoolingParams(pooling="mean", adapter=""), "{}"
    if config == "prompteol":
        params = PoolingParams(pooling="last", append_eos=False, adapter="")
        return params, params, PROMPTEOL
    assert adapter_dir is not None, "--adapter is needed for the adapter configuration"
    return _card_pooling(adapter_dir, adapter_dir.name)


def _embed(engine: Engine, texts: list[str], params: PoolingParams, batch: int = 64) -> np.ndarray:
    out = []
    for start in range(0, len(texts), batch):
        out += [o.embedding.float().numpy() for o in engine.embed(texts[start:start + batch], params)]
    return np.stack(out)


def evaluate(engine: Engine, config: str, adapter_dir: Path | None, examples: list, ks: tuple[int, ...],
             pooling: tuple[PoolingParams, PoolingParams, str] | None = None) -> tuple[dict, np.ndarray]:
    """(recall@k row, the documents' and queries' vectors stacked)."""
    corpus = build_corpus(examples)
    doc, query, template = pooling or _pooling(config, adapter_dir)
    t0 = time.perf_counter()
    docs = _embed(engine, [template.format(p.contents) for p in corpus], doc)
    queries = _embed(engine, [template.format(ex.question) for ex in examples], query)
    scores = queries @ docs.T
    top = np.argsort(-scores, axis=1)[:, :max(ks)]
    result: dict = {"config": config, "passages": len(corpus), "questions": len(examples),
                    "seconds": round(time.perf_counter() - t0, 1)}
    for k in ks:
        values = [recall_at_k([corpus[i].title for i in row], ex.supporting_titles, k)
                  for row, ex in zip(top, examples)]
        values = [v for v in values if v is not None]
        result[f"recall@{k}"] = round(float(np.mean(values)), 4)
    return result, np.concatenate([docs, queries])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a 2Wiki-format JSONL file")
    ap.add_argument("--dataset", default="2wiki")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--adapter", type=Path, nargs="+", default=[])
    ap.add_argument("--reference", type=Path, default=None, help="a fully fine-tuned checkpoint folder")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    examples = load_qa(args.dataset, path=args.data, limit=args.limit)
    adapters = [str(a) for a in args.adapter] if "adapter" in args.configs else []
    if "adapter" in args.configs and not adapters:
        ap.error("--configs adapter needs --adapter")
    if args.reference is not None and not adapters:
        ap.error("--reference compares adapters to a full model: give --configs adapter --adapter ...")
    if len({a.name for a in args.adapter}) < len(args.adapter):
        ap.error("two --adapter folders share a name (the engine names adapters by their folders)")
    options = dict(num_threads=args.threads, max_num_batched_tokens=512, max_chunk_tokens=512, max_num_seqs=64)
    results, reference = [], None

    def record(result: dict) -> None:
        results.append(result)
        logger.info("%s", result)
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=2))

    if args.reference is not None:  # NOTE: first, on its own engine, freed before the others load
        ref_engine = Engine.from_pretrained(str(args.reference), **options)
        row, reference = evaluate(ref_engine, "reference", None, examples, (2, 5, 10),
                                  _card_pooling(args.adapter[0], None))
        del ref_engine
        record({**row, "config": f"reference {args.reference.name}"})
    engine = Engine.from_pretrained(
        "smollm2-135m-instruct", embedding_adapters=adapters or None,
        embedding_model="all-minilm-l6-v2" if "minilm" in args.configs else None, **options)
    for config in args.configs:
        for adapter_dir in (args.adapter if config == "adapter" else [None]):
            row, vectors = evaluate(engine, config, adapter_dir, examples, (2, 5, 10))
            if adapter_dir is not None:
                row["config"] = f"adapter {adapter_dir.name}"
                if reference is not None:  # NOTE: both L2-normalised: the dot product is the cosine
                    row["cosine_to_reference"] = round(float(np.mean(np.sum(vectors * reference, axis=1))), 4)
            record(row)
    print(f"{'config':<28} {'recall@2':>9} {'recall@5':>9} {'recall@10':>10} {'cos to ref':>10} {'seconds':>8}")
    for r in results:
        cos = f"{r['cosine_to_reference']:.4f}" if "cosine_to_reference" in r else "-"
        print(f"{r['config']:<28} {r['recall@2']:>9.4f} {r['recall@5']:>9.4f} {r['recall@10']:>10.4f} {cos:>10} "
              f"{r['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
