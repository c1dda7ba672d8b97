"""What a weight form costs in quality: perplexity on a fixed text and greedy tokens, the engine by
`model.quantization` against its own bf16, and against llama.cpp at the same quantization (`--peers llamacpp`:
llama-perplexity, and llama-server for greedy tokens; `make peers-llamacpp` builds them).

Perplexity is computed as llama-perplexity computes it: the text tokenized once (no BOS: the model adds none), cut
into chunks of `--ctx` tokens, each chunk's second half scored given its first, over `--chunks` chunks. The engine
scores a chunk with `SamplingParams(prompt_logprobs=0)`: the chunk's own prefill rows, no second pass.

Greedy tokens: `--prompts` prompts (the first `--prompt-tokens` tokens of successive chunks), `--tokens` greedy
tokens each, EOS ignored. Each form is compared with the engine's bf16 tokens: the share of prompts whose tokens
are all equal, and the mean length of the common prefix.

The text: `--text FILE` (plain text), or `--qa-file FILE` (a 2WikiMultihopQA / FlashRAG JSONL file): its context
paragraphs, de-duplicated by title, as "title\\ntext" joined by blank lines.

    python scripts/bench_quality.py --qa-file dev.jsonl --quantizations none int8 int4 auto --peers llamacpp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import llamacpp_bench  # noqa: E402 (scripts/peers/: stdlib only)
from llamacpp_peer import LlamaServer  # noqa: E402 (one llama-server, started and stopped as the pair's are)

from orthrus_rag.config.build import parse_option  # noqa: E402

# llama.cpp's nearest quantization to each of the engine's forms (auto: the file's own): Q8_0 has a scale per 32
# weights where int8 has one per row; Q4_1 a scale and a minimum per 32, as int4
SAME_FORM = {"none": "BF16", "int8": "Q8_0", "int4": "Q4_1"}


def read_text(args: argparse.Namespace) -> str:
    if args.text:
        return Path(args.text).read_text(encoding="utf-8")
    from orthrus_rag.data.loaders import build_corpus, load_qa

    passages = build_corpus(load_qa("2wiki", path=args.qa_file))
    return "\n\n".join(f"{p.title}\n{p.text}" for p in passages)


def chunks_of(ids: list[int], ctx: int, count: int) -> list[list[int]]:
    n = min(count, len(ids) // ctx)
    if n < 1:
        raise SystemExit(f"error: the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    return [ids[i * ctx:(i + 1) * ctx] for i in range(n)]


def perplexity(scored: list[list[float]], ctx: int) -> float:
    """llama-perplexity's figure from each chunk's prompt log-probabilities (index p: the token at p given those
    before it): the tokens after the first half, first + 1 .. ctx - 1."""
    first = ctx // 2
    nll = [-lp[p] for lp in scored for p in range(first + 1, ctx)]
    return math.exp(sum(nll) / len(nll))


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """The share of prompts whose tokens equal the reference's, and the mean common prefix (tokens)."""
    prefixes = []
    for got, want in zip(tokens, reference):
        k = 0
        while k < min(len(got), len(want)) and got[k] == want[k]:
            k += 1
        prefixes.append(k)
    same = sum(g == w for g, w in zip(tokens, reference))
    return {"identical": same / len(reference), "mean_common_prefix": sum(prefixes) / len(prefixes)}


def bench_engine(model: str, quantization: str, chunks: list[list[int]], prompts: list[list[int]],
                 args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from orthrus_rag import Engine, SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(model, quantization=quantization, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(256, args.ctx), **dict(args.option))
    outs = engine.generate(chunks, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    scored = [[None if x is None else x.logprob for x in o.prompt_logprobs] for o in outs]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    return {"perplexity": perplexity(scored, args.ctx), "tokens": [o.token_ids for o in greedy]}


def bench_llamacpp(tools: Path, source: Path, quant: str, text_file: Path, prompts: list[list[int]],
                   args: argparse.Namespace, cpus: list[int]) -> dict[str, Any]:
    model = llamacpp_bench.model_file(tools, source, quant)
    proc = subprocess.run([str(tools / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c",
                           str(args.ctx), "--chunks", str(args.chunks), "-t", str(len(cpus))],
                          capture_output=True, text=True, timeout=3600, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity {quant} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    with tempfile.TemporaryDirectory() as logs:
        server = LlamaServer(tools, model, cpus, ["-c", "2048", "-np", "1"], Path(logs) / "llama-server.log")
        try:
            server.wait_healthy(120.0)
            tokens = [_complete(server.port, p, args.tokens) for p in prompts]
        finally:
            server.stop()
    return {"perplexity": float(found.group(1)), "tokens": tokens, "file": model.name}


def _complete(port: int, prompt: list[int], tokens: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return list(json.loads(r.read())["tokens"])


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Perplexity by weight form, the engine's bars beside llama.cpp's (lower is better). `results`: a committed
    results file (docs/benchmarks/results/quality-*.json) or this script's own results.json. Redraw:
    `python scripts/bench/report.py docs/benchmarks/results/quality-<cpu>.json`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench.report import _plt, _save, caption, result_rows

    res = result_rows(results)
    bars = [(f"ours {form}", r["perplexity"]) for form, r in res["engine"].items()]
    bars += [(f"llama.cpp {form}", r["perplexity"]) for form, r in res.get("llamacpp", {}).items()]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, value) in enumerate(bars):
        ax.bar(i, value, color=colors[0 if label.startswith("ours") else 1])
        ax.text(i, value, f"{value:.3f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7.5)
    low = min(v for _, v in bars)
    ax.set_ylim(low * 0.97, max(v for _, v in bars) * 1.01)
    ax.set_ylabel("perplexity", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("Perplexity by weight form, the same model and text (lower is better)", fontsize=10)
    caption(fig, results.get("machine", ""), results.get("measured"))
    names = results.get("plots") or ["quality.png"]
    return [_save(fig, Path(out_dir) / names[0])]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    text = ap.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="a plain-text file to score")
    text.add_argument("--qa-file", help="a 2WikiMultihopQA / FlashRAG JSONL file: its context paragraphs")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF model (llama.cpp reads the same file)")
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4", "auto"])
    ap.add_argument("--ctx", type=int, default=512, help="tokens per perplexity chunk (llama-perplexity's -c)")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--peers", nargs="*", choices=("llamacpp",), default=[])
    ap.add_argument("--llamacpp-dir", default=str(llamacpp_bench.DEFAULT_TOOLS))
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=parse_option,
                    help="an engine option for every form; repeatable")
    ap.add_argument("--out", default="runs/bench_quality")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    from transformers import AutoTokenizer

    from orthrus_rag.models.registry import decoder_files, gguf_source

    source = gguf_source(args.model)
    if "llamacpp" in args.peers:
        problem = llamacpp_bench.tools_problem(args.llamacpp_dir) or \
            (None if source is not None else f"{args.model} is not a GGUF model")
        if problem is None and not os.access(Path(args.llamacpp_dir) / "llama-perplexity", os.X_OK):
            problem = f"llama-perplexity not in {args.llamacpp_dir}: `make peers-llamacpp`"
        if problem:
            raise SystemExit(f"error: --peers llamacpp: {problem}")
    cpus = sorted(os.sched_getaffinity(0))[:args.threads]
    os.sched_setaffinity(0, cpus)
    tokenizer = AutoTokenizer.from_pretrained(str(decoder_files(args.model)[0]))
    text = read_text(args)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = chunks_of(ids, args.ctx, args.chunks)
    prompts = [c[:args.prompt_tokens] for c in chunks_of(ids, args.ctx, args.prompts)]
    results: dict[str, Any] = {"engine": {}, "llamacpp": {}}
    for q in args.quantizations:
        print(f"[bench_quality] orthrus_rag quantization={q} ...", file=sys.stderr, flush=True)
        results["engine"][q] = bench_engine(args.model, q, chunks, prompts, args)
    if "llamacpp" in args.peers:
        with tempfile.TemporaryDirectory() as tmp:
            text_file = Path(tmp) / "text.txt"
            # NOTE: the very tokens the engine scored, as text llama.cpp tokenizes the same way
            text_file.write_text(tokenizer.decode(ids[:args.ctx * len(chunks)]), encoding="utf-8")
            forms = {"auto": llamacpp_bench.file_quant(source)} | SAME_FORM
            for quant in dict.fromkeys(forms[q] for q in args.quantizations):
                print(f"[bench_quality] llama.cpp {quant} ...", file=sys.stderr, flush=True)
                results["llamacpp"][quant] = bench_llamacpp(Path(args.llamacpp_dir), source, quant, text_file,
                                                            prompts, args, cpus)
    reference = results["engine"].get("none", next(iter(results["engine"].values())))["tokens"]
    rows = ["| system | form | perplexity | greedy tokens equal to the engine's bf16 | mean common prefix |",
            "|---|---|---:|---:|---:|"]
    for system, forms_ in (("orthrus_rag", results["engine"]), ("llama.cpp", results["llamacpp"])):
        for form, r in forms_.items():
            a = agreement(r["tokens"], reference)
            r.update(a)
            rows.append(f"| {system} | {form} | {r['perplexity']:.3f} | {a['identical']:.0%} | "
                        f"{a['mean_common_prefix']:.1f} / {args.tokens} |")
    table = "\n".join(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    (out / "table.md").write_text(table + "\n")
    plot_results({"results": results}, out)
    print(table)


if __name__ == "__main__":
    main()
