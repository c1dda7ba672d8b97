"""Search latency and recall of FAISS indexes over one built corpus: flat, IVF, IVF-PQ and HNSW (any specs), each
built from the vectors an `orthrus-rag index` folder keeps (`vectors/`: nothing is embedded again), searched with
real questions embedded as a run embeds them.

    .venv/bin/python scripts/bench_search.py --index runs/index200k/index --queries dev.jsonl --threads 2

(`dev.jsonl`: the 2WikiMultihopQA dev file whose questions to search.)

Each spec is built the way `IndexBuilder` builds it (`empty_index`, `train` on a seeded `train_size` sample,
`add_shards`, `configure`); then every query is searched on its own, as a run's question does, and
its passages read from the memory-mapped store: p50 / p95 of that, queries/s of one batched call, recall@k
against the flat index (the share of flat's top-k each index returns), and recall@k of the questions' supporting
paragraphs (by title, as runs score it). Prints one JSON line per spec and a table. `plot_results` redraws the
committed figure (docs/benchmarks/results/search-*.json, through scripts/bench/report.py; the page is
docs/benchmarks/search.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from orthrus_rag.pipelines.evaluate import recall_at_k
from orthrus_rag.retrievers import store
from orthrus_rag.retrievers.faiss_index import (
    IndexSpec,
    add_shards,
    configure,
    empty_index,
    import_faiss,
    sample_shards,
    train,
)
from orthrus_rag.retrievers.passage_store import PassageStore

logger = logging.getLogger("bench_search")

# name -> spec: flat, IVF, IVF-PQ and HNSW, at FAISS's usual settings for ~10^5 vectors (nlist ~ 4 sqrt(n))
DEFAULT_SPECS = {
    "flat": IndexSpec("flat"),
    "ivf1024_flat_np16": IndexSpec("ivf", nlist=1024, nprobe=16),  # the inverted file alone, no compression
    "ivf1024_pq64_np16": IndexSpec("factory", factory="IVF1024,PQ64", nprobe=16),
    "ivf1024_pq64_np64": IndexSpec("factory", factory="IVF1024,PQ64", nprobe=64),
    "hnsw32_ef64": IndexSpec("hnsw", hnsw_m=32, ef_search=64),
    "hnsw32_ef128": IndexSpec("hnsw", hnsw_m=32, ef_search=128),
}


def shard_vectors(folder: Path) -> list[np.ndarray]:
    return [np.load(p, mmap_mode="r") for p in sorted((folder / "vectors").glob("shard-*.npy"))]


def build(spec: IndexSpec, shards: list[np.ndarray], seed: int) -> tuple[object, float]:
    """`spec`'s index over the shards, as IndexBuilder assembles it; and the seconds it took."""
    started = time.perf_counter()
    index = empty_index(spec, shards[0].shape[1], sum(len(s) for s in shards))
    if not index.is_trained:
        train(index, sample_shards(shards, spec.train_size, seed), spec)
    add_shards(index, shards)
    configure(index, spec)
    return index, time.perf_counter() - started


def query_vectors(index_folder: Path, questions: list[str], overrides: list[str]) -> np.ndarray:
    """The questions embedded by the index's own query embedder, through the engine, as a run embeds them."""
    import asyncio

    from hydra import compose, initialize_config_module

    from orthrus_rag.config.app import register_configs
    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.embedding import build_embedder

    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        cfg = compose(config_name="config", overrides=["progress=false", *overrides])
    client = build_client(cfg)
    try:
        embedder = build_embedder(cfg, client)
        manifest = store.read_manifest(index_folder / store.MANIFEST_FILE)
        diff = store.identity_diff(manifest["embedder"], embedder.identity)
        if diff:
            raise SystemExit(f"the query embedder differs from the index's: {diff}")
        return np.ascontiguousarray(embedder.embed_queries(questions), dtype=np.float32)
    finally:
        asyncio.run(client.aclose())


def measure(index: object, queries: np.ndarray, k: int, passages: PassageStore,
            supporting: list[list[str]]) -> dict:
    one, found_titles = [], []
    ids = np.empty((len(queries), k), dtype=np.int64)
    for i, q in enumerate(queries):
        started = time.perf_counter()
        _, found = index.search(q[None], k)
        hits = [passages[j] for j in found[0] if j >= 0]  # what a run reads next
        one.append(time.perf_counter() - started)
        found_titles.append([p.title for p in hits])
        ids[i] = found[0]
    started = time.perf_counter()
    index.search(queries, k)
    batched = time.perf_counter() - started
    ms = np.asarray(one) * 1e3
    gold = [recall_at_k(t, s, k) for t, s in zip(found_titles, supporting)]
    gold = [g for g in gold if g is not None]
    return {f"supporting_recall@{k}": round(float(np.mean(gold)), 3) if gold else None,
            "p50_ms": round(float(np.percentile(ms, 50)), 3), "p95_ms": round(float(np.percentile(ms, 95)), 3),
            "batch_qps": round(len(queries) / batched, 1), "ids": ids}


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the PNG a committed results file names: recall@k against flat over per-query search latency, one point
    per index (p50, with a bar out to p95), from the JSON lines' fields (`results["results"]["rows"]`)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench.report import _plt, _save, caption

    rows = results["results"]["rows"]
    k = rows[0]["k"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        p50, p95, recall = r["p50_ms"], r["p95_ms"], r[f"recall@{k}_vs_flat"]
        ax.plot([p50, p95], [recall, recall], color="0.6", lw=1)
        ax.plot(p50, recall, "o", ms=7, label=f"{r['index']} ({r['bytes'] / 2**20:.0f} MiB)")
        ax.plot(p95, recall, "|", color="0.4", ms=8)
    ax.set_xscale("log")
    ax.set(title=f"Search over {rows[0]['passages']:,} passages: top-{k} agreement with flat against latency",
           xlabel="search latency per query, ms (dot: p50, bar end: p95; log scale)",
           ylabel=f"recall@{k} against flat")
    ax.title.set_fontsize(9)
    ax.set_ylim(0.5, 1.05)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    caption(fig, results["machine"].split(";")[0] + f"; {rows[0]['threads']} FAISS threads", results.get("measured"))
    return [_save(fig, Path(out_dir) / results["plots"][0])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True, help="an `orthrus-rag index` output folder (has vectors/)")
    ap.add_argument("--queries", type=Path, required=True, help="a 2Wiki-format QA file whose questions to search")
    ap.add_argument("--num-queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="FAISS OpenMP threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help=f"a subset of {', '.join(DEFAULT_SPECS)} (flat always runs)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides naming the query embedder (after --)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from orthrus_rag.data import load_qa

    faiss = import_faiss()
    faiss.omp_set_num_threads(args.threads)
    examples = load_qa("2wiki", path=str(args.queries), limit=args.num_queries)
    queries = query_vectors(args.index, [ex.question for ex in examples], args.overrides)
    supporting = [ex.supporting_titles for ex in examples]
    shards = shard_vectors(args.index)
    passages = PassageStore(args.index / store.PASSAGES_DIR)
    n = sum(len(s) for s in shards)
    names = ["flat", *[s for s in (args.only or DEFAULT_SPECS) if s != "flat"]]
    rows, exact, built = [], None, {}
    for name in names:
        spec = replace(DEFAULT_SPECS[name])
        key = (spec.factory_string(n), spec.hnsw_m, spec.train_size)
        if key in built:  # NOTE: the same index at other search settings: built once
            index, build_s = built[key]
            configure(index, spec)
        else:
            built.clear()
            index, build_s = built[key] = build(spec, shards, args.seed)
        result = measure(index, queries, args.k, passages, supporting)
        ids = result.pop("ids")
        if exact is None:
            exact = ids
        recall = float(np.mean([len(set(a) & set(b)) / args.k for a, b in zip(ids.tolist(), exact.tolist())]))
        row = {"index": name, "factory": spec.factory_string(n), "nprobe": spec.nprobe, "ef_search": spec.ef_search,
               "passages": n, "queries": len(queries), "k": args.k, "threads": args.threads,
               "build_s": round(build_s, 1), "bytes": int(faiss.serialize_index(index).nbytes), **result,
               f"recall@{args.k}_vs_flat": round(recall, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    k = args.k
    print(f"\n| index | build s | MiB | p50 ms | p95 ms | batch q/s | recall@{k} vs flat | supporting recall@{k} |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['index']} | {r['build_s']} | {r['bytes'] / 2**20:.0f} | {r['p50_ms']} | {r['p95_ms']} | "
              f"{r['batch_qps']} | {r[f'recall@{k}_vs_flat']} | {r[f'supporting_recall@{k}']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
