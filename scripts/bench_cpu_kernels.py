"""The CPU extension's kernels against the torch ops they replace, one thread, SmolLM2-135M's shapes.

    python scripts/bench_cpu_kernels.py [--threads 1] [--dtype bfloat16]

Attention: the prefill kernel (attention/cpu_prefill.py) against torch's SDPA on the same inputs (bf16, or fp32:
the kernel's fp32 body), causal over a chunk's own keys and after a cached prefix, with the largest error of each to
an fp32 reference; and the encoder's bidirectional form (attention/cpu_encoder.py) on MiniLM's 12 heads of 32
against one SDPA call per sequence (what the encoder runs without it), over packed batches of passages.
Decode: a 32-sequence step's attention over 30 layers' cold caches, the decode kernel's generic path against its
AVX512-BF16 one (layers/attention/cpu_kernels.py).
Elementwise: residual add + RMSNorm, rotary (q and k) and SiLU-and-mul (layers/cpu_elementwise.py) against the
eager ops, at 1, 32 and 256 rows (a decode at batch 1 and 32, a prefill chunk).
LoRA: one rank-8 adapter on all seven projections of one SmolLM2 layer (Q/K/V and gate/up fused), its update on
1, 32 and 256 rows: torch's per-slot ops (what `lora_kernel=per_slot` keeps) against the C++ kernel
(layers/lora_fused.py), each as the extra time over the same projections without adapter rows.
Sampler: a step's draw at temperature 0.7 over SmolLM2's 49,152 logits, every row seeded (as the benchmarks'
requests are), at 1, 32 and 64 rows: `torch.multinomial` per row (the draw the sampler's kernel replaces), the
Sampler on torch's ops (fp64 cumsum), and on the C++ kernel (layers/csrc/sampling.h). Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.attention import cpu_prefill
from orthrus_rag.layers.sampler import Sampler, make_generator
from orthrus_rag.models.llama import RMSNorm, apply_rotary
from orthrus_rag.params import SamplingParams

H, KVH, D, HIDDEN, INTER = 9, 3, 64, 576, 1536  # SmolLM2-135M


def _us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def attention(dtype: torch.dtype) -> None:
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
    if dtype is not torch.bfloat16 or not cpu_prefill.amx_body():
        return {}
    with cpu_prefill.avx512_bf16_body():
        row = {"avx512_bf16_us": round(_us(kernel, 20), 1)}
        if err is not None:
            kernel()
            row["avx512_bf16_err"] = round(err(), 4)
    return row


def encoder(dtype: torch.dtype, heads: int = 12, dim: int = 32) -> None:
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


def decode(dtype: torch.dtype, batch: int = 32, layers: int = 30) -> None:
    """A decode step's attention over `layers` layers' cold caches (each its own, blocks of 16 slots scattered):
    the kernel's first path against its AVX512-BF16 one (bf16 caches, head sizes 64 / 128 / 256)."""
    from orthrus_rag.layers.attention import cpu_kernels

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

        def step(generic: bool) -> None:
            for k, v in caches:
                cpu_kernels.decode_attention(q, k, v, slots, lens, D ** -0.5, None, generic)

        row = {"decode": f"{batch} x {keys} keys, {layers} layers",
               "generic_ms": round(_us(lambda: step(True), 5) / 1e3, 2)}
        if dtype is torch.bfloat16 and cpu_prefill.prefill_kernel_runs(dtype, D):  # NOTE: one build condition
            row["bf16_path_ms"] = round(_us(lambda: step(False), 5) / 1e3, 2)
            row["speedup"] = round(row["generic_ms"] / row["bf16_path_ms"], 2)
        print(json.dumps(row))


def _rotation(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [rows, D] as models/llama.py's rotary embedding makes them (theta 100,000: SmolLM2's)."""
    inv_freq = 1.0 / (100_000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = torch.arange(rows, dtype=torch.float)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def elementwise(dtype: torch.dtype) -> None:
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


def lora(dtype: torch.dtype, rank: int = 8) -> None:
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


def sampler(vocab: int = 49152, temperature: float = 0.7) -> None:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--only", nargs="+", choices=("attention", "encoder", "decode", "elementwise", "lora", "sampler"),
                    help="these sections only (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not cpu_elementwise.available(dtype):
        raise SystemExit("the CPU extension did not build here (needs a C++ compiler and ninja)")
    sections = {"attention": attention, "encoder": encoder, "decode": decode, "elementwise": elementwise,
                "lora": lora, "sampler": lambda _: sampler()}
    for name, section in sections.items():
        if args.only is None or name in args.only:
            section(dtype)


if __name__ == "__main__":
    main()
