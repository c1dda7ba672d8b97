"""Where a decode step's time goes, by the runner's parts: wall time of each, per step.

    python scripts/step_phases.py --threads 1 --batch 32 --dtype auto [--option linear_kernel=onednn]
    python scripts/step_phases.py --threads 1 --batch 8 --prompt-len 256 --tokens 1   # prefill steps
    python scripts/step_phases.py --threads 2 --batch 22 --prompt-len 45 --tokens 40 --embeds 280   # 9:1-like

Wraps the engine's step, the runner's execute / prepare / forward, the attention backend's plan and forward, the C++
decode and prefill kernels, the logits and the sampler with timers (the torch profiler does not see the C++ kernels
or Python between ops), runs `--batch` prompts of `--prompt-len` tokens to `--tokens` new tokens (with `--embeds`
embedding inputs of `--embed-len` tokens in the same steps) and prints ms per step. The layer-level timers
(attention, its kernels) fire only on the Python layer loop: with the C++ one (`cpu_layer_loop`, on by default) the
forward is one call; `--option cpu_layer_loop=false` looks inside it.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams
from orthrus_rag.engine.core import scheduler as scheduler_module
from orthrus_rag.engine.engine import Engine as EngineClass
from orthrus_rag.engine.executor import runner as runner_module
from orthrus_rag.config.build import parse_option
from orthrus_rag.layers.attention import grouped

TOTALS: collections.Counter = collections.Counter()


def timed(owner: object, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--prompt-len", type=int, default=33, help="prompt tokens (256 with --tokens 1: prefill steps)")
    ap.add_argument("--embeds", type=int, default=0,
                    help="embedding inputs (mean pooling) submitted with the prompts: shared steps")
    ap.add_argument("--embed-len", type=int, default=33)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--option", action="append", default=[], help="an engine option NAME=VALUE; repeatable")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = dict(parse_option(o) for o in args.option)
    engine = Engine.from_pretrained(args.model, max_num_batched_tokens=256, num_blocks=2048, dtype=args.dtype,
                                    **options)
    for owner, name, label in [(EngineClass, "step", "engine.step"), (runner_module.ModelRunner, "execute", "execute"),
                               (runner_module.ModelRunner, "_prepare", "prepare inputs"),
                               (runner_module.ModelRunner, "_forward", "model forward"),
                               (grouped, "plan", "attention plan"), (grouped, "forward", "attention (all layers)"),
                               (grouped, "decode_attention", "decode kernel (all layers)"),
                               (grouped, "prefill_attention", "prefill kernel (all layers)"),
                               (scheduler_module.Scheduler, "schedule", "schedule"),
                               (scheduler_module.Scheduler, "update_from_output", "scheduler update"),
                               (engine.runner.model, "compute_logits", "logits"),
                               (engine.runner, "sampler", "sampler")]:
        timed(owner, name, label)
    prompts = [[1] + list(range(100 + i, 99 + args.prompt_len + i)) for i in range(args.batch)]
    # NOTE: warm up on other token ids: the measured prompts must not hit the prefix cache
    warmup = [[t + 5000 for t in p] for p in prompts]
    engine.generate(warmup, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    TOTALS.clear()
    steps = engine.num_steps
    texts = [list(range(20_000 + i, 20_000 + i + args.embed_len)) for i in range(args.embeds)]
    engine.run(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True), texts=texts,
               pooling_params=PoolingParams(pooling="mean"))
    steps = engine.num_steps - steps
    dtype = engine.runner.kv_caches[0][0].dtype
    print(f"{args.model}, {dtype}, batch {args.batch}, {args.embeds} embeddings, {args.threads} thread(s), "
          f"{steps} steps")
    for label, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {seconds / steps * 1e3:8.2f} ms/step")


if __name__ == "__main__":
    main()
