"""How fast one core streams a model's linear weights through a product of M rows, by weight layout.

    python scripts/bench_linear_layout.py --threads 1 --rows 1 32 --dtypes bfloat16 float32

30 layers of SmolLM2-135M's shapes (QKV 960x576, O 576x576, gate-up 3072x576, down 576x1536: 212 MB in bf16),
more than the caches hold, as in a decode step. Layouts: the dense weight (`F.linear`), a plain oneDNN copy
(`to_mkldnn`) and oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, what layers/linear.py packs with).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
POINTWISE = torch.ops.mkldnn._linear_pointwise


def one_pass(weights: list, inputs: dict, product) -> float:
    for _ in range(2):  # warm-up
        for w in weights:
            product(inputs[w[0].shape[1]], w)
    start = time.perf_counter()
    for _ in range(5):
        for w in weights:
            product(inputs[w[0].shape[1]], w)
    return (time.perf_counter() - start) / 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| layout | dtype | rows | ms per pass | GB/s |\n|---|---|---:|---:|---:|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        dense = [((torch.randn(n, k) * 0.02).to(dtype),) for _ in range(args.layers) for n, k in SHAPES]
        nbytes = sum(w[0].numel() * w[0].element_size() for w in dense)
        layouts = {"dense": (dense, lambda x, w: F.linear(x, w[0])),
                   "to_mkldnn": ([(w[0], w[0].to_mkldnn()) for w in dense],
                                 lambda x, w: POINTWISE(x, w[1], None, "none", [], "")),
                   "blocked": ([(w[0], torch.ops.mkldnn._reorder_linear_weight(w[0])) for w in dense],
                               lambda x, w: POINTWISE(x, w[1], None, "none", [], ""))}
        for m in args.rows:
            inputs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
            for layout, (weights, product) in layouts.items():
                seconds = one_pass(weights, inputs, product)
                print(f"| {layout} | {name} | {m} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
