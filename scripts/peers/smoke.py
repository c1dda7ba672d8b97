"""Smoke test of a peer: start it, send 4 embeddings + 4 short generations, print latencies, shut down.

    .venv-peers/bin/python scripts/peers/smoke.py --peer vllm              # needs `make peers`
    .venv/bin/python scripts/peers/smoke.py --peer hf [--gen-mode static]
    ... --embed-model all-minilm-l6-v2                                    # the separate-model pairing
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=["vllm", "hf"], required=True)
    ap.add_argument("--embed-model", default="smollm2-135m-instruct")
    ap.add_argument("--gen-mode", choices=["continuous", "static"], default="continuous", help="hf peer only")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    if args.peer == "vllm":
        from vllm_peer import VllmDedicatedPeer

        peer = VllmDedicatedPeer(embed_model=args.embed_model)
        gen_params = {"max_tokens": args.max_tokens, "temperature": 0.0}
    else:
        from hf_peer import HfPeer

        peer = HfPeer(embed_model=args.embed_model, gen_mode=args.gen_mode)
        gen_params = {"max_tokens": args.max_tokens}
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


if __name__ == "__main__":
    sys.exit(main())
