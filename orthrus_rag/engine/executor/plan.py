"""The execution plan: which implementation runs each part of a step on this engine, decided and named in one place.

A step's work is done by one of several bodies per part: the layers by a Python loop of torch ops, a Python loop of
the fused C++ kernels, one C++ call for every layer, or that call in its column-split form; attention by C++
kernels whose body depends on the dtype and the CPU's instruction set (AVX2, AVX-512, AVX512-BF16, AMX), by
torch's SDPA, or on CUDA by flash varlen attention and CUDA graphs; linears on dense weights or oneDNN-packed
copies from a row count timed at load; LoRA rows through a C++ kernel or torch's products; the sampler's draw in
C++ or torch. The config asks per part (`model.kernels`, `model.kernel_overrides`: config/kernels.py); the
`choose_*` functions below resolve each request against the device, the dtype, the built extension and the
model, and are the only place that does: the loader (engine/executor/loading.py) and the runner apply what they
return, and `auto` falls back where a kernel cannot run while an explicit choice that cannot run is refused with
the reason. `describe` then reads the loaded engine back into an `ExecutionPlan` (`Engine.plan`): logged in one
line at start, printed by `orthrus-rag plan`, shown in `/v1/models`, written beside each run's config.

Each cell names its part, the choice (a config value: `cpp`, `sdpa`, `split`, ...), the body that runs it, and
what it needs beyond a plain x86-64 CPU (`needs`: "avx512_bf16", "amx", "cuda"), so the test sets that cover it
are named too (`isa`, `gpu`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from orthrus_rag import machine


@dataclass(frozen=True)
class Cell:
    """One part of a step: the implementation that runs it, and what that needs of the machine."""

    part: str  # a config/kernels.py part
    choice: str  # its choice there ("cpp", "sdpa", "split", ...)
    body: str = ""  # which body or form runs it ("AMX body", "oneDNN from 4 rows", ...)
    needs: str = ""  # "" (any x86-64 CPU) | "avx512_bf16" | "amx" | "cuda"

    def __str__(self) -> str:
        return f"{self.part}: {self.choice}" + (f" ({self.body})" if self.body else "")


@dataclass(frozen=True)
class ExecutionPlan:
    """What a loaded engine runs (see the module)."""

    device: str
    isa: str  # the instruction set the CPU kernels target ("avx2", "avx512", "avx512_bf16", "amx"), or "cuda"
    dtype: str
    threads: int
    cells: tuple[Cell, ...] = field(default_factory=tuple)

    def cell(self, part: str) -> Cell:
        for c in self.cells:
            if c.part == part:
                return c
        raise KeyError(f"no plan cell {part!r}; cells: {', '.join(c.part for c in self.cells)}")

    def summary(self) -> str:
        """One line: the device, then each part's choice."""
        head = f"{self.device} ({self.isa}), {self.dtype}, {self.threads} thread{'s' * (self.threads != 1)}"
        return "; ".join([head, *map(str, self.cells)])

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "isa": self.isa, "dtype": self.dtype, "threads": self.threads,
                "cells": {c.part: {"choice": c.choice, **({"body": c.body} if c.body else {}),
                                   **({"needs": c.needs} if c.needs else {})} for c in self.cells}}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def __str__(self) -> str:
        width = max(len(c.part) for c in [*self.cells, Cell("device", "")])
        lines = [f"{'device':<{width}}  {self.summary().split('; ')[0]}"]
        lines += [f"{c.part:<{width}}  {c.choice}" + (f" ({c.body})" if c.body else "")
                  + (f"  [needs {c.needs}]" if c.needs else "") for c in self.cells]
        return "\n".join(lines)


def cpu_isa() -> str:
    """The CPU's widest instruction set, as `machine.cpu_flags` reads it (which bodies the kernels build for it
    is each cell's own: the AMX body also needs a compiler and an OS that allow it)."""
    flags = machine.cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "generic"


# -- the decisions: each takes the part's requested choice and returns the one that runs ------------------------

def _resolve(part: str, want: str, best: str, why_not: str | None, fallback: str) -> str:
    """`best` where it runs (`why_not` None); else `auto` takes `fallback` and an explicit `best` is refused."""
    if want == "auto":
        return best if why_not is None else fallback
    if want == best and why_not is not None:
        raise ValueError(f"model.kernel_overrides: {part}={want} cannot run here: {why_not}; use {fallback} or auto")
    return want


def _no_extension() -> str | None:
    from orthrus_rag.layers.cpu_extension import kernels

    return None if kernels() is not None else "the C++ CPU extension did not build (see the log for why)"


def _cpu_only(device: torch.device, what: str) -> str | None:
    return None if device.type == "cpu" else f"{what} runs on the CPU, not on {device}"


def choose_layers(want: str, device: torch.device, dtype: torch.dtype) -> str:
    """The decoder layers' driver before the model is seen: on CUDA "compiled" (or "torch"); on the CPU "split"
    (or the choice asked for) where the fused kernels run for `dtype`, else "torch". Whether the model's layers
    allow the C++ loop is the loader's question (`CausalLM.use_cpu_layer_loop`)."""
    from orthrus_rag.layers import cpu_elementwise

    if device.type == "cuda":
        if want in ("split", "loop", "fused"):
            raise ValueError(f"model.kernel_overrides: layers={want} is a CPU kernel; on {device} use compiled, "
                             "torch or auto")
        return "compiled" if want == "auto" else want
    if want == "compiled":
        raise ValueError("model.kernel_overrides: layers=compiled is the CUDA path; on the CPU use split, loop, "
                         "fused, torch or auto")
    if want == "torch":
        return "torch"
    why = _no_extension() or (None if dtype in cpu_elementwise.DTYPES else
                              f"the fused kernels take float32 / bfloat16, not {_dtype_name(dtype)}")
    if why is not None:
        return _resolve("layers", want, want if want != "auto" else "split", why, "torch")
    return "split" if want == "auto" else want


def choose_linears(want: str, device: torch.device, dtype: torch.dtype) -> str:
    """"onednn", "dense" or "auto" (the row count timed at load, engine/executor/loading.py); on CUDA "dense"."""
    from orthrus_rag.layers.linear import check_packable, onednn_available

    if device.type != "cpu":
        return "dense"
    if want == "onednn":
        check_packable(dtype)  # NOTE: asked for by name: refused in one line, not by torch's reorder mid-load
        if not onednn_available(dtype, device):
            raise ValueError(f"model.kernel_overrides: linears=onednn cannot run here: this torch has no oneDNN "
                             f"packed linears for {_dtype_name(dtype)}; use dense or auto")
    return want


def choose_decode_linears(want: str, device: torch.device, dtype: torch.dtype) -> str:
    """"cpp" (the few-row bf16 product, layers/linear.py; `auto` then times up to how many rows at load) or "off"."""
    from orthrus_rag.layers.linear import gemv_available

    if want == "off":
        return "off"
    return _resolve("decode_linears", want, "cpp", gemv_available(dtype, device), "off")


def choose_attention(want: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> ModuleType:
    """The attention backend: varlen flash attention on CUDA where its kernel takes the case, else grouped."""
    from orthrus_rag.layers.attention import select_backend

    return select_backend(want, device, dtype, head_dim)


def choose_decode(want: str, device: torch.device, dtype: torch.dtype, backend: ModuleType) -> str:
    """"cpp" (the C++ decode kernel over the paged cache) or "sdpa", for the grouped backend's decode rows."""
    from orthrus_rag.layers.attention import grouped

    why = (_cpu_only(device, "the C++ decode kernel") or _no_extension()
           or (None if dtype in (torch.float32, torch.bfloat16) else
               f"the decode kernel takes float32 / bfloat16, not {_dtype_name(dtype)}")
           or (None if backend is grouped else "the varlen backend attends decodes itself"))
    return _resolve("decode_attention", want, "cpp", why, "sdpa")


def _prefill_why(device: torch.device, dtype: torch.dtype, head_dim: int, auto: bool) -> str | None:
    from orthrus_rag.layers.attention.cpu_prefill import prefill_kernel_available, prefill_kernel_runs

    if (why := _cpu_only(device, "the C++ prefill kernel") or _no_extension()) is not None:
        return why
    if not prefill_kernel_runs(dtype, head_dim):
        return (f"the prefill kernel takes float32, or bfloat16 where the CPU has AVX512-BF16, with head sizes "
                f"that are multiples of 32 (here {_dtype_name(dtype)}, head size {head_dim})")
    if auto and not prefill_kernel_available(dtype, head_dim):
        # NOTE: bf16 on AMX without the kernel's AMX body: SDPA runs on AMX tiles there, faster than AVX512-BF16
        return "SDPA runs bfloat16 on AMX tiles here, faster than the kernel's AVX512-BF16 body"
    return None


def choose_prefill(want: str, device: torch.device, dtype: torch.dtype, head_dim: int, backend: ModuleType) -> str:
    """"cpp" (the C++ chunked-prefill kernel) or "sdpa", for the grouped backend's prompt and embedding chunks."""
    from orthrus_rag.layers.attention import grouped

    why = _prefill_why(device, dtype, head_dim, want == "auto") or (
        None if backend is grouped else "the varlen backend attends chunks itself")
    return _resolve("prefill_attention", want, "cpp", why, "sdpa")


def choose_encoder(want: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """"cpp" (the prefill kernel's bodies) or "sdpa", for a separate encoder's attention."""
    return _resolve("encoder_attention", want, "cpp", _prefill_why(device, dtype, head_dim, want == "auto"), "sdpa")


def choose_lora(want: str, device: torch.device, dtype: torch.dtype) -> str:
    """"cpp" (the C++ LoRA kernel) where it runs, else torch's products ("torch", or a pinned form)."""
    why = (_cpu_only(device, "the C++ LoRA kernel") or _no_extension()
           or (None if dtype in (torch.float32, torch.bfloat16) else
               f"the LoRA kernel takes float32 / bfloat16, not {_dtype_name(dtype)}"))
    return _resolve("lora", want, "cpp", why, "torch")


def choose_sampler(want: str, device: torch.device) -> str:
    """"cpp" (the C++ draw and argmax) or "torch"."""
    return _resolve("sampler", want, "cpp", _cpu_only(device, "the C++ sampler") or _no_extension(), "torch")


def choose_cuda_graphs(want: str, device: torch.device) -> str:
    """"on" on CUDA unless turned "off"; "off" elsewhere."""
    return "on" if want == "auto" and device.type == "cuda" else "off"


# -- the plan as it runs, read back from the loaded engine -----------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(n: int) -> str:
    return f"{n} row{'s' * (n != 1)}"


def _packed_from(module: torch.nn.Module | None) -> int | None:
    """The row count from which a group's linears take their oneDNN copy (read from its first packed Linear)."""
    from orthrus_rag.layers.linear import packed_from

    if module is None:
        return None
    first = next((m for m in module.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "_onednn")), None)
    carrier = next((f.carrier for m in module.modules() for f in getattr(m, "fusions", {}).values()
                    if hasattr(f.carrier, "_onednn")), None)
    packed = first or carrier
    return None if packed is None else packed_from(packed)


def _quantized(module: torch.nn.Module | None) -> str | None:
    """A group's quantized weights as the plan names them (layers/quantized.py), read from its first; None: none."""
    if module is None:
        return None
    quant = next((q for m in module.modules() if (q := getattr(m, "_quant", None)) is not None), None)
    if quant is None:
        return None
    return f"{quant.kind} weight-only" + (f" (groups of {quant.group})" if quant.group else "")


def _linears_cell(runner: Any, device: torch.device) -> Cell:
    if device.type != "cpu":
        return Cell("linears", "dense", "cuBLAS", "cuda")
    model = runner.model
    head = getattr(model, "lm_head", None)
    groups = {"layers": (model.model, _packed_from(model.model)), "LM head": (head, _packed_from(head))}
    if runner.encoder is not None:
        groups["encoder"] = (runner.encoder, _packed_from(runner.encoder))
    for name, encoder in getattr(runner, "encoders", {}).items():  # cross-encoder rerankers (engine/rerankers.py)
        if name:
            groups[f"reranker {Path(name).name}"] = (encoder, _packed_from(encoder))
    choice = "onednn" if any(v is not None for _, v in groups.values()) else "dense"
    body = ", ".join(f"{g} {_quantized(m) or ('dense' if v is None else 'oneDNN from ' + _rows(v))}"
                     for g, (m, v) in groups.items())
    return Cell("linears", choice, body)


def _decode_linears_cell(runner: Any) -> Cell:
    from orthrus_rag.layers.linear import gemv_rows

    model = runner.model
    head = getattr(model, "lm_head", None)
    firsts = {group: next((r for m in module.modules() if (r := gemv_rows(m))), 0) if module is not None else 0
              for group, module in (("layers", model.model), ("LM head", head))}
    loop = getattr(model.model, "layer_loop", None)
    if loop is not None and getattr(loop, "_args", None) is not None:  # NOTE: the C++ loop's own count is what runs
        firsts["layers"] = loop.gemv_rows
    if not any(firsts.values()):
        return Cell("decode_linears", "off")
    body = ", ".join(f"{g} up to {_rows(r)}" for g, r in firsts.items() if r)
    return Cell("decode_linears", "cpp", f"AVX512-BF16 product on dense weights: {body}", "avx512_bf16")


def _layers_cell(runner: Any, device: torch.device) -> Cell:
    inner = getattr(runner.model, "model", runner.model)
    kind = getattr(inner, "elementwise", "torch")
    if device.type == "cuda":
        return (Cell("layers", "compiled", "rotary and SiLU-mul through torch.compile", "cuda") if kind == "compiled"
                else Cell("layers", "torch", "Python loop of torch ops", "cuda"))
    loop = getattr(inner, "layer_loop", None)
    if loop is not None and (form := loop.describe(runner.attn_backend)) is not None:
        return Cell("layers", "split" if loop.split else "loop", form)
    if getattr(inner, "fused_norms", False):
        return Cell("layers", "fused", "Python loop of the fused C++ kernels")
    if kind == "cpp":  # NOTE: norms that do not fuse (Gemma 3's, full-delta adapters')
        return Cell("layers", "fused", "Python loop; rotary and SiLU-mul as C++ kernels")
    return Cell("layers", "torch", "Python loop of torch ops")


def _prefill_body(dtype: torch.dtype) -> tuple[str, str]:
    from orthrus_rag.layers.attention.cpu_prefill import amx_body

    if dtype == torch.float32:
        return f"fp32 body, {'AVX-512' if 'avx512f' in machine.cpu_flags() else 'AVX2'} width", ""
    return ("AMX body", "amx") if amx_body() else ("AVX512-BF16 body", "avx512_bf16")


def _attention_cells(runner: Any, dtype: torch.dtype, device: torch.device) -> list[Cell]:
    from orthrus_rag.layers.attention import varlen
    from orthrus_rag.layers.attention.cpu_kernels import decode_bf16_body

    attn = runner.model.attention_layers[0]
    cuda = "cuda" if device.type == "cuda" else ""
    graphs = ", decode-only steps as CUDA graphs" if runner.decode_graphs is not None else ""
    if runner.attn_backend is varlen:
        return [Cell("decode_attention", "varlen", f"flash varlen{graphs}", "cuda"),
                Cell("prefill_attention", "varlen", "flash varlen", "cuda")]
    if runner.decode_kernel:
        fast = dtype == torch.bfloat16 and decode_bf16_body(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        decode = (Cell("decode_attention", "cpp", "AVX512-BF16 body", "avx512_bf16") if fast
                  else Cell("decode_attention", "cpp", "generic body"))
    else:
        decode = Cell("decode_attention", "sdpa", f"padded groups{graphs}", cuda)
    prefill = (Cell("prefill_attention", "cpp", *_prefill_body(dtype)) if runner.prefill_kernel
               else Cell("prefill_attention", "sdpa", "padded groups", cuda))
    return [decode, prefill]


def _encoder_cell(encoder: torch.nn.Module, dtype: torch.dtype) -> Cell:
    from orthrus_rag.layers.attention.cpu_prefill import prefill_kernel_runs

    device = next(encoder.parameters()).device
    head_dim = encoder.config.hidden_size // encoder.config.num_attention_heads
    if encoder.cpu_attention_kernel and device.type == "cpu" and prefill_kernel_runs(dtype, head_dim):
        return Cell("encoder_attention", "cpp", *_prefill_body(dtype))
    return Cell("encoder_attention", "sdpa", "per sequence", "cuda" if device.type == "cuda" else "")


def _lora_cell(model: torch.nn.Module) -> Cell | None:
    from orthrus_rag.layers.lora import LoRALinear

    first = next((m for m in model.modules() if isinstance(m, LoRALinear)), None)
    if first is None:
        return None
    if first.kernel == "auto" and first.cpu_kernel:
        return Cell("lora", "cpp", "one call per projection and adapter")
    return {"auto": Cell("lora", "torch", "products per adapter, or stacked from several adapters in a step"),
            "per_slot": Cell("lora", "per_slot", "torch products per adapter"),
            "stacked": Cell("lora", "stacked", "torch products, adapters stacked")}[first.kernel]


def describe(runner: Any) -> ExecutionPlan:
    """The plan of a built runner (engine/executor/runner.py): what each part of its steps runs."""
    model, device = runner.model, torch.device(runner.device)
    dtype = next(model.parameters()).dtype
    cells = [_layers_cell(runner, device), _linears_cell(runner, device)]
    if device.type == "cpu":
        cells.append(_decode_linears_cell(runner))
    cells += _attention_cells(runner, dtype, device)
    # NOTE: the embedding encoder's, else a reranker's: the choice is made for every encoder alike (loading.py)
    encoder = runner.encoder if runner.encoder is not None else next(iter(getattr(runner, "encoders", {}).values()),
                                                                      None)
    if encoder is not None:
        cells.append(_encoder_cell(encoder, dtype))
    if (lora := _lora_cell(model)) is not None:
        cells.append(lora)
    cells.append(Cell("sampler", "cpp", "C++ draw and argmax") if runner.sampler.use_kernel
                 else Cell("sampler", "torch"))
    isa = "cuda" if device.type == "cuda" else cpu_isa()
    return ExecutionPlan(str(device), isa, _dtype_name(dtype), torch.get_num_threads(), tuple(cells))


__all__ = ["Cell", "ExecutionPlan", "choose_attention", "choose_cuda_graphs", "choose_decode",
           "choose_decode_linears", "choose_encoder", "choose_layers", "choose_linears", "choose_lora",
           "choose_prefill", "choose_sampler", "cpu_isa", "describe"]
