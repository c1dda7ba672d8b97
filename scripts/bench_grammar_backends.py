"""Which constrained-decoding library the sampler uses: llguidance against xgrammar, on this CPU, SmolLM2's vocabulary.

For each library and each constraint (a nested JSON schema, any JSON object, a regex, a choice), it times:
- the vocabulary set-up (once per model),
- the first matcher for a constraint (its compile; xgrammar compiles ahead, llguidance lazily),
- the per-token mask of one row along a valid output (what a constrained row adds to each step), and
- applying a batch's masks to [rows, vocab] logits: the library's own function (llguidance's is torch.compile'd:
  its first call compiles) and the engine's (`structured.bitmask.apply_bitmask`, the same for both), warm.

    python scripts/bench_grammar_backends.py                       # llguidance only (the project's dependency)
    PYTHONPATH=/tmp/xgr python scripts/bench_grammar_backends.py   # both, with xgrammar installed apart:
        pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi

One JSON line per (library, constraint). The output each mask is walked along is the tokenized valid text, so both
libraries see the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "confidence": {"enum": ["low", "medium", "high"]},
        "evidence": {"type": "array", "items": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["title", "year"], "additionalProperties": False}},
    },
    "required": ["answer", "confidence", "evidence"],
    "additionalProperties": False,
}
NESTED_TEXT = json.dumps({"answer": "Paris, France", "confidence": "high",
                          "evidence": [{"title": "Eiffel Tower", "year": 1889}, {"title": "Louvre", "year": 1793}]})
CASES: dict[str, tuple[str, Any, str]] = {
    "json_schema": ("json_schema", NESTED_SCHEMA, NESTED_TEXT),
    "json_object": ("json_object", None, '{"name": "Ada Lovelace", "born": 1815, "fields": ["maths", "computing"]}'),
    "regex": ("regex", r"So the answer is [A-Za-z0-9 ,.'-]{1,60}\.", "So the answer is Marie Curie."),
    "choice": ("choice", ["yes", "no", "unknown"], "unknown"),
}


def _llguidance(tokenizer: Any, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - t0

    def grammar(kind: str, spec: Any) -> str:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))

    def matcher(kind: str, spec: Any) -> Any:
        return llguidance.LLMatcher(lltok, grammar(kind, spec))

    def fill(m: Any, mask: torch.Tensor, i: int) -> None:
        llguidance.torch.fill_next_token_bitmask(m, mask, i)

    def accept(m: Any, tok: int) -> None:
        assert m.consume_token(tok), m.get_error()

    return dict(setup=setup, matcher=matcher, fill=fill, accept=accept,
                alloc=lambda n: llguidance.torch.allocate_token_bitmask(n, vocab),
                apply=llguidance.torch.apply_token_bitmask_inplace)


def _xgrammar(tokenizer: Any, vocab: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0

    def matcher(kind: str, spec: Any) -> Any:
        if kind == "json_schema":
            compiled = compiler.compile_json_schema(json.dumps(spec))
        elif kind == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:
            compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return xgr.GrammarMatcher(compiled)

    def fill(m: Any, mask: torch.Tensor, i: int) -> None:
        m.fill_next_token_bitmask(mask, i)

    def accept(m: Any, tok: int) -> None:
        assert m.accept_token(tok)

    return dict(setup=setup, matcher=matcher, fill=fill, accept=accept,
                alloc=lambda n: xgr.allocate_token_bitmask(n, vocab),
                apply=lambda logits, mask: xgr.apply_token_bitmask_inplace(logits, mask))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32, help="rows of the logits the masks are applied to")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from orthrus_rag.engine.clients.deployment_client import load_tokenizer
    from orthrus_rag.machine import cpu_model

    tokenizer = load_tokenizer(args.model)
    vocab = len(tokenizer)
    libraries = {"llguidance": _llguidance}
    try:
        import xgrammar  # noqa: F401
        libraries["xgrammar"] = _xgrammar
    except ImportError:
        pass
    for name, make in libraries.items():
        lib = make(tokenizer, vocab)
        for case, (kind, spec, text) in CASES.items():
            tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            t0 = time.perf_counter()
            lib["matcher"](kind, spec)
            first = time.perf_counter() - t0
            per_token: list[float] = []
            for _ in range(args.repeats):
                m = lib["matcher"](kind, spec)
                mask = lib["alloc"](1)
                for tok in tokens:
                    t0 = time.perf_counter()
                    lib["fill"](m, mask, 0)
                    per_token.append(time.perf_counter() - t0)
                    allowed = bool((mask[0, tok // 32] >> (tok % 32)) & 1)
                    assert allowed, f"{name} {case}: token {tok} of the valid text was masked"
                    lib["accept"](m, tok)
            from orthrus_rag.structured.bitmask import apply_bitmask

            masks = lib["alloc"](args.rows)
            logits = torch.randn(args.rows, vocab)
            timings = {}
            for label, apply in (("own", lib["apply"]), ("engine", apply_bitmask)):
                apply(logits.clone(), masks)  # warm (a compile, the first time)
                t0 = time.perf_counter()
                for _ in range(20):
                    apply(logits.clone(), masks)
                timings[label] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
            print(json.dumps({"library": name, "constraint": case, "cpu": cpu_model(), "vocab": vocab,
                              "vocab_setup_s": round(lib["setup"], 3), "first_matcher_ms": round(first * 1e3, 2),
                              "mask_ms_median": round(statistics.median(per_token) * 1e3, 3),
                              "mask_ms_p90": round(sorted(per_token)[int(0.9 * len(per_token))] * 1e3, 3),
                              "tokens": len(tokens), f"apply_ms_{args.rows}_rows_library": timings["own"],
                              f"apply_ms_{args.rows}_rows_engine": timings["engine"]}))


if __name__ == "__main__":
    main()
