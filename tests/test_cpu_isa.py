"""ORTHRUS_CPU_ISA (machine.py): this machine read as an AVX2-only CPU, so the AVX2 and generic paths of the C++
kernels and the dense bf16 linears are tested on every x86-64 machine (`make test` runs the kernel tests a second
time under ORTHRUS_CPU_ISA=avx2)."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag import machine
from orthrus_rag.config import ModelConfig

pytestmark = pytest.mark.isa  # make test runs this file again under ORTHRUS_CPU_ISA=avx2


def test_avx2_hides_every_flag_above_x86_64_v3(monkeypatch):
    monkeypatch.setattr(machine, "_proc_flags", lambda: {"avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16",
                                                         "avx_vnni", "avx_ne_convert", "sse4_2"})
    monkeypatch.setenv(machine.ISA_ENV, "native")
    assert machine.has_native_bf16() and ModelConfig(device="cpu").torch_dtype is torch.bfloat16
    monkeypatch.setenv(machine.ISA_ENV, "avx2")
    assert machine.cpu_flags() == {"avx", "avx2", "fma", "sse4_2"}
    assert not machine.has_native_bf16() and ModelConfig(device="cpu").torch_dtype is torch.float32
    assert not machine.onednn_bf16_supported() and machine.march() == "x86-64-v3"


def test_each_isa_has_its_own_caches(monkeypatch):
    from orthrus_rag.layers import cpu_extension

    monkeypatch.setenv(machine.ISA_ENV, "native")
    native = cpu_extension.build_name(), machine.machine_key("linear")
    monkeypatch.setenv(machine.ISA_ENV, "AVX2")  # NOTE: case and spaces forgiven
    assert machine.isa() == "avx2"
    avx2 = cpu_extension.build_name(), machine.machine_key("linear")
    assert native[0] != avx2[0] and native[1] != avx2[1]


def test_an_unknown_isa_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(machine.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match=r"ORTHRUS_CPU_ISA='avx1024': expected one of native, avx2"):
        machine.isa()


@pytest.mark.slow
@pytest.mark.skipif(machine.isa() != "avx2", reason="checks the build that `make test` runs under ORTHRUS_CPU_ISA=avx2")
def test_the_avx2_build_has_no_avx512_paths():
    from orthrus_rag.layers.cpu_extension import kernels

    mod = kernels()
    assert mod is not None, "the CPU extension did not build for x86-64-v3"
    assert not mod.prefill_attention_supported() and not mod.lora_bf16_pairs()


@pytest.mark.skipif(machine.isa() != "avx2", reason="checks the environment `make test` reads this CPU as AVX2 in")
def test_torch_reads_the_cpu_as_avx2_too():
    # ATen picks its kernels by ATEN_CPU_CAPABILITY and oneDNN by ONEDNN_MAX_CPU_ISA, apart: with only the first
    # capped, ATen's AVX2 flash attention on an AMX CPU asks oneDNN to pack bf16 tiles for AMX, and raises
    # "pack_vnni2 is only supported when avx512 is supported" (seen on an AMX Xeon)
    assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
    q = torch.randn(1, 4, 64, 32, dtype=torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
