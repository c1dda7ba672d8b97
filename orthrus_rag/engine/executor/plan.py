"""The execution plan: which implementation runs each part of a step on this engine, named in one place.

A step's work is done by one of several bodies per part: the layers by a Python loop of torch ops, a Python loop of
the fused C++ kernels, one C++ call for every layer, or that call in its column-split form; attention by C++
kernels whose body depends on the dtype and the CPU's instruction set (AVX2, AVX-512, AVX512-BF16, AMX), by
torch's SDPA, or on CUDA by flash varlen attention and CUDA graphs; linears on dense weights or oneDNN-packed
copies from a row count timed at load; LoRA rows through a C++ kernel or torch's products; the sampler's draw in
C++ or torch. `ExecutionPlan` records what the loaded engine takes for each (`Engine.plan`): it is logged in one
line at start, printed by `orthrus-rag plan`, shown in `/v1/models`, and written beside each run's config.

Each cell says what runs and what it needs beyond a plain x86-64 CPU (`needs`: "avx512_bf16", "amx", "cuda"), so
the test sets that cover it are named too (`isa`, `gpu`). The plan is read from the loaded model and runner, after
every choice was made, so it states what runs rather than what was asked for."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from orthrus_rag import machine


@dataclass(frozen=True)
class Cell:
    """One part of a step: the implementation that runs it, and what that needs of the machine."""

    part: str
    choice: str
    needs: str = ""  # "" (any x86-64 CPU) | "avx512_bf16" | "amx" | "cuda"

    def __str__(self) -> str:
        return f"{self.part}: {self.choice}"


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
                "cells": {c.part: {"choice": c.choice, **({"needs": c.needs} if c.needs else {})} for c in self.cells}}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def __str__(self) -> str:
        width = max(len(c.part) for c in [*self.cells, Cell("device", "")])
        lines = [f"{'device':<{width}}  {self.summary().split('; ')[0]}"]
        lines += [f"{c.part:<{width}}  {c.choice}" + (f"  [needs {c.needs}]" if c.needs else "") for c in self.cells]
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(n: int) -> str:
    return f"{n} row{'s' * (n != 1)}"


def _linear_choice(module: torch.nn.Module | None, group: str) -> str:
    """A group's linear kernel, read from its first Linear: oneDNN's packed copy from some row count, or dense."""
    from orthrus_rag.layers.linear import packed_from

    if module is None:
        return f"{group} dense"
    first = next((m for m in module.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "_onednn")), None)
    carrier = next((f.carrier for m in module.modules() for f in getattr(m, "fusions", {}).values()
                    if hasattr(f.carrier, "_onednn")), None)
    packed = first or carrier
    return f"{group} dense" if packed is None else f"{group} oneDNN from {_rows(packed_from(packed))}"


def _layers_cell(runner: Any, device: torch.device, compiled: bool) -> Cell:
    from orthrus_rag.layers import cpu_elementwise

    inner = getattr(runner.model, "model", runner.model)
    if device.type == "cuda":
        return Cell("layers", "Python loop of torch ops" + (", rotary and SiLU-mul compiled" if compiled else ""),
                    "cuda")
    loop = getattr(inner, "layer_loop", None)
    if loop is not None and (form := loop.describe(runner.attn_backend)) is not None:
        return Cell("layers", form)
    if getattr(inner, "fused_norms", False):
        return Cell("layers", "Python loop of the fused C++ kernels")
    attn = runner.model.attention_layers[0]
    if attn.rotary is cpu_elementwise.rotary:  # NOTE: norms that do not fuse (Gemma 3's, full-delta adapters')
        return Cell("layers", "Python loop; rotary and SiLU-mul as C++ kernels")
    return Cell("layers", "Python loop of torch ops")


def _attention_cells(runner: Any, dtype: torch.dtype, device: torch.device) -> list[Cell]:
    from orthrus_rag.layers.attention import grouped, reference, varlen
    from orthrus_rag.layers.attention.cpu_kernels import decode_bf16_body
    from orthrus_rag.layers.attention.cpu_prefill import amx_body

    attn = runner.model.attention_layers[0]
    head_dim = attn.head_dim
    backend = runner.attn_backend
    if backend is varlen:
        graphs = ", decode-only steps as CUDA graphs" if runner.decode_graphs is not None else ""
        return [Cell("decode attention", f"flash varlen{graphs}", "cuda"),
                Cell("prefill attention", "flash varlen", "cuda")]
    if backend is reference:
        return [Cell("decode attention", "SDPA per sequence (reference)"),
                Cell("prefill attention", "SDPA per sequence (reference)")]
    assert backend is grouped
    cuda = "cuda" if device.type == "cuda" else ""
    if runner.decode_kernel:
        fast = dtype == torch.bfloat16 and decode_bf16_body(attn.num_heads, attn.num_kv_heads, head_dim)
        decode = Cell("decode attention", "C++ kernel, AVX512-BF16 body" if fast else "C++ kernel, generic body",
                      "avx512_bf16" if fast else "")
    else:
        graphs = ", decode-only steps as CUDA graphs" if runner.decode_graphs is not None else ""
        decode = Cell("decode attention", f"SDPA over padded groups{graphs}", cuda)
    if runner.prefill_kernel:
        if dtype == torch.float32:
            width = "AVX-512" if "avx512f" in machine.cpu_flags() else "AVX2"
            prefill = Cell("prefill attention", f"C++ kernel, fp32 body ({width} width)")
        elif amx_body():
            prefill = Cell("prefill attention", "C++ kernel, AMX body", "amx")
        else:
            prefill = Cell("prefill attention", "C++ kernel, AVX512-BF16 body", "avx512_bf16")
    else:
        prefill = Cell("prefill attention", "SDPA over padded groups", cuda)
    return [decode, prefill]


def _encoder_cell(encoder: torch.nn.Module, dtype: torch.dtype) -> Cell:
    from orthrus_rag.layers.attention.cpu_prefill import amx_body, prefill_kernel_available

    device = next(encoder.parameters()).device
    head_dim = encoder.config.hidden_size // encoder.config.num_attention_heads
    if device.type == "cpu" and encoder.cpu_attention_kernel and prefill_kernel_available(dtype, head_dim):
        if dtype == torch.float32:
            width = "AVX-512" if "avx512f" in machine.cpu_flags() else "AVX2"
            return Cell("encoder attention", f"C++ kernel, fp32 body ({width} width)")
        return (Cell("encoder attention", "C++ kernel, AMX body", "amx") if amx_body()
                else Cell("encoder attention", "C++ kernel, AVX512-BF16 body", "avx512_bf16"))
    return Cell("encoder attention", "SDPA per sequence", "cuda" if device.type == "cuda" else "")


def _lora_cell(model: torch.nn.Module) -> Cell | None:
    from orthrus_rag.layers.lora import LoRALinear

    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not layers:
        return None
    first = layers[0]
    if first.kernel == "auto" and getattr(first, "cpu_kernel", False):
        return Cell("LoRA", "C++ kernel, one call per projection and adapter")
    return Cell("LoRA", {"auto": "torch products, per adapter or stacked by the adapters in a step",
                         "per_slot": "torch products per adapter", "stacked": "torch products, adapters stacked"}
                [first.kernel])


def describe(runner: Any, compiled_elementwise: bool = False) -> ExecutionPlan:
    """The plan of a built runner (engine/executor/runner.py): what each part of its steps runs."""
    model, device = runner.model, torch.device(runner.device)
    dtype = next(model.parameters()).dtype
    cells = [_layers_cell(runner, device, compiled_elementwise)]
    if device.type == "cpu":
        head = getattr(model, "lm_head", None)
        groups = [_linear_choice(model.model, "layers"), _linear_choice(head, "LM head")]
        if runner.encoder is not None:
            groups.append(_linear_choice(runner.encoder, "encoder"))
        cells.append(Cell("linears", ", ".join(groups)))
    else:
        cells.append(Cell("linears", "torch (cuBLAS)", "cuda"))
    cells += _attention_cells(runner, dtype, device)
    if runner.encoder is not None:
        cells.append(_encoder_cell(runner.encoder, dtype))
    if (lora := _lora_cell(model)) is not None:
        cells.append(lora)
    from orthrus_rag.layers.cpu_extension import kernels

    sample_kernel = runner.sampler.use_kernel and device.type == "cpu" and kernels() is not None
    cells.append(Cell("sampler", "C++ draw and argmax" if sample_kernel else "torch"))
    isa = "cuda" if device.type == "cuda" else cpu_isa()
    return ExecutionPlan(str(device), isa, _dtype_name(dtype), torch.get_num_threads(), tuple(cells))


__all__ = ["Cell", "ExecutionPlan", "cpu_isa", "describe"]
