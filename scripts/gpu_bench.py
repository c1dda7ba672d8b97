"""One-command GPU benchmark of the engine, side by side with transformers on the same random weights.

    PYTHONPATH=$PWD python3 scripts/gpu_bench.py --tokenizer tok/ --out $OUT/gpu_bench      # H200, < 6 minutes
    python scripts/gpu_bench.py --device cpu --shape tiny --out runs/gpu_bench_cpu             # dry run (tests)

Needs only torch, transformers and safetensors, and no weights: models are random-initialised (an 8B-shaped
Llama: hidden 4096, 32 layers, 32/8 heads, intermediate 14336) and the SmolLM2 tokenizer files come from
`--tokenizer` or $ORTHRUS_TOKENIZER (default: the built-in SmolLM2 folder where it is converted). Sections:

- parity: fp32, a 12-layer SmolLM2-shaped model: greedy tokens of the engine (chunk budgets 64 and 4,096)
  against transformers' on the same weights (identical up to a near-tie), and mean-pooled embedding cosine;
- decode: B=64 prompts of 128 tokens, 128 new tokens each: median decode step against the HBM floor (weight
  bytes / bandwidth), with and without CUDA graphs, and transformers' `generate` tokens/s;
- embed: 512 texts of 256 tokens, mean pooling: TFLOP/s against the GEMM peak, and transformers' padded batches;
- mixed: 128 generations (128 + 128 tokens) and 512 embeddings (256 tokens) submitted together, per policy,
  against running them apart on the same engine and against transformers (generate, then embed); runs in
  A B B A order after a warm-up (a fresh process's first runs were up to 2x slower).

Every section compares outputs as well as timing them: greedy tokens against a reference run (identical up to
the first divergence, which must be a near-tie in transformers' logits: both tokens its top-2, their gap under
1e-3 in fp32, under --tie-frac x the logits' standard deviation in bf16), embeddings by cosine (fp32: 0.9999,
bf16: 0.999). A failed check is a row with `passed: false`; the script then exits with status 1.

Prints one JSON line per result and writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from orthrus_rag import CacheConfig, Engine, EngineConfig, ModelConfig, PoolingParams, SamplingParams, SchedulerConfig
from orthrus_rag.models.llama import CausalLM

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
PARITY_SHAPE = dict(SHAPES["smol"], num_hidden_layers=12)
POLICIES = ("orthrus", "hetero-fcfs", "unified-homo", "qlen-priority")
ROWS: list[dict[str, Any]] = []
FAILURES: list[str] = []
TIE_FRAC = 0.1  # --tie-frac: bf16 near-tie tolerance as a fraction of the reference logits' standard deviation


def emit(**row: Any) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def check(ok: bool, section: str, what: str, **figures: Any) -> bool:
    """Record a comparison: a row with `passed`, and a failure that makes the script exit non-zero."""
    emit(section=section, check=what, passed=bool(ok), **figures)
    if not ok:
        FAILURES.append(f"{section}: {what} {figures}")
    return bool(ok)


def divergence(hf: LlamaForCausalLM, prompt: list[int], ours: list[int], ref: list[int],
               dev: torch.device) -> str | None:
    """None when `ours` equals `ref` up to a first divergence that is a near-tie in `hf`'s logits; else why not."""
    i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return None if len(ours) == len(ref) else f"lengths {len(ours)} vs {len(ref)}"
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + ref[:i]], device=dev)).logits[0, -1].float()
    top2 = torch.topk(logits, 2).indices.tolist()
    gap = abs(float(logits[ours[i]] - logits[ref[i]]))
    tol = 1e-3 if hf.dtype == torch.float32 else TIE_FRAC * float(logits.std())
    if ours[i] in top2 and ref[i] in top2 and gap < tol:
        return None
    return f"token {i}: {ours[i]} vs {ref[i]}, logit gap {gap:.3g} (tolerance {tol:.3g}), top-2 {top2}"


def compare_tokens(section: str, what: str, hf: LlamaForCausalLM, prompts: list[list[int]],
                   ours: list[list[int]], refs: list[list[int]], dev: torch.device) -> bool:
    """Greedy tokens of every prompt against a reference run, under the near-tie rule."""
    why = [w for p, o, r in zip(prompts, ours, refs) if (w := divergence(hf, p, o, r, dev)) is not None]
    identical = sum(o == r for o, r in zip(ours, refs)) / max(len(refs), 1)
    return check(not why and len(ours) == len(refs), section, what, identical_frac=identical,
                 not_near_ties=len(why), first=why[0] if why else None)


def compare_embeddings(section: str, what: str, ours: list[torch.Tensor], refs: list[torch.Tensor],
                       threshold: float) -> bool:
    cos = min((float(torch.nn.functional.cosine_similarity(o.float().flatten(), r.float().flatten().to(o.device),
                                                           dim=0)) for o, r in zip(ours, refs)), default=float("nan"))
    return check(len(ours) == len(refs) and cos >= threshold, section, what, cosine_min=cos, threshold=threshold)


def cosine_threshold(dtype: torch.dtype) -> float:
    return 0.9999 if dtype == torch.float32 else 0.999


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def llama_config(shape: dict, vocab: int, tokenizer: Any) -> LlamaConfig:
    return LlamaConfig(**shape, vocab_size=vocab, max_position_embeddings=8192, rope_theta=100000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=0)


def twin_models(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> tuple[CausalLM, LlamaForCausalLM]:
    """transformers' model, randomly initialised, and ours with the very same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(dtype).eval()
        ours = CausalLM(cfg)
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if "rotary" not in k}, strict=True)
    return ready(ours, cfg, dtype, device), hf


def random_model(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Ours alone, initialised as transformers initialises a Llama (normal(0, initializer_range) matrices, unit
    norms), without building transformers' copy."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = CausalLM(cfg)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() > 1:
                p.normal_(0.0, cfg.initializer_range)
            else:
                p.fill_(1.0)
    return ready(ours, cfg, dtype, device)


def ready(ours: CausalLM, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """`ours` in `dtype` for inference: rotary tables and fused projections as the engine's loader leaves them."""
    ours = ours.to(dtype).eval()
    from orthrus_rag.models.llama import RotaryEmbedding  # the table is computed in fp32 on CPU, then moved

    ours.model.rotary_emb = RotaryEmbedding(cfg, ours.model.layers[0].self_attn.head_dim).to(device)
    ours.fuse_projections()
    return ours


def engine(model: CausalLM, tokenizer: Any, args: argparse.Namespace, dtype: str, policy: str = "orthrus",
           budget: int | None = None, graphs: bool = True, **scheduler: Any) -> Engine:
    """`scheduler`: more SchedulerConfig fields (e.g. bulk_step_tokens)."""
    budget = budget or args.budget
    cfg = EngineConfig(model=ModelConfig(name="random", dtype=dtype, device=args.device,
                                         kernel_overrides={} if graphs else {"cuda_graphs": "off"}),
                       cache=CacheConfig(kv_cache_gib=args.kv_cache_gib),
                       scheduler=SchedulerConfig(**{"max_num_batched_tokens": budget,
                                                    "max_chunk_tokens": min(budget, 2048), "max_num_seqs": 256,
                                                    "policy": policy, **scheduler}))
    return Engine(cfg, model, tokenizer)


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def matmul_params(cfg: LlamaConfig) -> int:
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    return layers * (h * (h + 2 * kv) + h * h + 3 * h * i)


# ---- sections ---------------------------------------------------------------------------------------------------
def parity(args: argparse.Namespace, tokenizer: Any, vocab: int) -> None:
    dev = torch.device(args.device)
    shape = SHAPES["tiny"] if args.shape == "tiny" else PARITY_SHAPE
    ours, hf = twin_models(llama_config(shape, vocab, tokenizer), torch.float32, dev)
    lengths = (7, 40, 250) if args.shape != "tiny" else (7, 20)
    new = 24 if args.shape != "tiny" else 8
    prompts = [rand_ids(n, vocab, n) for n in lengths]
    refs = [hf_greedy(hf, p, new, dev) for p in prompts]
    texts = [rand_ids(n, vocab, 100 + n) for n in lengths]
    with torch.inference_mode():
        ref_embs = [hf.model(torch.tensor([t], device=dev)).last_hidden_state[0].float().mean(0) for t in texts]
    for budget in (64, 4096):
        eng = engine(ours, tokenizer, args, "float32", budget=budget)
        outs = eng.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        tokens = [list(o.token_ids) for o in outs]
        same = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) / len(r)
                for t, r in zip(tokens, refs)]
        emit(section="parity", budget=budget, prompts=len(prompts), tokens_identical_frac=min(same),
             attention=eng.runner.attn_backend.__name__.rsplit(".", 1)[-1])
        compare_tokens("parity", f"fp32 greedy, budget {budget}, vs transformers", hf, prompts, tokens, refs, dev)
        embs = eng.embed(texts, PoolingParams(pooling="mean", normalize=False))
        cos = min(float(torch.nn.functional.cosine_similarity(e.embedding.float(), r.to(e.embedding.device), dim=0))
                  for e, r in zip(embs, ref_embs))
        emit(section="parity", budget=budget, embedding_cosine_min=cos)
        compare_embeddings("parity", f"fp32 mean pooling, budget {budget}, vs transformers",
                           [e.embedding for e in embs], ref_embs, cosine_threshold(torch.float32))
        del eng
    del ours, hf


def hf_greedy(hf: LlamaForCausalLM, prompt: list[int], new: int, dev: torch.device) -> list[int]:
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(torch.tensor([prompt], device=dev), use_cache=True)
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == new:
                return tokens
            out = hf(torch.tensor([[tokens[-1]]], device=dev), past_key_values=out.past_key_values, use_cache=True)


def throughput(args: argparse.Namespace, tokenizer: Any, vocab: int) -> None:
    """The decode, embed and mixed sections on one pair of twin models (bf16 on CUDA)."""
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = llama_config(SHAPES[args.shape], vocab, tokenizer)
    ours, hf = twin_models(cfg, dtype, dev)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    decode(args, dev, cfg, ours, hf, tokenizer, name, vocab)
    embed(args, dev, cfg, ours, hf, tokenizer, name, vocab)
    mixed(args, dev, ours, hf, tokenizer, name, vocab)


def decode(args: argparse.Namespace, dev: torch.device, cfg: LlamaConfig, ours: CausalLM, hf: LlamaForCausalLM,
           tokenizer: Any, name: str, vocab: int) -> None:
    dtype = hf.dtype
    params = matmul_params(cfg) + cfg.hidden_size * vocab  # what a decode step reads: layers and lm_head
    floor = params * dtype.itemsize / (args.hbm_tbps * 1e12)
    b, plen, new = args.decode_batch, args.prompt_len, args.new_tokens
    prompts = [rand_ids(plen, vocab, i) for i in range(b)]
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    runs: list[tuple[bool, list[list[int]]]] = []
    for graphs in ((True, False, False, True) if dev.type == "cuda" else (False,)):
        eng = engine(ours, tokenizer, args, name, graphs=graphs)
        eng.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        eng.step_stats.clear()
        outs: list = []
        t = timed(dev, lambda: outs.extend(eng.generate(prompts, sp)))
        runs.append((graphs, [list(o.token_ids) for o in outs]))
        steps = [s.step_time for s in eng.step_stats if s.num_decode_tokens == b and not s.num_prefill_tokens]
        step = statistics.median(steps) if steps else float("nan")
        emit(section="decode", system="orthrus_rag", cuda_graphs=graphs, batch=b, tok_s=b * new / t,
             step_ms=step * 1e3, floor_ms=floor * 1e3, roofline_frac=floor / step if steps else None)
        if graphs:
            replayed = eng.runner.decode_graphs.num_steps if eng.runner.decode_graphs is not None else 0
            check(replayed > 0, "decode", "decode steps replayed CUDA graphs", graph_steps=replayed)
        del eng
        release(dev)
    with torch.inference_mode():
        ids = torch.tensor(prompts, device=dev)
        hf.generate(ids[:8], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        hf_out: list[torch.Tensor] = []
        t = timed(dev, lambda: hf_out.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                         min_new_tokens=new, do_sample=False, pad_token_id=0)))
    emit(section="decode", system="transformers", batch=b, tok_s=b * new / t)
    eager = next(tokens for graphs, tokens in runs if not graphs)
    compare_tokens("decode", "greedy tokens vs transformers' generate", hf, prompts, eager,
                   hf_out[0][:, plen:].tolist(), dev)
    for i, (graphs, tokens) in enumerate(runs):
        if tokens is not eager:
            compare_tokens("decode", f"run {i} (cuda_graphs={graphs}) vs the first run without graphs", hf, prompts,
                           tokens, eager, dev)


def embed(args: argparse.Namespace, dev: torch.device, cfg: LlamaConfig, ours: CausalLM, hf: LlamaForCausalLM,
          tokenizer: Any, name: str, vocab: int) -> None:
    n_emb, elen = args.embed_count, args.embed_len
    texts = [rand_ids(elen, vocab, 1000 + i) for i in range(n_emb)]
    pp = PoolingParams(pooling="mean")
    flops = 2 * matmul_params(cfg) * n_emb * elen + 4 * cfg.num_hidden_layers * cfg.hidden_size * n_emb * elen ** 2 / 2
    eng = engine(ours, tokenizer, args, name)
    eng.embed(texts[:16], pp)
    embs: list = []
    t = timed(dev, lambda: embs.extend(eng.embed(texts, pp)))
    emit(section="embed", system="orthrus_rag", texts=n_emb, tokens=elen, tflops=flops / t / 1e12,
         peak_frac=flops / t / 1e12 / args.peak_tflops)
    hf_embs: list[torch.Tensor] = []

    def hf_embed() -> None:
        hf_embs.clear()
        with torch.inference_mode():
            for i in range(0, n_emb, 64):
                h = hf.model(torch.tensor(texts[i:i + 64], device=dev)).last_hidden_state
                hf_embs.extend(torch.nn.functional.normalize(h.float().mean(1), dim=-1))

    hf_embed()
    t = timed(dev, hf_embed)
    emit(section="embed", system="transformers", texts=n_emb, tokens=elen, tflops=flops / t / 1e12,
         peak_frac=flops / t / 1e12 / args.peak_tflops)
    compare_embeddings("embed", "mean-pooled embeddings vs transformers", [e.embedding for e in embs], hf_embs,
                       cosine_threshold(hf.dtype))
    del eng
    release(dev)


def release(dev: torch.device) -> None:
    """Give a dropped engine's KV cache back before the next one takes its own."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def mixed(args: argparse.Namespace, dev: torch.device, ours: CausalLM, hf: LlamaForCausalLM, tokenizer: Any,
          dtype: str, vocab: int) -> None:
    ng, ne = args.mixed_generations, args.mixed_embeddings
    gens = [rand_ids(args.prompt_len, vocab, 5000 + i) for i in range(ng)]
    texts = [rand_ids(args.embed_len, vocab, 9000 + i) for i in range(ne)]
    sp, pp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True), PoolingParams()
    eng = engine(ours, tokenizer, args, dtype)
    eng.run(prompts=gens[:8], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True), texts=texts[:16],
            pooling_params=pp)
    ref_gen: list = []
    ref_emb: list = []
    apart = [timed(dev, lambda: ref_gen.extend(eng.generate(gens, sp)))
             + timed(dev, lambda: ref_emb.extend(eng.embed(texts, pp)))]
    del eng
    release(dev)

    def compare(system: str, outs: tuple[list, list]) -> None:
        """A mixed run's outputs against running the same requests apart on the same engine."""
        compare_tokens("mixed", f"{system}: greedy tokens vs apart", hf, gens, [list(o.token_ids) for o in outs[0]],
                       [list(o.token_ids) for o in ref_gen], dev)
        compare_embeddings("mixed", f"{system}: embeddings vs apart", [o.embedding for o in outs[1]],
                           [o.embedding for o in ref_emb], cosine_threshold(hf.dtype))

    runs: dict[str, list[float]] = {p: [] for p in args.policies}
    for policy in list(args.policies) + list(reversed(args.policies)):  # A B B A
        e = engine(ours, tokenizer, args, dtype, policy=policy)
        e.run(prompts=gens[:4], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), texts=texts[:4],
              pooling_params=pp)
        e.step_stats.clear()
        outs: list = []
        runs[policy].append(timed(dev, lambda: outs.append(e.run(prompts=gens, sampling_params=sp, texts=texts,
                                                                 pooling_params=pp))))
        steps = list(e.step_stats)
        emit(section="mixed", system=policy, seconds=runs[policy][-1], steps=len(steps),
             mixed_steps=sum(s.is_mixed for s in steps),
             step_ms_median=1e3 * statistics.median(s.step_time for s in steps) if steps else None)
        if len(runs[policy]) == 1:  # NOTE: the first run of each policy; the repeat is for timing only
            compare(policy, outs[0])
        del e
        release(dev)
    e = engine(ours, tokenizer, args, dtype)
    apart.append(timed(dev, lambda: e.generate(gens, sp)) + timed(dev, lambda: e.embed(texts, pp)))
    del e
    release(dev)
    emit(section="mixed", system="apart (same engine)", seconds=min(apart))
    for policy, ts in runs.items():
        emit(section="mixed", system=policy, best_seconds=min(ts), speedup_vs_apart=min(apart) / min(ts))

    def hf_both() -> None:
        with torch.inference_mode():
            ids = torch.tensor(gens, device=dev)
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            for i in range(0, ne, 64):
                hf.model(torch.tensor(texts[i:i + 64], device=dev)).last_hidden_state.float().mean(1)

    emit(section="mixed", system="transformers (generate, then embed)", seconds=timed(dev, hf_both))
    if args.dedicated:
        compare("dedicated", dedicated(args, dev, hf, tokenizer, dtype, gens, texts, sp, pp))


def dedicated(args: argparse.Namespace, dev: torch.device, hf: LlamaForCausalLM, tokenizer: Any, dtype: str,
              gens: list, texts: list, sp: SamplingParams, pp: PoolingParams) -> tuple[list, list]:
    """The paper's task-split baseline on one device: a generation and an embedding engine process, each with
    its own copy of the model (written to a temporary checkpoint) and half the KV cache."""
    import tempfile

    from orthrus_rag.engine.deploy import DedicatedDeployment
    from orthrus_rag.config.build import engine_config

    with tempfile.TemporaryDirectory(prefix="gpu_bench_model_") as folder:
        hf.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        config = engine_config(folder, dtype=dtype, device=args.device, kv_cache_gib=args.kv_cache_gib / 2,
                               max_num_batched_tokens=args.budget, max_chunk_tokens=min(args.budget, 2048),
                               max_num_seqs=256)
        with DedicatedDeployment(config, threads=(1, 1)) as deployment:
            deployment.run(prompts=gens[:4], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                           texts=texts[:4], pooling_params=pp)
            outs: list = []
            seconds = timed(dev, lambda: outs.append(deployment.run(prompts=gens, sampling_params=sp, texts=texts,
                                                                    pooling_params=pp)))
    emit(section="mixed", system="dedicated (two processes, one device)", seconds=seconds)
    return outs[0]


# ---- report -----------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| section | system | figures |", "|---|---|---|"]
    for r in rows:
        if "section" not in r:
            continue
        figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{k} {v}"
                            for k, v in r.items() if k not in ("section", "system"))
        system = r.get("system", "check" if "check" in r else "orthrus_rag")
        lines.append(f"| {r['section']} | {system} | {figures} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global TIE_FRAC
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tokenizer", default=os.environ.get("ORTHRUS_TOKENIZER"),
                    help="folder with the SmolLM2 tokenizer files (default: $ORTHRUS_TOKENIZER, else the built-in)")
    ap.add_argument("--sections", nargs="+", choices=("parity", "throughput"), default=["parity", "throughput"])
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=float, default=24.0)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--embed-count", type=int, default=512)
    ap.add_argument("--embed-len", type=int, default=256)
    ap.add_argument("--mixed-generations", type=int, default=128)
    ap.add_argument("--mixed-embeddings", type=int, default=512)
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="memory bandwidth for the decode floor (H200: 4.8)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 GEMM peak measured on the device")
    ap.add_argument("--dedicated", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the dedicated baseline (two engine processes sharing the device)")
    ap.add_argument("--tie-frac", type=float, default=TIE_FRAC,
                    help="bf16 near-tie tolerance: a fraction of the reference logits' standard deviation")
    ap.add_argument("--out", default="runs/gpu_bench")
    args = ap.parse_args(argv)
    TIE_FRAC = args.tie_frac
    if args.tokenizer is None:
        from orthrus_rag.models.registry import resolve_model_path

        args.tokenizer = str(resolve_model_path("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    env = {"torch": torch.__version__, "device": args.device, "shape": args.shape,
           "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    emit(event="start", **env)
    ROWS.clear()
    FAILURES.clear()
    if "parity" in args.sections:
        parity(args, tokenizer, vocab)
    if "throughput" in args.sections:
        throughput(args, tokenizer, vocab)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"env": env, "args": vars(args), "results": list(ROWS), "failures": list(FAILURES)}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(table(ROWS))
    emit(event="done", out=str(out), failures=len(FAILURES))
    return result


def cli(argv: list[str] | None = None) -> int:
    """The exit status: 1 when any comparison failed."""
    return 1 if main(argv)["failures"] else 0


if __name__ == "__main__":
    sys.exit(cli())
