"""Issue 37's next lever, measured before it is built: the layer chain with each core on the columns it wrote.

    python scripts/bench_column_split.py --rows 256        # two threads, bf16 (needs oneDNN's bf16: AVX-512)

`scripts/bench_layer_chain.py` found that at two threads SmolLM2's layer chain (30 layers without attention) costs
~12 ms more per 256-row step than its ops alone. This times, in one run and alternated, that chain as the engine
runs it (oneDNN's own two-thread products, the fused kernels split by rows) against the same ops in one parallel
region of two threads (`scripts/bench_column_split.cpp`): each thread multiplies by its own part of every weight
(output columns: Q/K/V by heads, 512 | 448; O and down 288 | 288; gate/up as each thread's gate and up halves), on
one thread of oneDNN, and runs rotary and SiLU-and-mul on what it wrote; only the two norms split by rows. The
products' outputs are copied into shared buffers, and barriers stand between ops, so what it shows is a floor on
the gain, not the gain. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import torch

from orthrus_rag import machine

HERE = Path(__file__).resolve().parent
# output-column parts of each product, per thread: Q/K/V at a head boundary (q heads 0-7 | q head 8 and K/V)
QKV_PARTS, O_PARTS, INTER_PARTS, DOWN_PARTS = (512, 448), (288, 288), (768, 768), (288, 288)


def _extension():
    from torch.utils.cpp_extension import load

    from orthrus_rag.layers.cpu_extension import CFLAGS, CSRC, build_name

    source = HERE / "bench_column_split.cpp"
    # NOTE: one build per CPU model, flags and sources (its own, and the engine's headers through the engine's
    # build name): -march=native code must not run elsewhere
    name = f"orthrus_bench_column_split_{machine.machine_key(source.read_text(), build_name())}"
    return load(name=name, sources=[str(source)], extra_include_paths=[str(CSRC)],
                extra_cflags=CFLAGS + [f"-march={machine.march()}"], extra_ldflags=["-fopenmp"], verbose=False)


def _layer_chain():
    spec = importlib.util.spec_from_file_location("bench_layer_chain", HERE / "bench_layer_chain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def split_weights(layers: int) -> list[torch.Tensor]:
    """Per layer, per thread: its Q/K/V, O, gate|up and down parts, each packed in oneDNN's blocked layout."""
    pack = torch.ops.mkldnn._reorder_linear_weight
    out: list[torch.Tensor] = []
    for _ in range(layers):
        qkv, o = torch.randn(960, 576) * 0.02, torch.randn(576, 576) * 0.02
        gate, up, down = torch.randn(1536, 576) * 0.02, torch.randn(1536, 576) * 0.02, torch.randn(576, 1536) * 0.02
        for t in range(2):
            q0, o0, i0, d0 = (sum(p[:t]) for p in (QKV_PARTS, O_PARTS, INTER_PARTS, DOWN_PARTS))
            parts = (qkv[q0:q0 + QKV_PARTS[t]], o[o0:o0 + O_PARTS[t]],
                     torch.cat((gate[i0:i0 + INTER_PARTS[t]], up[i0:i0 + INTER_PARTS[t]])), down[d0:d0 + DOWN_PARTS[t]])
            out += [pack(p.contiguous().bfloat16()) for p in parts]
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two forms")
    args = ap.parse_args(argv)
    if not machine.onednn_bf16_supported():
        ap.error("oneDNN runs no bf16 products on this CPU (AVX2 only)")
    torch.set_num_threads(2)
    ext, chain_module = _extension(), _layer_chain()
    chain = chain_module.Chain(args.rows, args.layers)
    weights = split_weights(args.layers)
    norm_w = torch.ones(576).bfloat16()
    engine_ms, split_ms, split_products_ms = [], [], []
    for _ in range(args.rounds):
        engine_ms.append(chain_module.measure(chain.chain, args.reps)["ms"])
        total, products = ext.colsplit(weights, chain.h0, chain.cos, chain.sin, norm_w, args.layers, True, args.reps)
        split_ms.append(total)
        split_products_ms.append(products)
    result = {"rows": args.rows, "layers": args.layers, "engine_chain_ms": engine_ms,
              "column_split_ms": [round(x, 2) for x in split_ms],
              "column_split_thread0_products_ms": [round(x, 2) for x in split_products_ms],
              "speedup_median": round(statistics.median(engine_ms) / statistics.median(split_ms), 3)}
    print(json.dumps(result))
    return [result]


if __name__ == "__main__":
    main()
