"""What a decoder layer's ops cost in a chain, where each one reads the last one's fresh output, against alone.

    python scripts/bench_layer_chain.py --threads 2 --rows 256
    python scripts/bench_layer_chain.py --threads 1 --rows 128 --dtype float32

SmolLM2-135M's 30 layers without attention: the four packed oneDNN products (layers/linear.py's blocked layout,
`mkldnn::_linear_pointwise`, as the C++ layer loop calls them) and the fused elementwise kernels between them
(layers/cpu_elementwise.py: rotary on q and k, add + RMSNorm twice, SiLU-and-mul), in the loop's order, each timed.
Rows:
- `gemms alone`: the 120 products back to back on one fixed input per shape (what bench_linear_layout.py times);
- `chain`: the layer loop's order, every op on the output of the one before;
- `chain without <op>`: the same with that kernel left out (its input stands in for its output);
- `elementwise alone`: the kernels on fixed inputs, nothing between them (what bench_cpu_kernels.py times).

On an Intel Xeon with AMX (two cores): at two threads the chain costs ~12 ms more per 256-row step than its parts
alone (the products ~4 ms slower, the kernels ~6 ms), at one thread ~5 ms. The likely cause, not proven: oneDNN and
the kernels split each output between the cores differently (oneDNN by its blocks, the kernels by rows), so in a chain
half of what each core reads was just written on the other.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Callable

import torch

from orthrus_rag import machine
from orthrus_rag.layers import cpu_elementwise as ew

HIDDEN, INTER, HEADS, KV_HEADS, DIM, LAYERS = 576, 1536, 9, 3, 64, 30  # SmolLM2-135M
QKV = (HEADS + 2 * KV_HEADS) * DIM
POINTWISE = torch.ops.mkldnn._linear_pointwise
TIMES: collections.Counter = collections.Counter()


def packed(out: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight((torch.randn(out, inp) * 0.02).to(dtype))


def timed(name: str, fn: Callable, *args):
    start = time.perf_counter()
    result = fn(*args)
    TIMES[name] += time.perf_counter() - start
    return result


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return POINTWISE(x, w, None, "none", [], "")


class Chain:
    def __init__(self, rows: int, layers: int = LAYERS, dtype: torch.dtype = torch.bfloat16) -> None:
        self.rows = rows
        shapes = ((QKV, HIDDEN), (HIDDEN, HEADS * DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER))
        self.layers = [tuple(packed(n, k, dtype) for n, k in shapes) for _ in range(layers)]
        self.norm_w = torch.ones(HIDDEN).to(dtype)
        # the model's own cos / signed sin (SmolLM2's theta): a rotation, so repeated in-place calls stay finite
        inv_freq = 1.0 / (100_000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float) / DIM))
        freqs = torch.arange(rows, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype)
        self.h0 = torch.randn(rows, HIDDEN).to(dtype)
        self.qkv0 = torch.randn(rows, QKV).to(dtype)
        self.gate_up0 = torch.randn(rows, 2 * INTER).to(dtype)
        self.act0 = torch.randn(rows, INTER).to(dtype)

    def rotary(self, qkv: torch.Tensor) -> None:
        t = self.rows
        ew.rotary(qkv[:, :HEADS * DIM].view(t, HEADS, DIM), self.cos, self.sin)
        ew.rotary(qkv[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(t, KV_HEADS, DIM), self.cos, self.sin)

    def chain(self, skip: str | None = None) -> None:
        h, residual = self.h0, self.h0.clone()
        for w_qkv, w_o, w_gate_up, w_down in self.layers:
            qkv = timed("qkv product", product, h, w_qkv)
            if skip != "rotary":
                timed("rotary", self.rotary, qkv)
            attn = timed("o product", product, qkv[:, :HEADS * DIM].contiguous(), w_o)  # attention's stand-in
            h = attn if skip == "norms" else timed("add+norm", ew.add_rms_norm, attn, residual, self.norm_w, 1e-5)
            gate_up = timed("gate/up product", product, h, w_gate_up)
            act = (self.act0 if skip == "silu_mul"
                   else timed("silu_mul", ew.silu_mul, gate_up[:, :INTER], gate_up[:, INTER:]))
            down = timed("down product", product, act, w_down)
            h = down if skip == "norms" else timed("add+norm", ew.add_rms_norm, down, residual, self.norm_w, 1e-5)

    def gemms_alone(self) -> None:
        for w_qkv, w_o, w_gate_up, w_down in self.layers:
            timed("qkv product", product, self.h0, w_qkv)
            timed("o product", product, self.h0, w_o)
            timed("gate/up product", product, self.h0, w_gate_up)
            timed("down product", product, self.act0, w_down)

    def elementwise_alone(self) -> None:
        residual = self.h0.clone()
        for _ in self.layers:
            timed("rotary", self.rotary, self.qkv0)
            timed("add+norm", ew.add_rms_norm, self.h0, residual, self.norm_w, 1e-5)
            timed("silu_mul", ew.silu_mul, self.gate_up0[:, :INTER], self.gate_up0[:, INTER:])
            timed("add+norm", ew.add_rms_norm, self.h0, residual, self.norm_w, 1e-5)


def measure(fn: Callable[[], None], reps: int) -> dict:
    fn()
    fn()
    TIMES.clear()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    total = (time.perf_counter() - start) / reps * 1e3
    ops = {k: round(v / reps * 1e3, 2) for k, v in TIMES.items()}
    products = sum(v for k, v in ops.items() if k.endswith("product"))
    return {"ms": round(total, 2), "products_ms": round(products, 2),
            "elementwise_ms": round(sum(ops.values()) - products, 2), "ops_ms": ops}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not machine.onednn_bf16_supported():
        ap.error("oneDNN runs no bf16 products on this CPU (AVX2 only: the engine keeps bf16 linears dense "
                 "there); use --dtype float32")
    torch.set_num_threads(args.threads)
    chain = Chain(args.rows, args.layers, dtype)
    rows = {"gemms alone": chain.gemms_alone, "elementwise alone": chain.elementwise_alone, "chain": chain.chain}
    rows.update({f"chain without {op}": (lambda op=op: chain.chain(skip=op)) for op in ("rotary", "norms", "silu_mul")})
    results = []
    for name, fn in rows.items():
        results.append({"row": name, "threads": args.threads, "rows": args.rows, "dtype": args.dtype,
                        **measure(fn, args.reps)})
        print(json.dumps(results[-1]))
    return results


if __name__ == "__main__":
    main()
