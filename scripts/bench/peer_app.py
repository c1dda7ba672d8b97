"""`orthrus-rag run` served by a peer (vLLM or transformers) in place of this project's engine: the same config,
pipeline code and outputs (run_dir/summary.json, records.jsonl), so a peer's Iter-RetGen row stands beside the
policies'. Runs under the peer's interpreter (vLLM: `.venv-peers/bin/python`, which `make peers` builds with this
project installed); the experiment (experiments/iter_retgen.py) starts it.

    .venv-peers/bin/python scripts/bench/peer_app.py --peer vllm -- experiment=smoke run_dir=runs/smoke_vllm

The peer generates with the app's model and embeds with its embedding model (or the same model, mean-pooled, when
`model.embedding_model=null`); the retrieval index is built through the peer too, so its vectors are the peer's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SCRIPTS = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", required=True, choices=("vllm", "hf"))
    ap.add_argument("--options", default="{}", help="the peer's keyword arguments as JSON")
    ap.add_argument("overrides", nargs="*", help="`orthrus-rag run` overrides (after --)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(SCRIPTS))  # `bench` is scripts/bench/
    from hydra import compose, initialize_config_module
    from orthrus_rag.pipelines import format_table

    from orthrus_rag.config.app import register_configs
    from orthrus_rag.entrypoints import commands as app

    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        cfg = compose(config_name="config", overrides=args.overrides)
    if "run_dir=" not in " ".join(args.overrides):
        raise SystemExit("error: pass run_dir=... (the ${now:} default needs a Hydra run)")
    try:  # NOTE: app.run closes the client (the peer's engines) whatever happens
        summary = app.run(cfg, client=peer_client(args.peer, cfg, json.loads(args.options)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary))
    return 0


def peer_client(peer: str, cfg, options: dict):  # noqa: ANN001 (a DictConfig) -> DeploymentClient
    from bench.peer_client import make_peer
    from orthrus_rag.engine.clients import DeploymentClient
    from orthrus_rag.engine.clients.deployment_client import encoder_pooling_of, load_tokenizer
    from orthrus_rag.entrypoints.checks import validate
    from orthrus_rag.params import EmbeddingSpace

    validate(cfg)  # before the peer's engines start
    m = cfg.model
    if m.embedding_adapters:
        raise ValueError("a peer embeds without LoRA adapters; set model.embedding_adapters=[]")
    if m.embedding_model is None and cfg.retriever.pooling != "mean":
        # NOTE: the peers pool a decoder's states by mean + L2 only; anything else would be mislabelled
        raise ValueError(f"a peer embeds with mean pooling on the backbone, not {cfg.retriever.pooling!r}")
    kwargs = {"embed_model": m.embedding_model or m.name, "gen_model": m.name,
              "temperature": cfg.pipeline.temperature, **options}  # the peer's options win
    client = make_peer(peer, return_embeddings=True, **kwargs)
    try:
        tokenizer, pooling = load_tokenizer(m.name), encoder_pooling_of(m.embedding_model)
    except BaseException:
        client.shutdown()
        raise
    space = EmbeddingSpace(m.name, m.embedding_model, encoder_pooling=pooling, kind=peer)
    return DeploymentClient(client, name=peer, tokenizer=tokenizer, embedding_space=space)


if __name__ == "__main__":  # NOTE: spawn (the vLLM peer's engines) re-imports the main module
    raise SystemExit(main())
