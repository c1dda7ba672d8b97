"""bf16 on the CPU: "auto" picks it where the CPU has bf16 dot products; the decode kernel and the
packed linears take it; generations equal transformers' in bf16 under the near-tie rule and embeddings stay
within cosine 0.999 of fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from orthrus_rag import machine
from orthrus_rag.config import ModelConfig
from orthrus_rag.layers.attention import cpu_kernels
from orthrus_rag.layers.linear import choose_kernel, linear, onednn_available, pack_linears, pack_module
from orthrus_rag.params import PoolingParams, SamplingParams
from tests.conftest import MINILM, SMOL, engine_overrides
from tests.parity import check_greedy_close, hf_greedy

pytestmark = pytest.mark.isa  # make test runs this file again under ORTHRUS_CPU_ISA=avx2

BF16_TIE_STD = 0.1  # a near-tie in bf16: a gap under this fraction of the logits' std (as the GPU set)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("flags,device,want", [
    ({"avx512_bf16", "avx512f"}, "cpu", torch.bfloat16),
    ({"amx_bf16", "amx_tile"}, "cpu", torch.bfloat16),
    ({"avx512f", "avx2"}, "cpu", torch.float32),
    (set(), "cpu", torch.float32),  # unreadable flags: the safe choice
    (set(), "cuda", torch.bfloat16),
])
def test_auto_dtype_follows_the_hardware(monkeypatch, flags, device, want):
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    assert ModelConfig(device=device).torch_dtype is want
    assert ModelConfig(device=device, dtype="float32").torch_dtype is torch.float32  # forced either way


@pytest.mark.skipif(not onednn_available(torch.bfloat16, "cpu"),
                    reason="oneDNN's packed bf16 needs avx512bw/vl/dq or avx_ne_convert")
def test_a_packed_bf16_linear_equals_the_dense_one():
    layer = nn.Linear(96, 200).to(torch.bfloat16)
    x = torch.randn(7, 96).to(torch.bfloat16)
    want = F.linear(x, layer.weight, layer.bias)
    pack_module(layer)
    got = linear(layer, x)
    assert got.dtype is torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert choose_kernel([(96, 200)], rows=(1, 8), dtype=torch.bfloat16) in (None, 1, 8)


def test_without_onednn_bf16_packing_is_refused_in_one_line_and_auto_stays_dense(monkeypatch):
    """An AVX2-only CPU: torch's oneDNN has no bf16 there (its reorder raises mid-load). A packed copy asked for by
    name is refused naming the flags; `linears=auto` keeps bf16 linears dense, and fp32 still packs."""
    from orthrus_rag.engine.executor.loading import _packed_from
    from orthrus_rag.engine.executor.plan import choose_linears

    monkeypatch.setattr(machine, "onednn_bf16_supported", lambda: False)
    assert not onednn_available(torch.bfloat16, "cpu")
    model = nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="avx512bw, avx512vl and avx512dq, or avx_ne_convert"):
        pack_module(model[0])
    with pytest.raises(ValueError, match="linears: dense"):
        choose_linears("onednn", torch.device("cpu"), torch.bfloat16)
    assert _packed_from("auto", [(16, 8)], torch.bfloat16, "cpu") is None
    x = torch.randn(3, 16).to(torch.bfloat16)
    torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))  # dense bf16 runs
    if torch.backends.mkldnn.is_available():
        assert onednn_available(torch.float32, "cpu")
        assert pack_linears(nn.Sequential(nn.Linear(16, 8))) == 1


def test_the_decode_kernel_reads_a_bf16_cache_in_fp32_arithmetic():
    if not cpu_kernels.decode_kernel_available():
        pytest.skip("the C++ kernel cannot be built here (the grouped backend's SDPA path is tested instead)")
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 32), torch.randn(80, 2, 32), torch.randn(80, 2, 32)
    slots = torch.stack([torch.randperm(80)[:40] for _ in range(3)]).contiguous()
    lens = torch.tensor([40, 9, 25])
    want = cpu_kernels.decode_attention(q, k, v, slots, lens, 0.2, None)
    got = cpu_kernels.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), slots, lens, 0.2, None)
    assert got.dtype is torch.bfloat16
    # NOTE: the inputs' bf16 rounding (2^-8 relative) is the whole error: the arithmetic is fp32
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.decode_attention(q.half(), k.half(), v.half(), slots, lens, 0.2, None)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 2, 256), (8, 4, 64),
                                                (10, 2, 64), (12, 2, 64), (14, 2, 64), (12, 1, 64), (6, 2, 96)])
@pytest.mark.parametrize("window", [None, 5])
def test_the_bf16_decode_paths_match_fp32_arithmetic(heads, kv_heads, dim, window):
    """Head sizes 64 / 128 / 256 with up to 8 query heads per KV head take the AVX512-BF16 path (16 keys a block),
    the rest the generic one: either within bf16's rounding of an fp32 computation on the same inputs, at every
    block edge of the key count, with queries strided as the fused projection leaves them."""
    if not cpu_kernels.decode_kernel_available():
        pytest.skip("the C++ kernel cannot be built here (the grouped backend's SDPA path is tested instead)")
    if "avx512_bf16" in machine.cpu_flags():  # NOTE: the fast path shares the prefill kernel's build condition
        assert cpu_kernels.kernels().prefill_attention_supported()
    torch.manual_seed(heads + dim)
    lens = torch.tensor([1, 15, 16, 17, 33, 40])
    fused = torch.randn(len(lens), heads + 2 * kv_heads, dim).bfloat16()  # q rows strided, as views of Q/K/V
    q = fused[:, :heads]
    k, v = torch.randn(90, kv_heads, dim).bfloat16(), torch.randn(90, kv_heads, dim).bfloat16()
    slots = torch.stack([torch.randperm(90)[:40] for _ in lens]).contiguous()
    want = cpu_kernels.decode_attention(q.float(), k.float(), v.float(), slots, lens, dim**-0.5, window)
    got = cpu_kernels.decode_attention(q, k, v, slots, lens, dim**-0.5, window)
    generic = cpu_kernels.decode_attention(q, k, v, slots, lens, dim**-0.5, window, generic=True)
    assert got.dtype is torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    # NOTE: the two bf16 paths differ only in the order of fp32 sums: at most a bf16 rounding step apart
    torch.testing.assert_close(got.float(), generic.float(), atol=1e-2, rtol=1e-2)


# ---- the model, in bf16, against references --------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_engine(smol_path):  # NOTE: smol_path marks every test that uses it slow (conftest.MODEL_FIXTURES)
    from orthrus_rag import Engine

    # NOTE: a budget below the prompts' length, so prefills are chunked and share steps with decodes
    return Engine.from_pretrained(SMOL, embedding_model=MINILM, **engine_overrides(dtype="bfloat16"))


def test_bf16_engine_runs_bf16_with_the_decode_kernel(bf16_engine):
    from orthrus_rag.layers.linear import PackedLinear

    assert bf16_engine.runner.kv_caches[0][0].dtype is torch.bfloat16
    assert bf16_engine.runner.decode_kernel == cpu_kernels.decode_kernel_available()
    if not onednn_available(torch.bfloat16, "cpu"):  # NOTE: an AVX2 CPU (or ORTHRUS_CPU_ISA=avx2): dense bf16
        model = bf16_engine.runner.model
        assert not any(isinstance(m, PackedLinear) or hasattr(m, "_onednn") for m in model.modules())


def test_bf16_greedy_equals_transformers_bf16_up_to_a_near_tie(bf16_engine, smol_path, smol_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.bfloat16).eval()
    prompts = ["The capital of France is", "One, two, three, four,",
               "Write a sentence about rivers and the mountains they come from, in the style of a textbook:"]
    ids = [smol_tokenizer(p)["input_ids"] for p in prompts]
    outs = bf16_engine.generate(ids, GREEDY)  # together: decodes of some beside prefill chunks of others
    for prompt, out in zip(ids, outs):
        check_greedy_close(hf, prompt, list(out.token_ids), hf_greedy(hf, prompt, GREEDY.max_tokens),
                           tol=1e-3, tol_std=BF16_TIE_STD)


def _cosines(want, got) -> list[float]:
    return [float(F.cosine_similarity(w.float(), g.float(), dim=0)) for w, g in zip(want, got)]


def test_bf16_backbone_embeddings_stay_within_cosine_0999_of_fp32(bf16_engine, smol_engine):
    texts = ["Jane Austen wrote Pride and Prejudice.", "The Nile flows north into the Mediterranean Sea. " * 6,
             "a", "Mount Everest is the highest mountain above sea level, on the border of Nepal and China."]
    params = PoolingParams(pooling="mean", adapter="")  # the bare backbone, past the bf16 engine's encoder
    assert smol_engine.runner.kv_caches[0][0].dtype is torch.float32
    cosines = _cosines([o.embedding for o in smol_engine.embed(texts, params)],
                       [o.embedding for o in bf16_engine.embed(texts, params)])
    assert min(cosines) >= 0.999, cosines


def test_bf16_encoder_embeddings_stay_within_cosine_0999_of_fp32(bf16_engine, served):
    from tests.conftest import SERVED_REFERENCE_TEXTS

    got = [o.embedding for o in bf16_engine.embed(SERVED_REFERENCE_TEXTS)]  # the encoder's own pooling
    cosines = _cosines(served.reference, got)  # the served engine's fp32 MiniLM
    assert min(cosines) >= 0.999, cosines
