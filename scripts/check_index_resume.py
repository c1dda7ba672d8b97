"""A corpus build, uninterrupted and SIGKILLed part-way then resumed, compared: wall time, peak RSS, and whether
the resumed build holds the same vectors and gives the same top-k for real queries.

    .venv/bin/python scripts/check_index_resume.py --corpus runs/corpus_200k.jsonl.gz --out runs/resume_check \\
        --queries dev.jsonl --kill-at 0.5 -- retriever.shard_size=4096

Both builds run `orthrus-rag index corpus=jsonl corpus.path=<corpus>` plus the overrides after `--`, each in its
own process; peak RSS is the largest resident set of that process tree, sampled every 0.2 s. The kill lands once
`--kill-at` of the corpus's shards are recorded in build.json. Prints one JSON line per build and one for the
comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]


def _rss(proc: psutil.Process) -> int:
    try:
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def _own_rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def run_index(run_dir: Path, args: list[str], kill_after_shards: int | None = None) -> dict:
    """`orthrus-rag index` into `run_dir`; returns wall seconds, peak RSS (of the process tree, and of the build's
    own process: a first use of changed C++ kernels compiles them in a child, whose ~1 GB the tree's peak counts)
    and whether it was killed."""
    cmd = [str(ROOT / ".venv" / "bin" / "orthrus-rag"), "index", *args]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    ps, peak, own, killed = psutil.Process(proc.pid), 0, 0, False
    state = run_dir / "index" / "build.json"
    while proc.poll() is None:
        peak = max(peak, _rss(ps))
        own = max(own, _own_rss(ps))
        if kill_after_shards is not None and state.is_file():
            try:
                done = len(json.loads(state.read_text())["shards"])
            except (ValueError, OSError):
                done = 0
            if done >= kill_after_shards:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
                break
        time.sleep(0.2)
    return {"run_dir": str(run_dir), "seconds": round(time.perf_counter() - start, 1),
            "peak_rss_gib": round(peak / 2**30, 2), "peak_rss_gib_build_process": round(own / 2**30, 2),
            "killed": killed, "returncode": proc.returncode}


def _finished(folder: Path) -> bool:
    """The build in `folder` ran to its end (the index's manifest is written last)."""
    return (folder / "index" / "manifest.json").is_file()


def vectors(folder: Path) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted((folder / "index" / "vectors").glob("shard-*.npy"))])


def top_k(folder: Path, queries: list[str], k: int, overrides: list[str]) -> list[list[str]]:
    """The top-k passage ids of each query, through the index as a run opens it."""
    from hydra import compose, initialize_config_module

    from orthrus_rag.config.app import register_configs
    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.entrypoints.commands import build_retriever

    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[*overrides, f"retriever.index_dir={folder / 'index'}"])
    client = build_client(cfg)
    try:
        retriever = build_retriever(cfg, client, [], None)
        return [[p.id for p, _ in hits] for hits in retriever.batch_search(queries, k)]
    finally:
        import asyncio

        asyncio.run(client.aclose())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--queries", type=Path, required=True, help="a QA file whose questions are the queries")
    ap.add_argument("--num-queries", type=int, default=100)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the shards recorded before the kill")
    ap.add_argument("--continue", dest="cont", action="store_true",
                    help="keep what an earlier, stopped run of this check into --out finished: a finished build "
                         "(its manifest written) is not built again, and a killed build is resumed, not restarted")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both builds (after --)")
    args = ap.parse_args()
    from orthrus_rag.data import load_qa
    from orthrus_rag.data.corpus import count_passages

    base = ["corpus=jsonl", f"corpus.path={args.corpus}", "progress=false", *args.overrides]
    shard_size = next((int(o.split("=", 1)[1]) for o in args.overrides if o.startswith("retriever.shard_size=")),
                      4096)
    total = count_passages(type("C", (), {"kind": "jsonl", "path": str(args.corpus), "limit": None})())
    shards = -(-total // shard_size)
    args.out.mkdir(parents=True, exist_ok=True)
    whole, cut = args.out / "whole", args.out / "resumed"
    kill = max(1, int(shards * args.kill_at))
    # NOTE: each row as its build ends: a 200k-passage check runs over an hour (and may be continued later)
    if args.cont and _finished(whole):
        print(json.dumps({"build": "uninterrupted", "kept": str(whole)}), flush=True)
    else:
        print(json.dumps({"build": "uninterrupted", "passages": total,
                          **run_index(whole, [*base, f"run_dir={whole}"])}), flush=True)
    if args.cont and (cut / "index" / "build.json").is_file():
        print(json.dumps({"build": "killed", "kept": str(cut)}), flush=True)
    else:
        print(json.dumps({"build": "killed", "after_shards": kill, "of_shards": shards,
                          **run_index(cut, [*base, f"run_dir={cut}"], kill_after_shards=kill)}), flush=True)
    if not (args.cont and _finished(cut)):
        print(json.dumps({"build": "resumed", **run_index(cut, [f"resume={cut}", "progress=false"])}), flush=True)
    a, b = vectors(whole), vectors(cut)
    questions = [ex.question for ex in load_qa("2wiki", path=str(args.queries), limit=args.num_queries)]
    ids_a = top_k(whole, questions, args.k, base)
    ids_b = top_k(cut, questions, args.k, base)
    print(json.dumps({"comparison": "resumed vs uninterrupted", "vectors": list(a.shape),
                      "same_shape": a.shape == b.shape,
                      "max_abs_diff": float(np.abs(a - b).max()) if a.shape == b.shape else None,
                      "same_top_k": sum(x == y for x, y in zip(ids_a, ids_b)), "queries": len(questions),
                      "k": args.k}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
