"""Run a measured peer (vLLM on CPU, or transformers) in place of this project's engine: check that it starts and
answers, serve an `orthrus-rag run` through it, or run one benchmark experiment's workload against it.

    .venv-peers/bin/python scripts/peer.py smoke --peer vllm                 # needs `make peers`
    .venv/bin/python scripts/peer.py smoke --peer hf [--gen-mode static]
    .venv-peers/bin/python scripts/peer.py run --peer vllm -- experiment=smoke run_dir=runs/smoke_vllm
    python scripts/peer.py experiment --peer hf --experiment ratio_sweep --config cfg.json --out results.json

- `smoke`: start the peer, send 4 embeddings and 4 short generations (a warm-up round, then a timed one), print
  each latency, shut down; exit status 1 when a request is missing or failed. Run it before a long benchmark.
- `run`: `orthrus-rag run` served by the peer: the same config, pipeline code and outputs (run_dir/summary.json,
  records.jsonl), so a peer's row stands beside the policies' (scripts/bench/experiments/iter_retgen.py runs it).
  The peer generates with the app's model and embeds with its embedding model (or the same model, mean-pooled, when
  `model.embedding_model=null`); the retrieval index is built through the peer too, so its vectors are the peer's.
- `experiment`: one experiment's workload against the peer, its RunResults written as JSON (what
  scripts/bench/harness.py runs under the peer's interpreter, for `peers=[...]` of scripts/benchmark.py).

vLLM runs under `.venv-peers/bin/python` (`make peers` builds it, this project installed); transformers runs under
either venv, and so does llama.cpp's client (`make peers-llamacpp` builds its servers). The peers themselves are
scripts/peers/vllm_peer.py, scripts/peers/hf_peer.py and scripts/peers/llamacpp_peer.py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SCRIPTS = Path(__file__).resolve().parent
PEERS = ("vllm", "hf", "llamacpp")

TEXTS = [
    "The river runs past old mills and quiet towns toward a distant grey sea.",
    "Paris is the capital and most populous city of France.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The Great Wall of China was built over many centuries.",
]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "Question: What is two plus two?\nAnswer:",
    "The three primary colours are",
]


def smoke(args: argparse.Namespace) -> int:
    """Start the peer, send 4 embeddings + 4 short generations, print latencies, shut down."""
    from bench.peer_client import make_peer

    t0 = time.perf_counter()
    options = {"gen_mode": args.gen_mode} if args.peer == "hf" else {}
    peer = make_peer(args.peer, embed_model=args.embed_model, temperature=0.0, **options).peer
    gen_params = {"max_tokens": args.max_tokens, "temperature": 0.0}
    print(f"[{args.peer}] started in {time.perf_counter() - t0:.1f}s "
          f"(load {getattr(peer, 'load_s', '?')})", flush=True)

    ok = True
    try:
        submitted: dict[str, float] = {}
        for rnd in range(2):  # round 0 warms up; round 1 is timed
            submitted.clear()
            for i, text in enumerate(TEXTS):
                rid = f"r{rnd}-e{i}"
                submitted[rid] = time.perf_counter()
                peer.submit("embed", rid, text, {"return_embedding": i == 0})
            for i, prompt in enumerate(PROMPTS):
                rid = f"r{rnd}-g{i}"
                submitted[rid] = time.perf_counter()
                peer.submit("generate", rid, prompt, dict(gen_params))
            done: dict[str, dict] = {}
            deadline = time.monotonic() + args.timeout
            while len(done) < len(submitted) and time.monotonic() < deadline:
                for res in peer.poll(timeout_s=1.0):
                    done[res["request_id"]] = res
            label = "warm-up" if rnd == 0 else "timed"
            print(f"[{args.peer}] round {rnd} ({label}): {len(done)}/{len(submitted)} done")
            for rid in sorted(submitted):
                res = done.get(rid)
                if res is None:
                    ok = False
                    print(f"  {rid}: MISSING")
                    continue
                lat = (res["finished_at"] - submitted[rid]) * 1e3
                extra = ""
                if res.get("error"):
                    ok = False
                    extra = f" ERROR {res['error']}"
                elif res["kind"] == "generate":
                    ok &= res["n_tokens"] > 0
                    extra = f" text={res.get('text', '')!r}"
                elif "embedding" in res:
                    vec = res["embedding"]
                    extra = f" dim={len(vec)} norm={sum(x * x for x in vec) ** 0.5:.4f}"
                print(f"  {rid:7s} {res['kind']:8s} {lat:8.1f} ms  n_tokens={res['n_tokens']}{extra}")
    finally:
        t1 = time.perf_counter()
        peer.shutdown()
        print(f"[{args.peer}] shut down in {time.perf_counter() - t1:.1f}s", flush=True)
    print(f"[{args.peer}] smoke {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """`orthrus-rag run` served by the peer: the same config, pipeline code and outputs."""
    from hydra import compose, initialize_config_module

    from orthrus_rag.config.app import register_configs
    from orthrus_rag.entrypoints import commands as app
    from orthrus_rag.pipelines import format_table

    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    if "run_dir=" not in " ".join(overrides):
        raise SystemExit("error: pass run_dir=... (the ${now:} default needs a Hydra run)")
    try:  # NOTE: app.run closes the client (the peer's engines) whatever happens
        summary = app.run(cfg, client=app_client(args.peer, cfg, json.loads(args.options)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary))
    return 0


def app_client(peer: str, cfg, options: dict):  # noqa: ANN001 (a DictConfig) -> DeploymentClient
    """The peer as the `DeploymentClient` an app run takes: its models from the app's config, checked first."""
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


def experiment(args: argparse.Namespace) -> int:
    """One experiment's workload against the peer; its RunResults as JSON in --out."""
    from bench.harness import run_local
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(json.loads(Path(args.config).read_text()))
    exp = importlib.import_module(f"bench.experiments.{args.experiment}")
    Path(args.out).write_text(json.dumps(run_local(args.peer, cfg, exp), default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    peer = argparse.ArgumentParser(add_help=False)
    peer.add_argument("--peer", required=True, choices=PEERS, help="vllm: two vLLM engines, one core each (needs "
                      "`make peers`); hf: transformers generation and embeddings, one thread each; llamacpp: two "
                      "llama-servers, one core each (needs `make peers-llamacpp`)")

    p = commands.add_parser("smoke", parents=[peer], help=smoke.__doc__, description=smoke.__doc__)
    p.add_argument("--embed-model", default="smollm2-135m-instruct",
                   help="the embedding model (all-minilm-l6-v2: the separate-model pairing)")
    p.add_argument("--gen-mode", choices=["continuous", "static"], default="continuous", help="hf peer only")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(func=smoke)

    p = commands.add_parser("run", parents=[peer], help=run.__doc__, description=run.__doc__)
    p.add_argument("--options", default="{}", help="the peer's keyword arguments as JSON")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="`orthrus-rag run` overrides (after --)")
    p.set_defaults(func=run)

    p = commands.add_parser("experiment", parents=[peer], help=experiment.__doc__, description=experiment.__doc__)
    p.add_argument("--experiment", required=True, help="a module of scripts/bench/experiments/")
    p.add_argument("--config", required=True, help="the resolved experiment config as JSON")
    p.add_argument("--out", required=True)
    p.set_defaults(func=experiment)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))  # `bench` is scripts/bench/
    return args.func(args)


if __name__ == "__main__":  # NOTE: spawn (the vLLM peer's engines) re-imports the main module
    raise SystemExit(main())
