"""Which implementation runs each part of a step, as the config asks for it: `model.kernels` (auto | torch) and
`model.kernel_overrides` ({part: choice}). The one owner of the parts' names and their choices; what each choice
means and where it can run is the execution plan's (engine/executor/plan.py), which resolves `auto` against the
machine and the model at load, and refuses an explicit choice that cannot run here with the reason.

`kernels=auto` (the default) takes, per part, the fastest implementation the machine runs; `kernels=torch` takes
torch's own ops for every part (the reference every kernel is tested against). Overrides pin single parts, for
tests and benchmarks: `model.kernel_overrides={decode_attention: sdpa, layers: fused}`."""

from __future__ import annotations

# part -> its choices, "auto" first. A choice names an implementation, not a behaviour: every choice computes the
# same step (to the dtype's rounding where the summation order differs).
PARTS: dict[str, tuple[str, ...]] = {
    # the decoder's layers: "split" (one C++ call per step for every layer, and at two or more threads the
    # column-split form for steps of many rows), "loop" (that C++ call, never split), "fused" (a Python loop of
    # the fused C++ kernels), "compiled" (CUDA: rotary and SiLU-mul through torch.compile), "torch"
    "layers": ("auto", "split", "loop", "fused", "compiled", "torch"),
    # linear layers on CPU: a oneDNN-packed copy of the weights from a row count timed at load, or dense weights
    "linears": ("auto", "onednn", "dense"),
    # steps of a few rows (decodes at small batch) in bf16: "cpp" (the extension's AVX512-BF16 product on the dense
    # weights, up to a row count timed at load), "off" (the linears part's kernel)
    "decode_linears": ("auto", "cpp", "off"),
    # the attention backend: "varlen" (CUDA flash varlen), "grouped" (padded groups: C++ kernels or SDPA)
    "attention": ("auto", "varlen", "grouped"),
    "decode_attention": ("auto", "cpp", "sdpa"),  # decode rows over the paged cache (grouped backend)
    "prefill_attention": ("auto", "cpp", "sdpa"),  # prompt and embedding chunks (grouped backend)
    "encoder_attention": ("auto", "cpp", "sdpa"),  # a separate encoder's attention
    # adapter rows' LoRA updates: "cpp" (one C++ call per projection and adapter), "torch" (torch's products,
    # per adapter or all adapters stacked, by the adapters in the step), or either torch form pinned
    "lora": ("auto", "cpp", "torch", "per_slot", "stacked"),
    "sampler": ("auto", "cpp", "torch"),  # the draw from each row's probabilities and greedy rows' argmax
    "cuda_graphs": ("auto", "off"),  # CUDA: decode-only steps replayed as CUDA graphs
}
KERNELS = ("auto", "torch")
# how the decoder's linear weights are stored (model.quantization; layers/quantized.py runs them); "auto": a
# quantized GGUF file's own form (int4 for 4-bit blocks, int8 for 5- to 8-bit ones), else none
QUANTIZATIONS = ("none", "int8", "int4", "auto")
# `kernels=torch`: each part on torch's own ops
TORCH: dict[str, str] = {"layers": "torch", "linears": "dense", "decode_linears": "off", "attention": "grouped", "decode_attention": "sdpa",
                         "prefill_attention": "sdpa", "encoder_attention": "sdpa", "lora": "torch",
                         "sampler": "torch", "cuda_graphs": "off"}


def check_kernels(kernels: str, overrides: dict[str, str]) -> None:
    """Raise ValueError naming the valid values for a bad `kernels` or a bad override part or choice."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; expected {' or '.join(KERNELS)}")
    for part, choice in overrides.items():
        if part not in PARTS:
            raise ValueError(f"kernel_overrides: unknown part {part!r}; parts: {', '.join(PARTS)}")
        if choice not in PARTS[part]:
            raise ValueError(f"kernel_overrides: unknown choice {choice!r} for {part}; expected "
                             f"{', '.join(PARTS[part])}")


def requested(kernels: str, overrides: dict[str, str]) -> dict[str, str]:
    """Every part's requested choice: the overrides over `kernels`'s defaults ("auto" everywhere, or TORCH)."""
    base = dict(TORCH) if kernels == "torch" else dict.fromkeys(PARTS, "auto")
    return {**base, **overrides}
