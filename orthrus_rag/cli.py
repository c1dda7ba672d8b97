"""Console entry point `orthrus-rag`.

`orthrus-rag demo` runs generations and embeddings together on the built-in offline models and shows how the
engine's steps mixed them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

DEMO_PROMPTS = [
    "Question: Who wrote the novel Pride and Prejudice?\nAnswer:",
    "The three primary colours are",
    "Write one sentence about the sea:",
    "def fibonacci(n):",
]
DEMO_TEXTS = [
    "Jane Austen published Pride and Prejudice in 1813.",
    "Red, yellow and blue are traditionally called primary colours.",
    "The Pacific is the largest and deepest ocean on Earth.",
    "Multi-hop questions need facts from more than one document.",
] * 4


def demo(args: argparse.Namespace) -> int:
    from orthrus_rag import Engine, PoolingParams, SamplingParams

    engine = Engine.from_pretrained(args.model, embedding_model=args.embedding_model,
                                    max_num_batched_tokens=args.max_num_batched_tokens, max_chunk_tokens=32)
    start = time.perf_counter()
    gens, embs = engine.run(prompts=DEMO_PROMPTS, sampling_params=SamplingParams(max_tokens=args.max_tokens,
                                                                                 temperature=0.0),
                            texts=DEMO_TEXTS, pooling_params=PoolingParams(pooling="mean", normalize=True))
    elapsed = time.perf_counter() - start
    for g in gens:
        print(f"--- {DEMO_PROMPTS[gens.index(g)]!r}\n{g.text.strip()}")
    sims = embs[0].embedding @ embs[1].embedding, embs[0].embedding @ embs[4].embedding
    print(f"\n{len(embs)} embeddings of dimension {embs[0].embedding.shape[-1]}; "
          f"cos(text0, text1)={sims[0]:.3f}, cos(text0, same text)={sims[1]:.3f}")
    stats = list(engine.step_stats)
    mixed = sum(s.is_mixed for s in stats)
    print(f"\n{len(stats)} engine steps in {elapsed:.1f} s; {mixed} carried embedding and generation tokens "
          "together. First steps (embed / prefill / decode / encoder tokens):")
    for s in stats[:8]:
        print(f"  step {s.step:3d}: {s.num_embed_tokens:4d} {s.num_prefill_tokens:4d} {s.num_decode_tokens:4d} "
              f"{s.num_encoder_tokens:4d}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orthrus-rag", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate and embed together on the built-in models")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--embedding-model", default=None,
                   help="separate encoder (e.g. all-minilm-l6-v2); default: embed with the shared backbone")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return {"demo": demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
