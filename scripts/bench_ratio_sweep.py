"""Ratio sweep: every system of the same engine at saturation, embed:gen 9:1 … 1:9, side by side in one run.

The paper's workload (DESIGN.md, "The paper's workloads"): 64 closed-loop clients for 120 s, each request an
embedding or a generation, inputs of 128 words, generation max_tokens 150 at temperature 0.7. Scaled to this
CPU (SmolLM2-135M fp32, a step saturates at ~128 tokens) by default:

    clients 64 -> 16, duration 120 s -> 25 s per (system, mix), words 128 -> 32, max_tokens 150 -> 32
    (temperature 0.7, ignore_eos so every generation does the same work), token budget 128 per step.

6 systems x 5 mixes x (25 s + drain) plus one engine load per system: ~15-20 minutes on 2 cores. In-process
systems get 2 torch threads, the two-process ones (dedicated, disagg-pd) 1 thread per worker.
`--quick`: 9:1 and 1:9, orthrus and dedicated, 8 clients, 10 s, 16 words, 16 tokens (~1-2 minutes).

    python scripts/bench_ratio_sweep.py                       # -> runs/bench/ratio_sweep/{results.json,table.md,*.png}
    python scripts/bench_ratio_sweep.py --quick --systems orthrus,hetero-fcfs
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.driver import closed_loop, summarize  # noqa: E402
from bench.report import markdown_table, plot_latency_cdf, plot_step_mix, plot_throughput, write_json  # noqa: E402
from bench.workloads import Workload, make_request, mixed_stream  # noqa: E402
from orthrus_rag.engine.deploy import SYSTEMS, EngineSpec, ServingClient, make_client  # noqa: E402

FULL = {"systems": ",".join(SYSTEMS), "ratios": "9:1,7:3,5:5,3:7,1:9", "clients": 16, "duration": 25.0,
        "words": 32, "max_tokens": 32}
QUICK = {"systems": "orthrus,dedicated", "ratios": "9:1,1:9", "clients": 8, "duration": 10.0, "words": 16,
         "max_tokens": 16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a ~1-minute smoke run")
    p.add_argument("--systems", help=f"comma list of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--ratios", help="comma list of embed:gen mixes (default: 9:1,7:3,5:5,3:7,1:9)")
    p.add_argument("--clients", type=int, help="closed-loop clients (default 16)")
    p.add_argument("--duration", type=float, help="seconds per (system, mix) (default 25)")
    p.add_argument("--words", type=int, help="words per input (default 32)")
    p.add_argument("--max-tokens", type=int, help="generation max_tokens (default 32)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--max-chunk-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks of 16 tokens per engine")
    p.add_argument("--inproc-threads", type=int, default=2)
    p.add_argument("--split-threads", default="1,1", help="threads per worker of dedicated / disagg-pd")
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--peer", help="a system name to add ratio columns against (besides dedicated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/ratio_sweep")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def warm_up(client: ServingClient, w: Workload) -> None:
    """A few requests of each kind, so first-call overheads are not measured."""
    import random

    rng = random.Random(0)
    reqs = [make_request(rng, kind, f"warm-{kind}-{i}", Workload(w.words, 4)) for kind in ("embed", "generate")
            for i in range(2)]
    for r in reqs:
        client.submit(r.kind, r.request_id, r.input, r.params)  # type: ignore[arg-type]
    left, deadline = len(reqs), time.monotonic() + 300
    while left and time.monotonic() < deadline:
        left -= len(client.poll(0.05))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args()
    systems = args.systems.split(",")
    ratios = args.ratios.split(",")
    spec = EngineSpec(args.model, overrides={
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_chunk_tokens": args.max_chunk_tokens,
        "max_num_seqs": args.max_num_seqs, "num_blocks": args.num_blocks})
    split = tuple(int(x) for x in args.split_threads.split(","))
    out = Path(args.out)
    rows: list[dict] = []
    runs: dict[str, dict[str, dict]] = {r: {} for r in ratios}
    started = time.monotonic()
    for system in systems:
        threads = split if system in ("dedicated", "disagg-pd") else args.inproc_threads
        client = make_client(system, spec, threads)
        try:
            warm_up(client, Workload(args.words, args.max_tokens))
            for ratio in ratios:
                e, g = (float(x) for x in ratio.split(":"))
                w = Workload(args.words, args.max_tokens, args.temperature, seed=args.seed)
                res = closed_loop(client, mixed_stream(e / (e + g), w, prefix=ratio), args.clients, args.duration,
                                  drain_timeout_s=args.drain_timeout, label=f"{system} {ratio}")
                row = {"system": system, "group": ratio, **summarize(res)}
                rows.append(row)
                runs[ratio][system] = res.to_dict()
                k = row["kinds"]
                print(f"{system:>13} {ratio}: embed {k['embed']['throughput_rps']:.2f} req/s "
                      f"(p95 {k['embed']['p95_s']:.2f} s), generate {k['generate']['throughput_rps']:.2f} req/s "
                      f"(p95 {k['generate']['p95_s']:.2f} s), CPU {row['cpu_mean_pct'] or 0:.0f}%", flush=True)
                if res.records and row["unfinished"]:
                    client.shutdown()  # NOTE: leftovers would load the next mix; start clean
                    client = make_client(system, spec, threads)
        finally:
            client.shutdown()
    rows.sort(key=lambda r: (ratios.index(r["group"]), systems.index(r["system"])))
    write_json(out / "results.json", {"args": vars(args), "rows": rows, "runs": runs,
                                      "elapsed_s": time.monotonic() - started})
    table = markdown_table(rows, peer=args.peer)
    (out / "table.md").write_text(table)
    plot_throughput(rows, out / "throughput.png")
    for ratio in ratios:
        tag = ratio.replace(":", "-")
        plot_latency_cdf(runs[ratio], out / f"latency_cdf_{tag}.png", title=f"({ratio})")
        plot_step_mix(runs[ratio], out / f"step_mix_{tag}.png", title=f"({ratio})")
    print(table)
    print(f"wrote {out}/ in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
