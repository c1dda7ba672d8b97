"""The C++ layer loop with and without its column-split form (layers/cpu_layer_split.py), on whole model steps.

    python scripts/bench_layer_split.py --rows 16 64 256 512          # two threads, the engine's dtype (auto)
    python scripts/bench_layer_split.py --rows 256 --decodes 16        # chunks beside decodes over a long context
    python scripts/bench_layer_split.py --rows 256 --chunk 128 --chunk-context 1024 --python-loop   # IRCoT-like

Loads the model as the engine does (packing, fused kernels, the layer loop), builds steps of `--rows` rows: chunks
of `--chunk` tokens from position 0 (the ratio sweep's embeddings and prompts: 16-48 words) or after
`--chunk-context` cached tokens (prompts that grow round by round, as IRCoT's do), optionally beside
`--decodes` decodes over `--context` cached tokens, and times the decoder's forward on them with the split form on
and off (`--python-loop`: and the Python loop of the same kernels), alternated `--rounds` times in one run. Prints
one JSON line per row count: ms per step of each form, their ratio, and the largest difference between the two
forms' hidden states (0 where every part's product gave the whole product's bits); `--fp32-reference`: each
form's relative error from the same step on the model in fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from orthrus_rag import Engine
from orthrus_rag.layers.attention import cpu_prefill, grouped
from orthrus_rag.layers.context import ForwardContext, build_metadata, forward_context

BLOCK = 16


class Step:
    """One step's inputs and fresh caches: chunks of `chunk` tokens filling `rows` rows (less the decodes), and
    `decodes` one-token decodes after `context` cached tokens."""

    def __init__(self, model, rows: int, chunk: int, decodes: int, context: int, chunk_context: int = 0) -> None:
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
        with torch.inference_mode(), forward_context(ForwardContext(attn=self.meta, attn_backend=grouped,
                                                                    kv_caches=self.caches)):
            return model(self.ids, self.meta.positions)


def _time(model, step: Step, reps: int) -> tuple[float, torch.Tensor]:
    out = step.run(model)  # NOTE: a first step gathers the loop's arguments and warms oneDNN's primitive cache
    start = time.perf_counter()
    for _ in range(reps):
        step.run(model)
    return (time.perf_counter() - start) / reps * 1e3, out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--linear-kernel", default="auto", help="the engine's model.linear_kernel (the split needs packing)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--chunk", type=int, default=32, help="tokens of each chunk from position 0")
    ap.add_argument("--decodes", type=int, default=0)
    ap.add_argument("--context", type=int, default=128, help="cached tokens before each decode")
    ap.add_argument("--chunk-context", type=int, default=0,
                    help="cached tokens before each chunk (a prefix: on AMX in bf16 without the kernel's AMX body, "
                         "chunks attending more than 224 keys take torch's SDPA)")
    ap.add_argument("--python-loop", action="store_true", help="also time the Python layer loop of the same kernels")
    ap.add_argument("--fp32-reference", action="store_true",
                    help="also run each step on the model in fp32 and report each form's relative error from it")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two forms")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, linear_kernel=args.linear_kernel, num_blocks=64,
                                    max_num_batched_tokens=256)
    model = engine.runner.model
    loop = model.model.layer_loop
    if loop is None:
        ap.error("this model runs no C++ layer loop here (cpu_layer_loop, or its layers)")
    loop.split_from = 1  # NOTE: every row count measured in the split form when it is on
    reference = None
    if args.fp32_reference:
        reference = Engine.from_pretrained(args.model, dtype="float32", linear_kernel=args.linear_kernel,
                                           num_blocks=64, max_num_batched_tokens=256, cpu_layer_split=False).runner.model
    results = []
    for rows in args.rows:
        if not 0 <= args.decodes < rows:
            ap.error(f"--decodes must be below each row count ({rows})")
        step = Step(model, rows, args.chunk, args.decodes, args.context, args.chunk_context)
        forms = ["python", "whole", "split"] if args.python_loop else ["whole", "split"]
        times: dict[str, list[float]] = {f: [] for f in forms}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for form in forms:
                model.model.layer_loop = None if form == "python" else loop
                loop.split = form == "split"
                before = loop.split_steps
                ms, outs[form] = _time(model, step, args.reps)
                if form == "split" and loop.split_steps == before:
                    ap.error("the split form was not taken (one thread, no packed weights, or the Python loop)")
                times[form].append(round(ms, 2))
        model.model.layer_loop = loop
        result = {"rows": rows, "decodes": args.decodes, "chunk_context": args.chunk_context,
                  "threads": args.threads, "dtype": str(outs["split"].dtype).removeprefix("torch."),
                  **{f"{f}_ms": times[f] for f in forms},
                  "speedup_median": round(statistics.median(times["whole"]) / statistics.median(times["split"]), 3),
                  "max_abs_diff": (outs["split"].float() - outs["whole"].float()).abs().max().item()}
        if reference is not None:
            want = Step(reference, rows, args.chunk, args.decodes, args.context, args.chunk_context).run(reference)
            for form in forms:
                result[f"{form}_rel_err_vs_fp32"] = round(((outs[form].float() - want).norm() / want.norm()).item(), 4)
        if args.python_loop:
            result["python_over_whole"] = round(statistics.median(times["python"]) / statistics.median(times["whole"]), 3)
            result["python_equals_whole"] = torch.equal(outs["python"], outs["whole"])
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
