"""FlashRAG as a peer: its pipelines on the same questions, corpus, retriever model, generator and settings as an
`orthrus-rag run`, so scores pair per question and throughput compares on the same cores.

FlashRAG (PyPI `flashrag-dev` 0.1.2) is installed by `make peers` into the peers venv; nothing of it is copied
here. This script writes what FlashRAG reads (a dataset file `data/2wiki/dev.jsonl` of `{"id", "question",
"golden_answers", "metadata"}` records, a corpus JSONL of `{"id", "contents": "title\\ntext"}`), builds FlashRAG's
FAISS index with its own `Index_Builder` and the same all-MiniLM-L6-v2, and runs a pipeline from a generated
config: `standard` (SequentialPipeline), `iter_retgen` (IterativePipeline), `ircot` (IRCOTPipeline), `flare`
(FLAREPipeline), `self_ask` (SelfAskPipeline, multi-hop form), each at FlashRAG's own defaults (top-5, 32 new
tokens, greedy, generator batch 4), with `generator_max_input_len=2048` (its default 1024 would cut IRCoT's merged
passages on one side only).

Generators: `hf` (FlashRAG's transformers generator, what runs without a server) or `openai` (its
OpenAI-compatible generator, pointed at a vLLM server or at `orthrus-rag serve` with `--base-url`).

What FlashRAG 0.1.2 needs to run offline on a CPU, set here at run time (its code is not changed on disk):
- its wheel lacks `basic_config.yaml`, so every key is given (`Config._get_internal_config` returns `{}`);
- `parse_query` and `STEncoder` take an `instruction` argument they are not passed: default "";
- its OpenAI generator and prompt template ask tiktoken for `gpt-4o`'s encoding (downloaded at first use):
  the generator's own tokenizer stands in (it only truncates prompts and splits FLARE's sentences);
- its OpenAI generator wraps a lone prompt once more than it reads it, and IRCoT's and Self-Ask's plain-text
  prompts are not messages: every prompt reaches the server as a list of chat messages (a string as one user turn);
- its prompt template cuts an over-long chat prompt with an attribute it never sets (`encoding`): its own
  tokenizer is given under that name.

Per question it records the prediction (after FlashRAG's own answer parsing), retrievals (queries searched),
generated tokens (its outputs re-tokenized by the generator's tokenizer) and latency: a batch pipeline's
(standard, Iter-RetGen) every question waits for the whole run; an item-by-item one's is that item's run.

    python scripts/peers/flashrag_peer.py prepare --questions dev.jsonl --limit 200 --work runs/flashrag
    python scripts/peers/flashrag_peer.py index --work runs/flashrag
    python scripts/peers/flashrag_peer.py run --work runs/flashrag --method ircot --generator hf --out ircot.json

The side-by-side benchmark (every method, every generator, `orthrus-rag run`, and both index builders) is
`scripts/bench_flashrag.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("flashrag_peer")
METHODS = ("standard", "iter_retgen", "ircot", "flare", "self_ask")
GENERATORS = ("hf", "openai")
DATASET = "2wiki"
RETRIEVER = "all-MiniLM-L6-v2"
# FlashRAG's defaults (its basic_config.yaml), but the input length
TOP_K, MAX_TOKENS, BATCH, MAX_INPUT_LEN = 5, 32, 4, 2048


def model_dirs() -> tuple[str, str]:
    """The generator's and the retriever's folders: this project's SmolLM2 conversion and the MiniLM it ships."""
    from orthrus_rag.models.registry import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct")), str(resolve_model_path("all-minilm-l6-v2"))


def prepare(questions: str, limit: int | None, work: Path) -> dict[str, int]:
    """The first `limit` questions as a FlashRAG dataset file, and the context paragraphs of every question in the
    file as its corpus JSONL (the same corpus whatever the limit)."""
    from orthrus_rag.data.loaders import build_corpus, load_qa

    every = load_qa("2wiki", questions)
    examples = every[:limit] if limit is not None else every
    data = work / "data" / DATASET
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "dev.jsonl", "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"id": ex.id, "question": ex.question, "golden_answers": list(ex.golden_answers),
                                "metadata": {"type": ex.type, "supporting_titles": list(ex.supporting_titles)}})
                    + "\n")
    passages = build_corpus(every)
    with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "contents": f"{p.title}\n{p.text}"})
                    + "\n")
    return {"questions": len(examples), "passages": len(passages)}


def _offline() -> None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")


def _patch_encoder() -> None:
    import flashrag.retriever.encoder as enc

    parse_query, st_init = enc.parse_query, enc.STEncoder.__init__
    enc.parse_query = lambda model_name, query_list, instruction="": parse_query(model_name, query_list, instruction)

    def init(self: Any, model_name: str, model_path: str, max_length: int, use_fp16: bool,
             instruction: str = "") -> None:
        st_init(self, model_name, model_path, max_length, use_fp16, instruction)

    enc.STEncoder.__init__ = init


def build_index(work: Path) -> Path:
    """FlashRAG's own index builder: MiniLM, mean pooling, flat FAISS (its defaults: max length 256, batch 64)."""
    _offline()
    _patch_encoder()
    from flashrag.retriever.index_builder import Index_Builder

    _, minilm = model_dirs()
    out = work / "flashrag_index"
    out.mkdir(parents=True, exist_ok=True)
    Index_Builder(RETRIEVER, minilm, str(work / "corpus.jsonl"), str(out) + "/", 256, 64, False,
                  pooling_method="mean", instruction="", use_sentence_transformer=True).build_index()
    return index_file(work)


def index_file(work: Path) -> Path:
    found = sorted((work / "flashrag_index").glob("*.index"))
    if not found:
        raise SystemExit(f"no FlashRAG index under {work / 'flashrag_index'}: run `index` first")
    return found[0]


class _Tokenizer:
    """tiktoken's encode / decode over the generator's own tokenizer (tiktoken would download gpt-4o's)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str, **_: Any) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _patch_openai(tokenizer: _Tokenizer) -> None:
    import tiktoken
    from flashrag.generator import openai_generator
    from flashrag.prompt import base_prompt

    tiktoken.encoding_for_model = lambda name: tokenizer
    truncate = base_prompt.PromptTemplate.truncate_prompt

    def keep_text(self: Any, prompt: Any) -> Any:  # IRCoT's plain-text prompt under the OpenAI generator
        # NOTE: FlashRAG 0.1.2 cuts an over-long chat prompt with `self.encoding`, which it never sets (its encoder
        # is `self.tokenizer`): every prompt over generator_max_input_len raised AttributeError
        if not hasattr(self, "encoding") and hasattr(self, "tokenizer"):
            self.encoding = self.tokenizer
        return prompt if isinstance(prompt, str) else truncate(self, prompt)

    base_prompt.PromptTemplate.truncate_prompt = keep_text
    gen = openai_generator.OpenaiGenerator
    generate, get_response = gen.generate, gen.get_response

    def as_messages(prompt: Any) -> list[dict[str, str]]:
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def generate_any(self: Any, input_list: Any, *args: Any, **kwargs: Any) -> Any:
        single = isinstance(input_list, str) or bool(input_list) and isinstance(input_list[0], dict)
        prompts = [as_messages(input_list)] if single else [as_messages(p) for p in input_list]
        return generate(self, prompts, *args, **kwargs)

    async def unwrapped(self: Any, messages: Any, **params: Any) -> Any:
        # NOTE: generate() wraps a one-prompt list once more ([[messages]]); a batch it passes as given
        if len(messages) == 1 and isinstance(messages[0], list):
            messages = messages[0]
        return await get_response(self, messages, **params)

    gen.generate, gen.get_response = generate_any, unwrapped


class Meter:
    """Per-question retrievals, generated tokens and latency, attributed to the question being run (item-by-item
    pipelines) or by position (a batch call over every question)."""

    def __init__(self, n: int, count_tokens: Any) -> None:
        self.n = n
        self.count_tokens = count_tokens
        self.retrievals = [0] * n
        self.tokens = [0] * n
        self.latency: list[float | None] = [None] * n
        self.current: int | None = None

    def add(self, field: list[int], values: list[int]) -> None:
        if self.current is None and len(values) == self.n:
            for i, v in enumerate(values):
                field[i] += v
        elif self.current is not None:
            field[self.current] += sum(values)

    def wrap(self, pipeline: Any) -> None:
        retriever, generator = pipeline.retriever, pipeline.generator
        search, batch_search, generate = retriever.search, retriever.batch_search, generator.generate

        def counted_search(*a: Any, **k: Any) -> Any:
            self.add(self.retrievals, [1])
            return search(*a, **k)

        def counted_batch(queries: Any, *a: Any, **k: Any) -> Any:
            self.add(self.retrievals, [1] * len(queries))
            return batch_search(queries, *a, **k)

        def counted_generate(*a: Any, **k: Any) -> Any:
            out = generate(*a, **k)
            texts = out[0] if isinstance(out, tuple) else out
            self.add(self.tokens, [self.count_tokens(t or "") for t in texts])
            return out

        retriever.search, retriever.batch_search, generator.generate = counted_search, counted_batch, counted_generate
        if hasattr(pipeline, "run_item"):
            run_item, order = pipeline.run_item, iter(range(self.n))

            def timed(item: Any) -> Any:
                self.current = next(order)
                t0 = time.perf_counter()
                try:
                    return run_item(item)
                finally:
                    self.latency[self.current] = time.perf_counter() - t0
                    self.current = None

            pipeline.run_item = timed


def config(work: Path, generator: str, base_url: str | None, model: str | None) -> dict[str, Any]:
    """Every key FlashRAG reads (its defaults, but the paths, the CPU and the input length)."""
    smollm2, minilm = model_dirs()
    openai = generator == "openai"
    return dict(
        data_dir=str(work / "data"), dataset_name=DATASET, split=["dev"], test_sample_num=None, random_sample=False,
        save_dir=str(work / "flashrag_out"), save_note="peer", seed=2024, gpu_id=None, device="cpu",
        save_intermediate_data=False, save_metric_score=False, save_retrieval_cache=False,
        retrieval_method=RETRIEVER, model2path={RETRIEVER: minilm}, model2pooling={}, method2index={},
        index_path=str(index_file(work)), corpus_path=str(work / "corpus.jsonl"), use_sentence_transformer=True,
        faiss_gpu=False, retrieval_use_fp16=False, retrieval_topk=TOP_K, retrieval_batch_size=256,
        retrieval_query_max_length=128, retrieval_pooling_method="mean", instruction="", use_reranker=False,
        use_retrieval_cache=False, retrieval_cache_path=None, rerank_model_name=None, rerank_pooling_method=None,
        refiner_name=None, use_fid=False, framework="openai" if openai else "hf",
        generator_model=model or "SmolLM2-135M-Instruct", generator_model_path=None if openai else smollm2,
        generator_max_input_len=MAX_INPUT_LEN, generator_batch_size=BATCH,
        generation_params={"do_sample": False, "max_tokens": MAX_TOKENS},
        openai_setting={"api_key": "EMPTY", "base_url": base_url},
        metrics=["em", "f1", "acc"], metric_setting={"retrieval_recall_topk": TOP_K, "tokenizer_name": smollm2},
    )


def pipeline_for(method: str, cfg: Any) -> Any:
    from flashrag import pipeline as fp

    if method == "standard":
        return fp.SequentialPipeline(cfg)
    if method == "iter_retgen":
        return fp.IterativePipeline(cfg)
    if method == "ircot":
        return fp.IRCOTPipeline(cfg)
    if method == "flare":
        return fp.FLAREPipeline(cfg)
    if method == "self_ask":
        return fp.SelfAskPipeline(cfg, single_hop=False)  # 2Wiki's questions are multi-hop
    raise SystemExit(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def run(work: Path, method: str, generator: str, base_url: str | None, model: str | None) -> dict[str, Any]:
    """One FlashRAG pipeline over the prepared questions: per-question results and the run's wall time."""
    _offline()
    _patch_encoder()
    smollm2, _ = model_dirs()
    tokenizer = _Tokenizer(smollm2)
    if generator == "openai":
        if not base_url:
            raise SystemExit("--generator openai needs --base-url (the server's /v1 address)")
        _patch_openai(tokenizer)
    from flashrag.config import Config
    from flashrag.utils import get_dataset

    class LocalConfig(Config):
        def _get_internal_config(self) -> dict[str, Any]:  # NOTE: the wheel ships no basic_config.yaml
            return {}

    t_load = time.perf_counter()
    cfg = LocalConfig(config_dict=config(work, generator, base_url, model))
    dataset = get_dataset(cfg)["dev"]
    pipe = pipeline_for(method, cfg)
    load_s = time.perf_counter() - t_load
    meter = Meter(len(dataset), lambda text: len(tokenizer.encode(text)))
    meter.wrap(pipe)
    t0 = time.perf_counter()
    result = pipe.run(dataset, do_eval=False)
    wall = time.perf_counter() - t0
    preds = list(result.pred)
    return {
        "system": f"flashrag-{generator}", "method": method, "generator": generator, "base_url": base_url,
        "questions": len(preds), "wall_time_s": wall, "load_s": load_s,
        "records": [{"id": item.id, "question": item.question, "golden_answers": list(item.golden_answers),
                     "prediction": pred or "", "retrievals": meter.retrievals[i],
                     "generated_tokens": meter.tokens[i],
                     "latency_s": meter.latency[i] if meter.latency[i] is not None else wall}
                    for i, (item, pred) in enumerate(zip(result, preds))],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write the FlashRAG dataset file and corpus JSONL")
    p.add_argument("--questions", required=True, help="2WikiMultihopQA dev JSONL")
    p.add_argument("--limit", type=int, default=None, help="the first N questions (default: all)")
    p.add_argument("--work", type=Path, required=True, help="the folder FlashRAG's files go to")
    p = sub.add_parser("index", help="build FlashRAG's index of the prepared corpus")
    p.add_argument("--work", type=Path, required=True)
    p = sub.add_parser("run", help="run one FlashRAG pipeline over the prepared questions")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--generator", choices=GENERATORS, default="hf")
    p.add_argument("--base-url", default=None, help="openai: the server's /v1 address")
    p.add_argument("--model", default=None, help="openai: the server's model name")
    p.add_argument("--out", type=Path, required=True, help="the results JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.cmd == "prepare":
        logger.info("prepared %s", prepare(args.questions, args.limit, args.work))
    elif args.cmd == "index":
        logger.info("built %s", build_index(args.work))
    else:
        out = run(args.work, args.method, args.generator, args.base_url, args.model)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        logger.info("%s %s: %d questions in %.1f s", out["system"], out["method"], out["questions"],
                    out["wall_time_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
