"""Where the engine's CPU time goes: profile steps of a mix you choose, time a step by the runner's parts, compare
the C++ layer loop with and without its column split, and time each C++ kernel against the torch ops it replaces.

    python scripts/profiling.py step --threads 1 --decodes 16 --embeds 32 --steps 8     # torch profiler, top ops
    python scripts/profiling.py phases --threads 1 --batch 32 --dtype auto               # wall time per runner part
    python scripts/profiling.py layer-split --rows 128 256 512                           # column split on and off
    python scripts/profiling.py kernels --threads 1 --dtype bfloat16 --only attention encoder
    python scripts/profiling.py memory --model smollm2-135m-instruct --quantization auto      # memory after load
    python scripts/profiling.py rss --match "orthrus-rag serve" --match llama-server --seconds 120  # servers' memory

These explain a figure rather than make one (docs/benchmarks/methodology.md). `python scripts/profiling.py
COMMAND --help` describes each command and its options.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from orthrus_rag.config.build import parse_option  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::bmm")
H, KVH, D, HIDDEN, INTER = 9, 3, 64, 576, 1536  # SmolLM2-135M
BLOCK = 16


def _fail(message: str) -> None:
    raise SystemExit(f"error: {message}")


# ---------------------------------------------------------------- step: engine steps under the torch profiler ----


def step(args: argparse.Namespace) -> dict[str, Any]:
    """Profile engine steps of a chosen mix: where a step's time goes (torch profiler, self CPU time per op).

    Sets up a steady state, then profiles `--steps` steps: `--decodes` generations already decoding (prompts of
    `--prompt-len` tokens, prefilled before the profile), and `--embeds` embedding inputs of `--embed-len` tokens
    plus `--prefills` further prompts pending, so each profiled step carries the decodes and as many embedding /
    prompt tokens as the policy and budget let ride.

        python scripts/profiling.py step --threads 1 --decodes 16 --embeds 32 --steps 8
        python scripts/profiling.py step --decodes 32 --prompt-len 1000 --steps 8        # long-context decode
        python scripts/profiling.py step --threads 1 --decodes 32 --embeds 0 --adapters 4 \\
            --option 'kernel_overrides={"lora": "per_slot"}'

    Prints the step times, the top ops, the time spent inside torch ops per step (what is not there ran in Python
    or in the C++ decode kernel, which the profiler does not see), and the share of that time in GEMMs with the
    GFLOP/s they reached.
    """
    from torch.profiler import ProfilerActivity, profile

    from orthrus_rag import Engine, PoolingParams, SamplingParams

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


def _ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * j) % 30000 + 100 for j in range(n)]


def _make_adapters(model: str, count: int) -> dict[str, str]:
    """`count` random adapters in a temporary folder: {name: path}."""
    if not count:
        return {}
    import tempfile

    from transformers import AutoModelForCausalLM

    from orthrus_rag.models.registry import resolve_model_path

    sys.path.insert(0, str(ROOT))
    from scripts.make_lora_adapter import make_adapter

    tmp = Path(tempfile.mkdtemp(prefix="orthrus-profile-lora-"))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model)), dtype=torch.float32)
    names = {}
    for i in range(count):
        make_adapter(hf, str(tmp / f"a{i}"), init="random", seed=i,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        names[f"a{i}"] = str(tmp / f"a{i}")
    return names


# ---------------------------------------------------------------- phases: a step by the runner's parts ----------

TOTALS: collections.Counter = collections.Counter()


def timed(owner: object, name: str, label: str) -> None:
    """Wrap `owner.name` so each call's wall time adds to TOTALS[label]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def phases(args: argparse.Namespace) -> dict[str, float]:
    """Where a step's time goes, by the runner's parts: wall time of each, per step.

        python scripts/profiling.py phases --threads 1 --batch 32 --dtype auto \\
            [--option 'kernel_overrides={"linears": "onednn"}']
        python scripts/profiling.py phases --threads 1 --batch 8 --prompt-len 256 --tokens 1   # prefill steps
        python scripts/profiling.py phases --threads 2 --batch 22 --prompt-len 45 --tokens 40 --embeds 280   # 9:1-like

    Wraps the engine's step, the runner's execute / prepare / forward, the attention backend's plan and forward, the
    C++ decode and prefill kernels, the logits and the sampler with timers (the torch profiler does not see the C++
    kernels or Python between ops), runs `--batch` prompts of `--prompt-len` tokens to `--tokens` new tokens (with
    `--embeds` embedding inputs of `--embed-len` tokens in the same steps) and prints ms per step. The layer-level
    timers (attention, its kernels) fire only on the Python layer loop: with the C++ one (`layers=split`, the
    default) the forward is one call; `--option 'kernel_overrides={"layers": "fused"}'` looks inside it.
    """
    from orthrus_rag import Engine, PoolingParams, SamplingParams
    from orthrus_rag.engine.core import scheduler as scheduler_module
    from orthrus_rag.engine.engine import Engine as EngineClass
    from orthrus_rag.engine.executor import runner as runner_module
    from orthrus_rag.layers.attention import grouped

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, max_num_batched_tokens=256, num_blocks=2048, dtype=args.dtype,
                                    **dict(args.option))
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
    per_step = {label: seconds / steps * 1e3 for label, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1])}
    for label, ms in per_step.items():
        print(f"  {label:28s} {ms:8.2f} ms/step")
    return per_step


# ---------------------------------------------------------------- layer-split: the C++ loop's column split ------


class SplitStep:
    """One step's inputs and fresh caches: chunks of `chunk` tokens filling `rows` rows (less the decodes), and
    `decodes` one-token decodes after `context` cached tokens."""

    def __init__(self, model, rows: int, chunk: int, decodes: int, context: int, chunk_context: int = 0) -> None:
        from orthrus_rag.layers.attention import cpu_prefill, grouped
        from orthrus_rag.layers.context import build_metadata

        att = model.attention_layers[0]
        dtype = model.lm_head.weight.dtype
        chunk_rows = rows - decodes
        q_lens = [min(chunk, chunk_rows - s) for s in range(0, chunk_rows, chunk)] + [1] * decodes
        ctx = [chunk_context] * (len(q_lens) - decodes) + [context] * decodes
        tables, block = [], 0
        for q, c in zip(q_lens, ctx):
            need = math.ceil((q + c) / BLOCK)
            tables.append(list(range(block, block + need)))
            block += need
        slots = block * BLOCK
        self.caches = [(torch.zeros(slots, att.num_kv_heads, att.head_dim, dtype=dtype),
                        torch.zeros(slots, att.num_kv_heads, att.head_dim, dtype=dtype))
                       for _ in model.attention_layers]
        self.meta = build_metadata(q_lens, ctx, tables, [True] * len(q_lens), BLOCK, slots, torch.device("cpu"))
        self.meta.decode_kernel = True
        self.meta.prefill_kernel = cpu_prefill.prefill_kernel_available(dtype, att.head_dim)  # as the runner chooses
        self.meta.plan = grouped.plan(self.meta, {a.window for a in model.attention_layers})
        torch.manual_seed(0)
        self.ids = torch.randint(0, model.lm_head.weight.shape[0], (rows,))

    def run(self, model) -> torch.Tensor:
        from orthrus_rag.layers.attention import grouped
        from orthrus_rag.layers.context import ForwardContext, forward_context

        with torch.inference_mode(), forward_context(ForwardContext(attn=self.meta, attn_backend=grouped,
                                                                    kv_caches=self.caches)):
            return model(self.ids, self.meta.positions)


def _time_step(model, step_: SplitStep, reps: int) -> tuple[float, torch.Tensor]:
    out = step_.run(model)  # NOTE: a first step gathers the loop's arguments and warms oneDNN's primitive cache
    start = time.perf_counter()
    for _ in range(reps):
        step_.run(model)
    return (time.perf_counter() - start) / reps * 1e3, out


def layer_split(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The C++ layer loop with and without its column-split form (layers/cpu_layer_split.py), on whole model steps.

        python scripts/profiling.py layer-split --rows 16 64 256 512          # two threads, the engine's dtype (auto)
        python scripts/profiling.py layer-split --rows 256 --decodes 16     # chunks beside decodes, long context
        python scripts/profiling.py layer-split --rows 256 --chunk 128 --chunk-context 1024 --python-loop   # IRCoT-like

    Loads the model as the engine does (packing, fused kernels, the layer loop), builds steps of `--rows` rows:
    chunks of `--chunk` tokens from position 0 (the ratio sweep's embeddings and prompts: 16-48 words) or after
    `--chunk-context` cached tokens (prompts that grow round by round, as IRCoT's do), optionally beside
    `--decodes` decodes over `--context` cached tokens, and times the decoder's forward on them with the split form
    on and off (`--python-loop`: and the Python loop of the same kernels), alternated `--rounds` times in one run.
    Prints one JSON line per row count: ms per step of each form, their ratio, and the largest difference between
    the two forms' hidden states (0 where every part's product gave the whole product's bits); `--fp32-reference`:
    each form's relative error from the same step on the model in fp32.
    """
    from orthrus_rag import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, kernel_overrides={"linears": args.linear_kernel,
                                                                                  "decode_linears": "off"},
                                    num_blocks=64, max_num_batched_tokens=256)
    model = engine.runner.model
    loop = model.model.layer_loop
    if loop is None:
        _fail("this model runs no C++ layer loop here (see `orthrus-rag plan`: its layers, or the extension)")
    loop.split_from = 1  # NOTE: every row count measured in the split form when it is on
    reference = None
    if args.fp32_reference:
        reference = Engine.from_pretrained(args.model, dtype="float32", num_blocks=64, max_num_batched_tokens=256,
                                           kernel_overrides={"linears": args.linear_kernel, "layers": "loop"}
                                           ).runner.model
    results = []
    for rows in args.rows:
        if not 0 <= args.decodes < rows:
            _fail(f"--decodes must be below each row count ({rows})")
        step_ = SplitStep(model, rows, args.chunk, args.decodes, args.context, args.chunk_context)
        forms = ["python", "whole", "split"] if args.python_loop else ["whole", "split"]
        times: dict[str, list[float]] = {f: [] for f in forms}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for form in forms:
                model.model.layer_loop = None if form == "python" else loop
                loop.split = form == "split"
                before = loop.split_steps
                ms, outs[form] = _time_step(model, step_, args.reps)
                if form == "split" and loop.split_steps == before:
                    _fail("the split form was not taken (one thread, no packed weights, or the Python loop)")
                times[form].append(round(ms, 2))
        model.model.layer_loop = loop
        result = {"rows": rows, "decodes": args.decodes, "chunk_context": args.chunk_context,
                  "threads": args.threads, "dtype": str(outs["split"].dtype).removeprefix("torch."),
                  **{f"{f}_ms": times[f] for f in forms},
                  "speedup_median": round(statistics.median(times["whole"]) / statistics.median(times["split"]), 3),
                  "max_abs_diff": (outs["split"].float() - outs["whole"].float()).abs().max().item()}
        if reference is not None:
            want = SplitStep(reference, rows, args.chunk, args.decodes, args.context, args.chunk_context).run(reference)
            for form in forms:
                result[f"{form}_rel_err_vs_fp32"] = round(((outs[form].float() - want).norm() / want.norm()).item(), 4)
        if args.python_loop:
            python_over_whole = statistics.median(times["python"]) / statistics.median(times["whole"])
            result["python_over_whole"] = round(python_over_whole, 3)
            result["python_equals_whole"] = torch.equal(outs["python"], outs["whole"])
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


# ---------------------------------------------------------------- kernels: each C++ kernel against torch --------


def kernels(args: argparse.Namespace) -> None:
    """The CPU extension's kernels against the torch ops they replace, one thread, SmolLM2-135M's shapes.

        python scripts/profiling.py kernels [--threads 1] [--dtype bfloat16] [--only attention encoder]

    Attention: the prefill kernel (attention/cpu_prefill.py) against torch's SDPA on the same inputs (bf16, or
    fp32: the kernel's fp32 body), causal over a chunk's own keys and after a cached prefix, with the largest error
    of each to an fp32 reference; and the encoder's bidirectional form (attention/cpu_encoder.py) on MiniLM's 12
    heads of 32 against one SDPA call per sequence (what the encoder runs without it), over packed batches.
    Decode: a 32-sequence step's attention over 30 layers' cold caches, the decode kernel's generic path against its
    AVX512-BF16 one (layers/attention/cpu_kernels.py).
    Elementwise: residual add + RMSNorm, rotary (q and k) and SiLU-and-mul (layers/cpu_elementwise.py) against the
    eager ops, at 1, 32 and 256 rows (a decode at batch 1 and 32, a prefill chunk).
    LoRA: one rank-8 adapter on all seven projections of one SmolLM2 layer (Q/K/V and gate/up fused), its update
    on 1, 32 and 256 rows: torch's per-slot ops (what `lora=per_slot` takes) against the C++ kernel
    (layers/lora_fused.py), each as the extra time over the same projections without adapter rows.
    Sampler: a step's draw at temperature 0.7 over SmolLM2's 49,152 logits, every row seeded (as the benchmarks'
    requests are), at 1, 32 and 64 rows: `torch.multinomial` per row (the draw the sampler's kernel replaces), the
    Sampler on torch's ops (fp64 cumsum), and on the C++ kernel (layers/csrc/sampling.h). One JSON line per row.
    """
    from orthrus_rag.layers import cpu_elementwise

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not cpu_elementwise.available(dtype):
        raise SystemExit("the CPU extension did not build here (needs a C++ compiler and ninja)")
    sections = {"attention": _attention, "encoder": _encoder, "decode": _decode, "elementwise": _elementwise,
                "lora": _lora, "sampler": lambda _: _sampler()}
    for name, section in sections.items():
        if args.only is None or name in args.only:
            section(dtype)


def _us(fn: Callable[[], Any], reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def _attention(dtype: torch.dtype) -> None:
    from orthrus_rag.layers.attention import cpu_prefill

    for new, keys in [(32, 32), (256, 256), (512, 512), (64, 512), (256, 1024), (256, 2304), (16, 2304)]:
        g = torch.Generator().manual_seed(0)
        slots = keys + 16
        k_cache = torch.randn(slots, KVH, D, generator=g).to(dtype)
        v_cache = torch.randn(slots, KVH, D, generator=g).to(dtype)
        order = torch.randperm(slots, generator=g)[:keys]  # a paged cache: keys scattered over its slots
        q = torch.randn(new, H, D, generator=g).to(dtype)
        k, v = k_cache[order].transpose(0, 1)[None], v_cache[order].transpose(0, 1)[None]
        mask = (torch.arange(keys)[None, :] <= torch.arange(keys - new, keys)[:, None])[None, None]
        exact = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float(), v.float(), attn_mask=mask,
                                               enable_gqa=True)[0].transpose(0, 1)

        def sdpa():
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)

        row = {"attention": f"{new} new x {keys} keys", "sdpa_us": round(_us(sdpa), 1),
               "sdpa_err": round((sdpa()[0].transpose(0, 1).float() - exact).abs().max().item(), 4)}
        if cpu_prefill.prefill_kernel_runs(dtype, D):
            chunks = cpu_prefill.Chunks(torch.tensor([0]), torch.tensor([new]), torch.tensor([keys - new]),
                                        order[None].contiguous())
            out = torch.empty_like(q)

            def kernel():
                cpu_prefill.prefill_attention(q, k_cache, v_cache, chunks, D ** -0.5, None, out)

            row["kernel_us"] = round(_us(kernel), 1)
            row["kernel_err"] = round((out.float() - exact).abs().max().item(), 4)
            row["speedup"] = round(row["sdpa_us"] / row["kernel_us"], 2)
            row.update(_avx512_bf16_body(dtype, kernel, lambda: (out.float() - exact).abs().max().item()))
        print(json.dumps(row))


def _avx512_bf16_body(dtype: torch.dtype, kernel, err=None) -> dict:
    """Where the kernel's bf16 runs on AMX tiles: the same call on its AVX512-BF16 body, for comparison."""
    from orthrus_rag.layers.attention import cpu_prefill

    if dtype is not torch.bfloat16 or not cpu_prefill.amx_body():
        return {}
    with cpu_prefill.avx512_bf16_body():
        row = {"avx512_bf16_us": round(_us(kernel, 20), 1)}
        if err is not None:
            kernel()
            row["avx512_bf16_err"] = round(err(), 4)
    return row


def _encoder(dtype: torch.dtype, heads: int = 12, dim: int = 32) -> None:
    from orthrus_rag.layers.attention import cpu_prefill
    from orthrus_rag.layers.attention.cpu_encoder import encoder_attention

    g = torch.Generator().manual_seed(0)
    for name, lens in [("32 x 128", [128] * 32), ("40 of 40-200", torch.randint(40, 201, (40,), generator=g).tolist()),
                       ("8 x 512", [512] * 8)]:
        q, k, v = (torch.randn(sum(lens), heads, dim, generator=g).to(dtype) for _ in range(3))

        def sdpa():
            return [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in x))
                    for x in zip(q.split(lens), k.split(lens), v.split(lens))]

        row = {"encoder": f"{name} tokens, {heads} heads of {dim}", "sdpa_us": round(_us(sdpa, 10), 1)}
        if cpu_prefill.prefill_kernel_runs(q.dtype, dim):  # NOTE: where it runs, even if the engine keeps SDPA
            starts, counts = torch.tensor([0, *lens[:-1]]).cumsum(0), torch.tensor(lens)
            kernel = lambda: encoder_attention(q, k, v, starts, counts, dim ** -0.5)  # noqa: E731
            row["kernel_us"] = round(_us(kernel, 10), 1)
            row["speedup"] = round(row["sdpa_us"] / row["kernel_us"], 2)
            row.update(_avx512_bf16_body(q.dtype, kernel))
        print(json.dumps(row))


def _decode(dtype: torch.dtype, batch: int = 32, layers: int = 30) -> None:
    """A decode step's attention over `layers` layers' cold caches (each its own, blocks of 16 slots scattered):
    the kernel's first path against its AVX512-BF16 one (bf16 caches, head sizes 64 / 128 / 256)."""
    from orthrus_rag.layers.attention import cpu_kernels, cpu_prefill

    for keys in (64, 1000):
        g = torch.Generator().manual_seed(0)
        blocks = batch * (keys // 16 + 2)
        caches = [(torch.randn(blocks * 16, KVH, D, generator=g).to(dtype),
                   torch.randn(blocks * 16, KVH, D, generator=g).to(dtype)) for _ in range(layers)]
        q = torch.randn(batch, H, D, generator=g).to(dtype)
        order = torch.randperm(blocks, generator=g)
        per = (keys + 15) // 16
        slots = torch.stack([(order[b * per:(b + 1) * per, None] * 16 + torch.arange(16)).flatten()[:keys]
                             for b in range(batch)]).contiguous()
        lens = torch.full((batch,), keys)

        def one_step(generic: bool) -> None:
            for k, v in caches:
                cpu_kernels.decode_attention(q, k, v, slots, lens, D ** -0.5, None, generic)

        row = {"decode": f"{batch} x {keys} keys, {layers} layers",
               "generic_ms": round(_us(lambda: one_step(True), 5) / 1e3, 2)}
        if dtype is torch.bfloat16 and cpu_prefill.prefill_kernel_runs(dtype, D):  # NOTE: one build condition
            row["bf16_path_ms"] = round(_us(lambda: one_step(False), 5) / 1e3, 2)
            row["speedup"] = round(row["generic_ms"] / row["bf16_path_ms"], 2)
        print(json.dumps(row))


def _rotation(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [rows, D] as models/llama.py's rotary embedding makes them (theta 100,000: SmolLM2's)."""
    inv_freq = 1.0 / (100_000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = torch.arange(rows, dtype=torch.float)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def _elementwise(dtype: torch.dtype) -> None:
    from orthrus_rag.layers import cpu_elementwise
    from orthrus_rag.models.llama import RMSNorm, apply_rotary

    for rows in (1, 32, 256):
        x, res, w = (torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN).to(dtype),
                     torch.randn(HIDDEN).to(dtype))
        norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
        norm.weight.data = w
        qkv = torch.randn(rows, (H + 2 * KVH) * D).to(dtype)
        q, k = qkv[:, :H * D].view(rows, H, D), qkv[:, H * D:(H + KVH) * D].view(rows, KVH, D)
        # NOTE: the model's own cos / signed sin (positions 0..rows-1, SmolLM2's theta): a rotation keeps the
        # rows' norms through the repeated in-place calls; random ones grew them to inf and NaN within ~100 calls,
        # and NaN arithmetic timed the fused kernel at ~3.6x its real cost (252 us at 256 rows on an AMX Xeon core)
        cos, sin = _rotation(rows, dtype)
        gate, up = torch.randn(rows, 2 * INTER).to(dtype).split(INTER, dim=-1)
        pairs = {
            "add_rms_norm": (lambda: norm(res + x), lambda: cpu_elementwise.add_rms_norm(x, res.clone(), w, 1e-5)),
            "rotary q+k": (lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)),
                           lambda: (cpu_elementwise.rotary(q, cos, sin), cpu_elementwise.rotary(k, cos, sin))),
            "silu_mul": (lambda: F.silu(gate) * up, lambda: cpu_elementwise.silu_mul(gate, up)),
        }
        for name, (eager, fused) in pairs.items():
            e, f = _us(eager, 200), _us(fused, 200)
            print(json.dumps({"op": name, "rows": rows, "eager_us": round(e, 1), "fused_us": round(f, 1),
                              "speedup": round(e / f, 2)}))


def _lora(dtype: torch.dtype, rank: int = 8) -> None:
    from transformers import LlamaConfig

    from orthrus_rag.layers.context import ForwardContext, forward_context
    from orthrus_rag.layers.linear import onednn_available, pack_linears
    from orthrus_rag.layers.lora import LoRAAdapter, attach_adapters, set_lora_kernel, use_cpu_lora_kernel
    from orthrus_rag.models.llama import CausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=H,
                         num_key_value_heads=KVH, vocab_size=64)
    model = CausalLM(config).eval().to(dtype)
    model.fuse_projections()
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    names = [f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    modules = dict(model.named_modules())
    g = torch.Generator().manual_seed(0)
    attach_adapters(model, [LoRAAdapter("a", rank, 2.0, {n: (0.05 * torch.randn(rank, modules[n].in_features,
                                                                                generator=g),
                                                             0.05 * torch.randn(modules[n].out_features, rank,
                                                                                generator=g)) for n in names})])
    if onednn_available(dtype, "cpu"):
        pack_linears(model)  # as the engine loads it (the base GEMMs' own time is then the engine's)

    def projections(x: torch.Tensor, act: torch.Tensor) -> None:
        att.fusions["qkv"](att, x), att.o_proj(x), mlp.fusions["gate_up"](mlp, x), mlp.down_proj(act)

    for rows in (1, 32, 256):
        x, act = torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, INTER).to(dtype)
        every = [(1, torch.arange(rows))]
        times = {}
        with torch.inference_mode():
            for name, lora_rows, kernel in (("base", [], False), ("torch", every, False), ("kernel", every, True)):
                set_lora_kernel(model, "per_slot" if name == "torch" else "auto")
                use_cpu_lora_kernel(model, enabled=kernel)
                with forward_context(ForwardContext(lora_rows=lora_rows)):
                    # NOTE: the best of five means: the extra time is a difference of two timings
                    times[name] = min(_us(lambda: projections(x, act), 40) for _ in range(5))
        torch_us, kernel_us = times["torch"] - times["base"], times["kernel"] - times["base"]
        print(json.dumps({"op": "lora", "rows": rows, "rank": rank, "projections_us": round(times["base"], 1),
                          "torch_extra_us": round(torch_us, 1), "kernel_extra_us": round(kernel_us, 1),
                          "speedup": round(torch_us / max(kernel_us, 1e-3), 1)}))


def _sampler(vocab: int = 49152, temperature: float = 0.7) -> None:
    from orthrus_rag.layers.sampler import Sampler, make_generator
    from orthrus_rag.params import SamplingParams

    for rows in (1, 32, 64):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
        params = [SamplingParams(temperature=temperature, seed=i) for i in range(rows)]
        generators = [make_generator(i) for i in range(rows)]

        def multinomial() -> torch.Tensor:  # the former draw: one multinomial per seeded row
            probs = torch.softmax(logits / temperature, dim=-1)
            return torch.stack([torch.multinomial(probs[i], 1, generator=g).squeeze(0)
                                for i, g in enumerate(generators)])

        old = _us(multinomial, reps=10)
        torch_ops = _us(lambda: Sampler(use_kernel=False)(logits, params, generators), reps=10)
        kernel = _us(lambda: Sampler(use_kernel=True)(logits, params, generators), reps=50)
        print(json.dumps({"op": "sample", "rows": rows, "multinomial_us": round(old, 1),
                          "torch_ops_us": round(torch_ops, 1), "kernel_us": round(kernel, 1),
                          "speedup": round(old / kernel, 1)}))


# ---------------------------------------------------------------- the command line ------------------------------


def _status_mib(key: str) -> float:
    """A /proc/self/status figure (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key} (Linux only)")


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """Memory of a loaded engine: resident after `Engine.from_pretrained` above the process's own before it, the
    peak during the load and the start-up calibration, and the bytes of the decoder's weights in every form it
    holds them (dense, quantized, oneDNN's packed copies). Run one model and form per process: the peak is the
    process's."""
    import gc

    from orthrus_rag import Engine
    from orthrus_rag.memory import release_free_memory

    torch.set_num_threads(args.threads)
    gc.collect()
    release_free_memory()
    base = _status_mib("VmRSS")
    engine = Engine.from_pretrained(args.model, quantization=args.quantization, num_blocks=args.num_blocks,
                                    **dict(args.option))
    gc.collect()
    release_free_memory()
    model = engine.runner.model
    seen: set[int] = set()
    dense = quantized = packed = 0

    def size(t: torch.Tensor) -> int:
        if not t.numel() or t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.untyped_storage().nbytes()

    for t in list(model.parameters()) + list(model.buffers()):
        dense += size(t)
    carriers = [f.carrier for m in model.modules() for f in vars(m).get("fusions", {}).values()]
    for module in list(model.modules()) + carriers:
        quant = vars(module).get("_quant")
        if quant is not None:
            quantized += size(quant.weight) + size(quant.scales)
        if vars(module).get("_onednn") is not None and not getattr(module, "_fused", False):
            packed += module.weight.numel() * module.weight.element_size()
    out = {"model": args.model, "quantization": args.quantization, "resident_after_load_mib": _status_mib("VmRSS") - base,
           "peak_mib": _status_mib("VmHWM") - base, "weights_dense_mb": dense / 1e6,
           "weights_quantized_mb": quantized / 1e6, "weights_packed_copies_mb": packed / 1e6}
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    return out


def _rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (0 where it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _ancestors() -> set[int]:
    """This process and the ones above it (a shell, `timeout`, `uv run`): their command lines may repeat a pattern."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _matching(pattern: str) -> list[int]:
    """Pids of the processes (not this one nor its ancestors) whose command line contains `pattern`."""
    pids, skip = [], _ancestors()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmdline:
            pids.append(int(entry))
    return pids


def rss(args: argparse.Namespace) -> dict[str, Any]:
    """Resident memory of running servers while a load runs beside them: every `--interval` seconds for
    `--seconds`, the summed RSS of the processes whose command line contains each `--match` pattern (all of a
    pair's servers, a server and its workers); prints each pattern's peak and last sum in MiB. Start it next to a
    load (`scripts/benchmark.py experiment=ratio_sweep ...`) to measure what the served models hold under it."""
    peak = {p: 0.0 for p in args.match}
    last = dict(peak)
    procs: dict[str, int] = {p: 0 for p in args.match}
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for pattern in args.match:
            pids = _matching(pattern)
            total = sum(_rss_mib(pid) for pid in pids)
            if total:
                last[pattern], procs[pattern] = total, len(pids)
                peak[pattern] = max(peak[pattern], total)
        time.sleep(args.interval)
    out = {p: {"peak_mib": round(peak[p], 1), "last_mib": round(last[p], 1), "processes": procs[p]}
           for p in args.match}
    print(json.dumps(out))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, fn: Callable[[argparse.Namespace], Any]) -> argparse.ArgumentParser:
        doc = inspect.getdoc(fn) or ""
        p = commands.add_parser(name, help=doc.splitlines()[0], description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=fn)
        return p

    option = dict(action="append", default=[], metavar="NAME=VALUE", type=parse_option,
                  help='an engine option, e.g. kernel_overrides={"decode_attention": "sdpa"}; repeatable')

    p = command("step", step)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--policy", default="orthrus")
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens (and chunk size)")
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--embeds", type=int, default=32)
    p.add_argument("--embed-len", type=int, default=32)
    p.add_argument("--prefills", type=int, default=0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--adapters", type=int, default=0,
                   help="random rank-8 LoRA adapters on all 7 projections; the decodes are spread over them")
    p.add_argument("--option", **option)

    p = command("phases", phases)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=33)
    p.add_argument("--prompt-len", type=int, default=33, help="prompt tokens (256 with --tokens 1: prefill steps)")
    p.add_argument("--embeds", type=int, default=0,
                   help="embedding inputs (mean pooling) submitted with the prompts: shared steps")
    p.add_argument("--embed-len", type=int, default=33)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--option", **option)

    p = command("layer-split", layer_split)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--linear-kernel", default="auto",
                   help="the plan's linears choice: auto, onednn or dense (the split needs packing)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--chunk", type=int, default=32, help="tokens of each chunk from position 0")
    p.add_argument("--decodes", type=int, default=0)
    p.add_argument("--context", type=int, default=128, help="cached tokens before each decode")
    p.add_argument("--chunk-context", type=int, default=0,
                   help="cached tokens before each chunk (a prefix: on AMX in bf16 without the kernel's AMX body, "
                        "chunks attending more than 224 keys take torch's SDPA)")
    p.add_argument("--python-loop", action="store_true", help="also time the Python layer loop of the same kernels")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also run each step on the model in fp32 and report each form's relative error from it")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two forms")

    p = command("memory", memory)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model name, folder or GGUF file")
    p.add_argument("--quantization", default="none", help="model.quantization: none, int8, int4 or auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=16, help="KV cache blocks (small: the weights are measured)")
    p.add_argument("--option", **option)

    p = command("rss", rss)
    p.add_argument("--match", action="append", required=True, help="a command-line substring; repeatable")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.5)

    p = command("kernels", kernels)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--only", nargs="+", choices=("attention", "encoder", "decode", "elementwise", "lora", "sampler"),
                   help="these sections only (default: all)")
    return ap


def main(argv: list[str] | None = None) -> Any:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    main()
