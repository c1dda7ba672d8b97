"""Engine micro-benchmark, side by side with transformers in one run.

Measures prefill tokens/s, decode tokens/s at batch 1, 8 and 32, and embeddings/s (shared backbone, mean
pooling) for orthrus_rag's engine and for transformers (static-batch `generate`, padded batched forward).
Decode rate = B * (T_long - T_short) generated tokens over the time difference of a long and a 1-token
generation, for both systems, so that prefill cost cancels out.

    python scripts/bench_engine.py --out runs/bench_engine
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from orthrus_rag import Engine, PoolingParams, SamplingParams  # noqa: E402
from orthrus_rag.engine.options import parse_option  # noqa: E402
from orthrus_rag.models.registry import resolve_model_path  # noqa: E402


def _prompt_ids(tokenizer, n_tokens: int, count: int) -> list[list[int]]:
    words = "the river runs past old mills and quiet towns toward a distant grey sea".split()
    out = []
    for i in range(count):
        text = " ".join(words[(i + j) % len(words)] for j in range(n_tokens * 2))
        out.append(tokenizer(text)["input_ids"][:n_tokens])
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_ours(engine: Engine, tokenizer, args: argparse.Namespace) -> dict:
    res: dict = {}
    prompts = _prompt_ids(tokenizer, args.prefill_len, args.prefill_count)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], one)  # warm-up
    if "prefill" in args.sections:
        res["prefill_tok_s"] = args.prefill_len * args.prefill_count / _timed(lambda: engine.generate(prompts, one))
    for b in args.batches if "decode" in args.sections else ():
        ps = _prompt_ids(tokenizer, args.decode_prompt_len, b)
        long = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        t_long = _timed(lambda: engine.generate(ps, long))
        t_short = _timed(lambda: engine.generate(ps, one))
        res[f"decode_tok_s_b{b}"] = b * (args.decode_tokens - 1) / max(t_long - t_short, 1e-9)
    if "embed" in args.sections:
        texts = _prompt_ids(tokenizer, args.embed_len, args.embed_count)
        pp = PoolingParams(pooling="mean")
        res["embed_per_s"] = args.embed_count / _timed(lambda: engine.embed(texts, pp))
    return res


@torch.inference_mode()
def bench_hf(model, tokenizer, args: argparse.Namespace) -> dict:
    res: dict = {}

    def gen(ids: list[list[int]], n: int) -> None:
        model.generate(torch.tensor(ids), attention_mask=torch.ones(len(ids), len(ids[0]), dtype=torch.long),
                       max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    prompts = _prompt_ids(tokenizer, args.prefill_len, args.prefill_count)
    model(torch.tensor(prompts[:2]))  # warm-up
    if "prefill" in args.sections:
        t = _timed(lambda: [model(torch.tensor(prompts[i:i + 8])) for i in range(0, len(prompts), 8)])
        res["prefill_tok_s"] = args.prefill_len * args.prefill_count / t
    for b in args.batches if "decode" in args.sections else ():
        ps = _prompt_ids(tokenizer, args.decode_prompt_len, b)
        t_long = _timed(lambda: gen(ps, args.decode_tokens))
        t_short = _timed(lambda: gen(ps, 1))
        res[f"decode_tok_s_b{b}"] = b * (args.decode_tokens - 1) / max(t_long - t_short, 1e-9)
    if "embed" in args.sections:
        texts = _prompt_ids(tokenizer, args.embed_len, args.embed_count)

        def embed() -> None:
            for i in range(0, len(texts), 16):
                h = model.model(torch.tensor(texts[i:i + 16])).last_hidden_state
                torch.nn.functional.normalize(h.mean(1), dim=-1)

        res["embed_per_s"] = args.embed_count / _timed(embed)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--prefill-count", type=int, default=16)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--embed-len", type=int, default=128)
    ap.add_argument("--embed-count", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=parse_option,
                    help="an engine option (e.g. cpu_decode_kernel=false); repeatable")
    ap.add_argument("--sections", nargs="+", choices=("prefill", "decode", "embed"), default=["prefill", "decode",
                                                                                            "embed"])
    ap.add_argument("--skip-transformers", action="store_true", help="measure the engine only")
    ap.add_argument("--out", default="runs/bench_engine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # NOTE: no prefix caching: the warm-up's prompts would be served from the cache in the timed run
    options = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_chunk_tokens=args.max_num_batched_tokens,
                   num_blocks=max(1024, -(-max(args.batches) * (args.decode_prompt_len + args.decode_tokens) // 16)),
                   enable_prefix_caching=False)
    options.update(args.option)
    engine = Engine.from_pretrained(args.model, **options)
    ours = bench_ours(engine, tokenizer, args)
    del engine
    hf = {} if args.skip_transformers else bench_hf(
        AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), tokenizer, args)
    rows = ["| metric | orthrus_rag | transformers | ratio |", "|---|---:|---:|---:|"]
    rows += [f"| {k} | {ours[k]:.1f} | {hf[k]:.1f} | {ours[k] / hf[k]:.2f}x |" if k in hf else
             f"| {k} | {ours[k]:.1f} | – | – |" for k in ours]
    table = "\n".join(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "orthrus_rag": ours, "transformers": hf},
                                                 indent=2))
    (out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
