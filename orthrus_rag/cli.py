"""Console entry point `orthrus-rag`.

    orthrus-rag run [overrides...]     answer a dataset's questions (Hydra; e.g. dataset=2wiki dataset.path=...)
    orthrus-rag index [overrides...]   build and save the retrieval index of a dataset's corpus
    orthrus-rag serve [overrides...]   the OpenAI-compatible server (e.g. serve.port=8000 serve.api_key=...)
    orthrus-rag demo                   generate and embed together on the built-in models, show the mixed steps
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


def _hydra(command: str, argv: list[str]) -> int:
    """Compose the config with Hydra (overrides, --help, --cfg job, multirun) and call the plain function."""
    import hydra
    from omegaconf import DictConfig

    from orthrus_rag.app_config import register_configs

    register_configs()

    @hydra.main(version_base=None, config_path="pkg://orthrus_rag.conf", config_name="config")
    def entry(cfg: DictConfig) -> None:
        try:
            _task(command, cfg)
        except ValueError as exc:  # bad config values or input: say what is wrong, no traceback
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    sys.argv, saved = [f"orthrus-rag {command}", *argv], sys.argv
    try:
        entry()
    finally:
        sys.argv = saved
    return 0


def _task(command: str, cfg) -> None:  # noqa: ANN001 (a DictConfig)
    from orthrus_rag import app

    if command == "serve":
        from orthrus_rag.serving import serve

        serve(cfg)
        return
    if command == "index":
        print(f"index saved to {app.index(cfg)}")
        return
    summary = app.run(cfg)
    from orthrus_rag.pipelines import format_table

    print(format_table(summary))
    eng = summary.get("engine")
    if eng is None:  # a deployment: its workers' steps are not seen here
        print(f"served by {summary['config']['serving']}; records in {cfg.run_dir}")
        return
    print(f"engine: {eng['num_steps']} steps, {eng['num_mixed_steps']} carried embedding and generation tokens "
          f"together; records in {cfg.run_dir}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("run", "index", "serve"):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return _hydra(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="orthrus-rag", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="answer a dataset's questions (Hydra overrides follow)")
    sub.add_parser("index", help="build a dataset's retrieval index (Hydra overrides follow)")
    sub.add_parser("serve", help="the OpenAI-compatible server (Hydra overrides follow)")
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
