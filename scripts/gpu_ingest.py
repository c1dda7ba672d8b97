"""The ingest-while-serving table on a GPU: serving under a closed-loop load with and without a concurrent bulk
ingest, in one engine on random weights (what `scripts/bench_ingest.py` measures on a CPU with the real models).

    PYTHONPATH=$PWD python3 scripts/gpu_ingest.py --tokenizer tok/ --out $OUT/gpu_ingest     # H200: ~4 min (est.)
    python scripts/gpu_ingest.py --device cpu --shape tiny --window-s 2 --warmup-s 0.5 ...    # dry run (tests)

Needs only torch, transformers and the project (no weights, no FAISS): a random-initialised Llama of `--shape`
(bf16 on CUDA) generates, and its own backbone embeds by mean pooling (the ratio sweep's shared model). Rows, each
measured over `--window-s` after `--warmup-s` on the same warm engine:

1. `idle ingest`: bulk embeddings only (`PoolingParams(priority=1)`, passages of `--passage-len` tokens,
   `--ingest-window` of them in flight): passages/s;
2. `serving`: `--clients` closed-loop clients at `--ratio` embed:generate (queries of `--query-len` tokens;
   generations of `--prompt-len` + `--new-tokens`, ignore_eos): each kind's p50 / p95 and req/s;
3. `serving + ingest`: both at once: each kind's p95 and req/s against row 2, the ingest rate against row 1.

A request counts in a row when it finishes inside the window (one started in the warm-up included), as the CPU
benchmarks' driver counts; percentiles as numpy's. A row that has not drained `--drain-timeout-s` after its window is
cut there (its requests are aborted). `goal_met` in the ratios: each kind's p95 within 1.1x of row 2 and the ingest at
>= 0.5x row 1. The index add of the vectors is left out: it runs on the host beside the engine's steps (a FAISS add
under a lock). Prints one JSON line per row and writes results.json and table.md under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402  (its model, engine and id helpers)

from orthrus_rag import PoolingParams, SamplingParams  # noqa: E402
from orthrus_rag.engine.async_engine import AsyncEngine  # noqa: E402

GOAL_P95, GOAL_INGEST = 1.1, 0.5
# NOTE: retrievers' BULK_PRIORITY (1), not imported: that package needs FAISS, which the GPU machine lacks
BULK = PoolingParams(pooling="mean", priority=1)
QUERY = PoolingParams(pooling="mean")


class Load:
    """One row's traffic on `aengine` until `stop_at`: closed-loop serving clients and / or a bulk ingest keeping
    `--ingest-window` passages in flight. Records (kind, start, end) per request, monotonic seconds."""

    def __init__(self, aengine: AsyncEngine, args: argparse.Namespace, vocab: int, stop_at: float) -> None:
        self.aengine, self.args, self.vocab, self.stop_at = aengine, args, vocab, stop_at
        self.records: list[tuple[str, float, float]] = []
        e, g = (float(v) for v in args.ratio.split(":"))
        self.embed_frac = e / (e + g)

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.vocab - 1) for _ in range(n)]

    async def client(self, seed: int) -> None:
        rng, a = random.Random(seed), self.args
        while time.monotonic() < self.stop_at:
            start = time.monotonic()
            if rng.random() < self.embed_frac:
                await self.aengine.embed(self._ids(rng, a.query_len), QUERY)
                self.records.append(("embed", start, time.monotonic()))
            else:
                await self.aengine.generate(self._ids(rng, a.prompt_len),
                                            SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True))
                self.records.append(("generate", start, time.monotonic()))

    async def ingester(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.stop_at:
            start = time.monotonic()
            await self.aengine.embed(self._ids(rng, self.args.passage_len), BULK)
            self.records.append(("ingest", start, time.monotonic()))

    async def run(self, serve: bool, ingest: bool) -> None:
        a = self.args
        tasks = [self.client(10_000 + i) for i in range(a.clients if serve else 0)]
        tasks += [self.ingester(20_000 + i) for i in range(a.ingest_window if ingest else 0)]
        await asyncio.gather(*tasks)


def summary(records: list[tuple[str, float, float]], t0: float, t1: float) -> dict[str, Any]:
    """Per kind: requests finished in [t0, t1] a second, and their latency p50 / p95."""
    out: dict[str, Any] = {}
    for kind in ("embed", "generate", "ingest"):
        lat = [end - start for k, start, end in records if k == kind and t0 <= end <= t1]
        if lat:
            p50, p95 = np.percentile(lat, [50, 95])
            out[kind] = {"per_s": len(lat) / (t1 - t0), "p50_s": float(p50), "p95_s": float(p95)}
    return out


async def measure(aengine: AsyncEngine, args: argparse.Namespace, vocab: int, serve: bool, ingest: bool
                  ) -> dict[str, Any]:
    begin = time.monotonic()
    t0, t1 = begin + args.warmup_s, begin + args.warmup_s + args.window_s
    load = Load(aengine, args, vocab, t1)
    seen: list[tuple[float, Any]] = []
    # NOTE: the observer runs on the engine's thread; a list append is atomic there
    unobserve = aengine.observe_steps(lambda stats: seen.append((time.monotonic(), stats)))
    cut = False
    try:
        await asyncio.wait_for(load.run(serve, ingest), t1 + args.drain_timeout_s - time.monotonic())
    except asyncio.TimeoutError:
        cut = True  # NOTE: wait_for cancelled the clients; cancelling an awaited request aborts it in the engine
    finally:
        unobserve()
    steps = [stats for t, stats in seen if t0 <= t <= t1]
    tokens = [s.num_embed_tokens + s.num_prefill_tokens + s.num_decode_tokens + s.num_encoder_tokens for s in steps]
    return {**summary(load.records, t0, t1), "steps": len(steps), "cut": cut,
            "tokens_per_step": statistics.mean(tokens) if tokens else 0.0,
            "step_ms_median": 1e3 * statistics.median(s.step_time for s in steps) if steps else 0.0}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Row 3 against rows 1-2, and whether both bounds hold (`goal_met`: p95s within GOAL_P95, ingest at least
    GOAL_INGEST of idle)."""
    idle, alone, both = rows["idle ingest"], rows["serving"], rows["serving + ingest"]
    out: dict[str, Any] = {}
    for kind in ("embed", "generate"):
        if kind in alone and kind in both:
            out[f"{kind}_p95_x"] = both[kind]["p95_s"] / alone[kind]["p95_s"]
            out[f"{kind}_per_s_x"] = both[kind]["per_s"] / alone[kind]["per_s"]
    out["ingest_x_idle"] = (both.get("ingest", {}).get("per_s", 0.0) / idle["ingest"]["per_s"]
                            if "ingest" in idle else None)
    # NOTE: a kind that finished nothing beside the ingest has no p95 there: starved, so `goal_met` is False
    p95s = [out.get(f"{kind}_p95_x") for kind in ("embed", "generate")]
    out["goal_met"] = (all(x is not None and x <= GOAL_P95 for x in p95s)
                       and (out["ingest_x_idle"] or 0.0) >= GOAL_INGEST)
    return out


def table(rows: dict[str, dict[str, Any]], against: dict[str, Any]) -> str:
    lines = ["| row | embed p50 / p95 s | embed req/s | gen p50 / p95 s | gen req/s | ingest passages/s |",
             "|---|---|---:|---|---:|---:|"]
    for name, r in rows.items():
        def kind(k: str) -> tuple[str, str]:
            if k not in r:
                return "", ""
            return f"{r[k]['p50_s']:.3f} / {r[k]['p95_s']:.3f}", f"{r[k]['per_s']:.2f}"
        (ep, er), (gp, gr) = kind("embed"), kind("generate")
        ingest = f"{r['ingest']['per_s']:.1f}" if "ingest" in r else ""
        lines.append(f"| {name} | {ep} | {er} | {gp} | {gr} | {ingest} |")
    lines.append("")
    lines.append("serving + ingest against the rows above: " + ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in against.items()))
    return "\n".join(lines) + "\n"


async def run_rows(aengine: AsyncEngine, args: argparse.Namespace, vocab: int) -> dict[str, dict[str, Any]]:
    await measure(aengine, argparse.Namespace(**{**vars(args), "warmup_s": 0.0, "window_s": args.warmup_s}),
                  vocab, True, True)  # NOTE: the first steps of each shape compile / capture; not measured
    rows = {}
    for name, serve, ingest in (("idle ingest", False, True), ("serving", True, False),
                                ("serving + ingest", True, True)):
        rows[name] = await measure(aengine, args, vocab, serve, ingest)
        print(json.dumps({"section": "ingest", "row": name, **rows[name]}), flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(gb.SHAPES), default="8b")
    ap.add_argument("--tokenizer", default=os.environ.get("ORTHRUS_TOKENIZER"),
                    help="folder with the SmolLM2 tokenizer files (default: $ORTHRUS_TOKENIZER, else the built-in)")
    ap.add_argument("--policy", default="orthrus")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--bulk-step-tokens", type=int, default=None,
                    help="scheduler.bulk_step_tokens: the most bulk tokens a step takes beside serving work "
                         "(default: all the budget serving leaves)")
    ap.add_argument("--bulk-min-tokens", type=int, default=0,
                    help="scheduler.bulk_min_tokens: budget tokens a step reserves for waiting bulk work")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="scheduler.max_num_seqs")
    ap.add_argument("--kv-cache-gib", type=float, default=24.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--ratio", default="5:5", help="embed:generate mix of the clients")
    ap.add_argument("--query-len", type=int, default=45, help="tokens of an embedding query")
    ap.add_argument("--prompt-len", type=int, default=45)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--passage-len", type=int, default=130, help="tokens of an ingested passage")
    ap.add_argument("--ingest-window", type=int, default=256, help="bulk embeddings in flight")
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=40.0)
    ap.add_argument("--drain-timeout-s", type=float, default=120.0,
                    help="after its window, a row's requests in flight get this long to finish, then are aborted")
    ap.add_argument("--out", default="runs/gpu_ingest")
    args = ap.parse_args(argv)
    if args.tokenizer is None:
        from orthrus_rag.models.registry import resolve_model_path

        args.tokenizer = str(resolve_model_path("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    dev = torch.device(args.device)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    env = {"torch": torch.__version__, "device": args.device, "shape": args.shape, "dtype": dtype,
           "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    print(json.dumps({"event": "start", **env}), flush=True)
    cfg = gb.llama_config(gb.SHAPES[args.shape], vocab, tokenizer)
    model = gb.random_model(cfg, getattr(torch, dtype), dev)
    engine = gb.engine(model, tokenizer, args, dtype, args.policy, args.budget, bulk_step_tokens=args.bulk_step_tokens,
                       bulk_min_tokens=args.bulk_min_tokens, max_num_seqs=args.max_num_seqs)

    async def go() -> dict[str, dict[str, Any]]:
        # NOTE: both kinds' quotas hold every client and the whole ingest window
        async with AsyncEngine(engine, max_in_flight=args.clients + 1,
                               max_bulk_in_flight=args.ingest_window + 1) as aengine:
            return await run_rows(aengine, args, vocab)

    rows = asyncio.run(go())
    against = ratios(rows)
    print(json.dumps({"section": "ingest", "row": "ratios", **against}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"env": env, "args": vars(args), "rows": rows, "ratios": against,
              "goal": {"p95_x_max": GOAL_P95, "ingest_x_min": GOAL_INGEST}}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(table(rows, against))
    return result


if __name__ == "__main__":
    main()
