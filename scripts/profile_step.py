"""Profile engine steps of a chosen mix: where a step's time goes (torch profiler, self CPU time per op).

Sets up a steady state, then profiles `--steps` steps: `--decodes` generations already decoding (prompts of
`--prompt-len` tokens, prefilled before the profile), and `--embeds` embedding inputs of `--embed-len` tokens
plus `--prefills` further prompts pending, so each profiled step carries the decodes and as many embedding /
prompt tokens as the policy and budget let ride.

    python scripts/profile_step.py --threads 1 --decodes 16 --embeds 32 --steps 8
    python scripts/profile_step.py --decodes 32 --prompt-len 1000 --steps 8        # long-context decode
    python scripts/profile_step.py --threads 1 --decodes 32 --embeds 0 --adapters 4 --option lora_kernel=per_slot

Prints the step times, the top ops, the time spent inside torch ops per step (what is not there ran in Python
or in the C++ decode kernel, which the profiler does not see), and the share of that time in GEMMs with the
GFLOP/s they reached.
"""

from __future__ import annotations

import argparse
from typing import Any
import json
import logging
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from orthrus_rag import Engine, PoolingParams, SamplingParams  # noqa: E402
from orthrus_rag.config.build import parse_option  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::bmm")


def _ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * j) % 30000 + 100 for j in range(n)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy", default="orthrus")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens (and chunk size)")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--embeds", type=int, default=32)
    ap.add_argument("--embed-len", type=int, default=32)
    ap.add_argument("--prefills", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--adapters", type=int, default=0,
                    help="random rank-8 LoRA adapters on all 7 projections; the decodes are spread over them")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=parse_option,
                    help="an engine option, e.g. cpu_decode_kernel=false; repeatable")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    options = dict(args.option)
    # NOTE: a KV cache that holds every sequence of the profile (prompts + what they decode meanwhile), so no
    # step preempts; the default 1 GiB holds ~23k SmolLM2 tokens, fewer than 32 prompts of 1,000
    seqs = args.decodes + args.prefills
    options.setdefault("num_blocks", max(1024, -(-seqs * (args.prompt_len + 2 * args.budget) // 16)))
    names = _make_adapters(args.model, args.adapters)
    if names:
        options["adapters"] = names
    engine = Engine.from_pretrained(args.model, policy=args.policy, max_num_batched_tokens=args.budget,
                                    max_chunk_tokens=args.budget, enable_prefix_caching=False, **options)
    for i in range(args.decodes):
        # outlives the profile
        adapter = list(names)[i % len(names)] if names else None
        engine.add_generate(_ids(args.prompt_len, i), SamplingParams(max_tokens=1_000, temperature=0.0,
                                                                     ignore_eos=True, adapter=adapter))
    long = SamplingParams(max_tokens=1_000, temperature=0.0, ignore_eos=True)
    sched = engine.scheduler
    for _ in range(10_000):  # bounded: prefill every prompt, so that the profiled steps start decoding
        if all(r.is_decoding for r in sched.running) and not sched.waiting:
            break
        engine.step()
    else:
        raise SystemExit("the prompts did not all reach decoding (KV cache too small? see --option num_blocks=N)")
    for _ in range(2):  # warm-up: decode-only steps, so the mix below is profiled from its first step
        engine.step()
    pp = PoolingParams(pooling="mean")
    for i in range(args.embeds):
        engine.add_embed(_ids(args.embed_len, 10_000 + i), pp)
    for i in range(args.prefills):
        engine.add_generate(_ids(args.prompt_len, 20_000 + i), long)
    times: list[float] = []
    mix: list[dict[str, int]] = []
    engine.step_observers.append(lambda st: mix.append(dict(
        embed=st.num_embed_tokens + st.num_encoder_tokens, prefill=st.num_prefill_tokens, decode=st.num_decode_tokens)))
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = [e for e in events if e.key in GEMM_OPS]
    gemm_us = sum(e.self_cpu_time_total for e in gemm)
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    result = {
        "threads": args.threads, "decodes": args.decodes, "prompt_len": args.prompt_len, "embeds": args.embeds,
        "embed_len": args.embed_len, "budget": args.budget, "policy": args.policy,
        "step_ms_median": round(1000 * statistics.median(times), 1),
        "step_ms": [round(1000 * t, 1) for t in times],
        "tokens_per_step": mix,
        # time inside torch ops per step; the rest of step_ms ran outside them (Python, the C++ decode kernel)
        "op_ms_per_step": round(total / args.steps / 1000, 1),
        "gemm_share": round(gemm_us / max(total, 1), 3),  # of the time inside torch ops
        # flops are counted on aten::mm / addmm only (the profiler's rule); oneDNN linears report none
        "gemm_gflops": round(sum(e.flops for e in gemm) / max(gemm_us, 1) / 1e3, 1),
    }
    print(json.dumps(result))
    engine.shutdown()
    return result


def _make_adapters(model: str, count: int) -> dict[str, str]:
    """`count` random adapters in a temporary folder: {name: path}."""
    if not count:
        return {}
    import sys
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from orthrus_rag.models.registry import resolve_model_path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.make_lora_adapter import make_adapter

    tmp = Path(tempfile.mkdtemp(prefix="orthrus-profile-lora-"))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model)), dtype=torch.float32)
    names = {}
    for i in range(count):
        make_adapter(hf, str(tmp / f"a{i}"), init="random", seed=i,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        names[f"a{i}"] = str(tmp / f"a{i}")
    return names


if __name__ == "__main__":
    main()
