"""A bounded loopback load test of `orthrus-rag serve`: N closed-loop clients mix embeddings, streaming chat and
(with `--rerank-share` and a server with `model.rerankers`) rerank calls for a fixed time against a server started
here (a subprocess on 127.0.0.1), then check what must hold:

- no error and no lost or hung request (every request ends in a complete answer: a [DONE] stream with a finish
  reason, an embedding per input, a score per document), each bounded by a per-request timeout;
- afterwards nothing pending and every KV block free (from /metrics);
- /metrics shows engine steps that carried embedding and generation tokens together.

Throughput and latency are printed too, as indicative figures (they depend on what else the machine runs).

    python scripts/serve_load.py --clients 64 --duration 120 --out results/serve_load.json
    # reranking beside chat and embeddings
    python scripts/serve_load.py --embed-share 0.4 --rerank-share 0.2 model.rerankers=[backbone]

`plot_results` redraws the committed figures (docs/benchmarks/results/features-serv*.json; the page is
docs/benchmarks/features.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("river mountain library engine question answer paper memory token garden window music history "
         "science ocean forest city bridge winter summer").split()


@dataclass
class Tally:
    ok: dict[str, int] = field(default_factory=lambda: {"embed": 0, "chat": 0, "rerank": 0})
    errors: list[str] = field(default_factory=list)
    hung: int = 0
    started: int = 0
    latency: dict[str, list[float]] = field(default_factory=lambda: {"embed": [], "chat": [], "rerank": []})
    ttft: list[float] = field(default_factory=list)
    inputs_embedded: int = 0
    pairs_scored: int = 0
    tokens_generated: int = 0


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _embed(http: httpx.AsyncClient, rng: random.Random, tally: Tally, model: str) -> None:
    inputs = [_text(rng, rng.randint(16, 64)) for _ in range(rng.randint(1, 4))]
    resp = await http.post("/v1/embeddings", json={"model": model, "input": inputs})
    if resp.status_code != 200:
        raise RuntimeError(f"embeddings {resp.status_code}: {resp.text[:200]}")
    data = resp.json()["data"]
    if len(data) != len(inputs) or any(not d["embedding"] for d in data):
        raise RuntimeError(f"embeddings: {len(data)} vectors for {len(inputs)} inputs")
    tally.inputs_embedded += len(inputs)


async def _rerank(http: httpx.AsyncClient, rng: random.Random, tally: Tally, documents: int) -> None:
    """A query against `documents` passages (a retriever's candidates), the best 5 back."""
    docs = [_text(rng, rng.randint(40, 80)) for _ in range(documents)]
    resp = await http.post("/v1/rerank", json={"query": _text(rng, rng.randint(6, 16)), "documents": docs,
                                               "top_n": 5, "return_documents": False})
    if resp.status_code != 200:
        raise RuntimeError(f"rerank {resp.status_code}: {resp.text[:200]}")
    results = resp.json()["results"]
    if len(results) != min(5, documents) or any(not 0.0 <= r["relevance_score"] <= 1.0 for r in results):
        raise RuntimeError(f"rerank: {len(results)} results for {documents} documents")
    tally.pairs_scored += documents


async def _chat(http: httpx.AsyncClient, rng: random.Random, tally: Tally, model: str, max_tokens: int,
                start: float) -> None:
    body = {"model": model, "stream": True, "max_tokens": rng.randint(max_tokens // 2, max_tokens),
            "temperature": 0.7, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Write about {_text(rng, rng.randint(8, 48))}."}]}
    done = finished = False
    first = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"chat {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"chat stream error: {chunk['error']['message']}")
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content") and first is None:
                    first = time.monotonic() - start
                finished = finished or choice.get("finish_reason") is not None
            if chunk.get("usage"):
                tally.tokens_generated += chunk["usage"]["completion_tokens"]
    if not (done and finished):
        raise RuntimeError(f"chat stream ended early (done={done}, finish_reason seen={finished})")
    if first is not None:
        tally.ttft.append(first)


async def _client(i: int, http: httpx.AsyncClient, args: argparse.Namespace, deadline: float, tally: Tally,
                  models: tuple[str, str]) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < deadline:
        draw = rng.random()
        kind = ("embed" if draw < args.embed_share else "rerank" if draw < args.embed_share + args.rerank_share
                else "chat")
        start = time.monotonic()
        tally.started += 1
        try:
            call = (_embed(http, rng, tally, models[1]) if kind == "embed" else
                    _rerank(http, rng, tally, args.rerank_documents) if kind == "rerank" else
                    _chat(http, rng, tally, models[0], args.max_tokens, start))
            await asyncio.wait_for(call, args.request_timeout)
        except asyncio.TimeoutError:
            tally.hung += 1
            continue
        except Exception as exc:  # noqa: BLE001 (counted and reported)
            tally.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            continue
        tally.ok[kind] += 1
        tally.latency[kind].append(time.monotonic() - start)


def _metrics(text: str) -> dict[str, float]:
    """Samples by name; a metric labelled per replica (a Ray Serve deployment) is the sum over its replicas."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if 'replica="' in name:
                name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


async def _run(args: argparse.Namespace, base: str) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout + 10, limits=limits) as http:
        cards = (await http.get("/v1/models")).json()["data"]
        ids = [m["id"] for m in cards if "score" not in m.get("kinds", [])]
        models = (ids[0], ids[-1])
        tally = Tally()
        start = time.monotonic()
        deadline = start + args.duration
        await asyncio.gather(*(_client(i, http, args, deadline, tally, models) for i in range(args.clients)))
        wall = time.monotonic() - start
        # the engine must be idle and every block free shortly after the last answer
        settle_deadline = time.monotonic() + 30
        while True:
            m = _metrics((await http.get("/metrics")).text)
            if (m["orthrus_kv_blocks_used"] == 0 and m["orthrus_num_requests_pending"] == 0) \
                    or time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.2)
    finished = sum(tally.ok.values()) + len(tally.errors) + tally.hung
    return {
        "clients": args.clients, "duration_s": args.duration, "wall_s": round(wall, 1),
        "embed_share": args.embed_share, "rerank_share": args.rerank_share, "max_tokens": args.max_tokens,
        "requests_started": tally.started, "requests_ok": tally.ok, "errors": len(tally.errors),
        "error_samples": tally.errors[:5], "hung": tally.hung, "lost": tally.started - finished,
        "kv_blocks_used_after": m["orthrus_kv_blocks_used"], "kv_blocks_total": m["orthrus_kv_blocks_total"],
        "pending_after": m["orthrus_num_requests_pending"],
        "engine_steps": m["orthrus_steps_total"], "mixed_steps": m["orthrus_mixed_steps_total"],
        "mixed_step_share": round(m["orthrus_mixed_steps_total"] / max(m["orthrus_steps_total"], 1), 3),
        "embed_inputs_per_s": round(tally.inputs_embedded / wall, 2),
        "chat_requests_per_s": round(tally.ok["chat"] / wall, 3),
        "rerank_requests_per_s": round(tally.ok["rerank"] / wall, 3),
        "pairs_scored_per_s": round(tally.pairs_scored / wall, 1),
        "generated_tokens_per_s": round(tally.tokens_generated / wall, 1),
        "latency_s": {k: {"p50": _pct(v, 50), "p95": _pct(v, 95)} for k, v in tally.latency.items() if v},
        "ttft_s": {"p50": _pct(tally.ttft, 50), "p95": _pct(tally.ttft, 95)},
    }


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names (docs/benchmarks/results/features-serv*.json, redrawn by
    scripts/bench/report.py): per run (`results["results"]["runs"]`, each a result of this script with a `label`),
    embedding inputs/s and chats/s, and the latency percentiles it recorded."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench.report import _plt, _save, caption, style_bars

    runs = results["results"]["runs"]
    labels = [r.get("label", str(i)).replace(", ", ",\n") for i, r in enumerate(runs)]
    plt = _plt()
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(8, 4))
    x = np.arange(len(runs))
    for i, (key, name) in enumerate((("embed_inputs_per_s", "embedding inputs/s"), ("chat_requests_per_s", "chats/s"))):
        bars = ax_t.bar(x + (i - 0.5) * 0.4, [r[key] for r in runs], 0.4, label=name)
        ax_t.bar_label(bars, [f"{r[key]:g}" for r in runs], fontsize=7)
    ax_t.set_xticks(x, labels, fontsize=7)
    ax_t.set(title="throughput", ylabel="per second")
    series = [(f"{kind} p{q}", [((r.get("latency_s", {}).get(kind) or {}).get(f"p{q}")) for r in runs])
              for kind in ("embed", "chat") for q in (50, 95)]
    series += [(f"TTFT p{q}", [(r.get("ttft_s") or {}).get(f"p{q}") for r in runs]) for q in (50, 95)]
    series = [(name, vals) for name, vals in series if any(v is not None for v in vals)]
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series):
        ax_l.bar(x + (i - (len(series) - 1) / 2) * width, [np.nan if v is None else v for v in vals], width,
                 label=name)
    ax_l.set_xticks(x, labels, fontsize=7)
    ax_l.set(title="latency", ylabel="seconds")
    style_bars(ax_t, ax_l, legend=True)
    clients = {r.get("clients") for r in runs}
    fig.suptitle(f"The OpenAI-compatible server under load ({'/'.join(map(str, sorted(clients)))} closed-loop "
                 "clients, half embeddings, half streamed chats)", fontsize=9)
    caption(fig, results["machine"], results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--embed-share", type=float, default=0.5, help="probability that a request is an embedding")
    p.add_argument("--rerank-share", type=float, default=0.0,
                   help="probability that a request is a rerank call (the server needs model.rerankers)")
    p.add_argument("--rerank-documents", type=int, default=20, help="documents per rerank call")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=300.0, help="a request slower than this is 'hung'")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("overrides", nargs="*", help="more `orthrus-rag serve` overrides")
    args = p.parse_args()
    if not (1 <= args.clients <= 512 and 0 < args.duration <= 1800):
        p.error("clients must be in [1, 512] and duration in (0, 1800] s")
    if not (0 <= args.embed_share and 0 <= args.rerank_share and args.embed_share + args.rerank_share <= 1
            and 1 <= args.rerank_documents <= 1000):
        p.error("the shares must be non-negative and sum to at most 1, and --rerank-documents in [1, 1000]")
    from orthrus_rag.entrypoints.openai.server import free_port

    port = args.port or free_port()
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"orthrus-serve-load-{port}"
    cmd = [sys.executable, "-m", "orthrus_rag.entrypoints.cli", "serve", "serve.host=127.0.0.1", f"serve.port={port}",
           "serve.log_level=warning", f"run_dir={run_dir}", *args.overrides]
    server = subprocess.Popen(cmd)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up within 600 s")
            time.sleep(1)
        result = asyncio.run(_run(args, base))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    ok = (not result["errors"] and not result["hung"] and not result["lost"] and result["kv_blocks_used_after"] == 0
          and result["pending_after"] == 0 and result["mixed_steps"] > 0)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
