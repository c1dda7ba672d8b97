"""oneDNN-packed Linear layers compute what the dense ones do, leave the model's Parameters as they were, and
the engine gives the same results with and without them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orthrus_rag.layers import linear as linear_module
from orthrus_rag.layers.linear import PackedLinear, choose_kernel, linear, linear_gelu, onednn_available, pack_linears
from orthrus_rag.layers.lora import LoRALinear
from orthrus_rag.params import PoolingParams, SamplingParams
from tests.conftest import SMOL, engine_overrides

pytestmark = [pytest.mark.isa,
              pytest.mark.skipif(not onednn_available(torch.float32, "cpu"), reason="torch built without oneDNN")]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 24, bias=False)
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.emb.weight  # tied, as in SmolLM2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.relu(self.a(self.emb(ids)))))


def test_packed_model_matches_dense_and_keeps_its_parameters():
    torch.manual_seed(0)
    model = Tiny().eval()
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        want = model(ids)
    keys, a_weight = list(model.state_dict()), model.a.weight
    assert pack_linears(model) == 3
    assert all(isinstance(m, PackedLinear) for m in (model.a, model.b, model.head))
    assert list(model.state_dict()) == keys and model.a.weight is a_weight
    assert model.head.weight is model.emb.weight  # the tie survives
    with torch.inference_mode():
        got = model(ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_non_contiguous_and_non_fp32_inputs_fall_back_correctly():
    torch.manual_seed(1)
    lin = nn.Linear(16, 8)
    pack_linears(nn.Sequential(lin))
    x = torch.randn(16, 10).T  # a transposed view
    torch.testing.assert_close(linear(lin, x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=1e-5)
    xd = x.double()
    assert linear(lin, xd.float()).dtype == torch.float32
    # bf16 input: the dense path, not the fp32 copy
    out = linear(nn.Linear(16, 8).bfloat16(), x.bfloat16())
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gelu_is_the_exact_gelu_of_the_map_packed_or_not(dtype):
    """The GELU in the packed GEMM's epilogue (an encoder's FFN) is the erf GELU of the dense map; an unpacked layer
    or too few rows take torch's ops."""
    if not onednn_available(dtype, "cpu"):
        pytest.skip(f"oneDNN's packed {dtype} path does not run on this CPU")
    torch.manual_seed(2)
    lin = nn.Linear(32, 48).to(dtype)
    x = torch.randn(20, 32).to(dtype)
    with torch.inference_mode():
        want = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()))
        torch.testing.assert_close(linear_gelu(lin, x).float(), want, atol=2e-2, rtol=2e-2)  # unpacked
        seq = nn.Sequential(lin)
        pack_linears(seq, from_rows=8)
        lin = seq[0]  # the PackedLinear that took over the layer's Parameters
        assert getattr(lin, "_onednn", None) is not None
        tol = 1e-5 if dtype == torch.float32 else 4e-2  # NOTE: bf16: the product is rounded before the GELU or not
        torch.testing.assert_close(linear_gelu(lin, x).float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(linear_gelu(lin, x[:3]).float(), want[:3], atol=tol, rtol=tol)  # below from_rows
        # not the tanh approximation: it differs from the erf GELU by ~1e-3 around |x| ~ 2
        approx = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), lin.weight.float(),
                                                                     lin.bias.float()), approximate="tanh")
        if dtype == torch.float32:
            assert not torch.allclose(linear_gelu(lin, x), approx, atol=1e-5, rtol=0)


def test_lora_wrapping_keeps_the_packed_copy():
    lin = nn.Linear(12, 6)
    seq = nn.Sequential(lin)
    pack_linears(seq)
    wrapped = LoRALinear(seq[0])
    assert wrapped._onednn is seq[0]._onednn
    x = torch.randn(5, 12)
    torch.testing.assert_close(wrapped(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=1e-5)


def test_the_layers_the_head_and_the_encoder_each_get_the_faster_kernel(monkeypatch, tmp_path):
    """loading._pack times three groups apart: here only the head's shape is "faster" packed, so only the head is
    packed, and the layers (a fused projection's carrier included) keep their dense weights."""
    from transformers import LlamaConfig

    from orthrus_rag.engine.executor import loading
    from orthrus_rag.models.llama import CausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True)
    model = CausalLM(config).eval()
    model.fuse_projections()
    encoder = Tiny()
    timed: list[list[tuple[int, int]]] = []

    def choose(shapes, dtype):
        timed.append(list(shapes))
        return 4 if shapes == [(32, 96)] else None

    monkeypatch.setattr(loading, "choose_kernel", choose)
    monkeypatch.setenv("ORTHRUS_RAG_CACHE", str(tmp_path))  # NOTE: choices are remembered per machine
    loading._pack("auto", model, encoder, torch.float32, "cpu")
    assert [(32, 96)] in timed and len(timed) == 3
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert linear_module.packed_from(model.lm_head) == 4
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn.fusions["qkv"].carrier, "_onednn") and not hasattr(attn.o_proj, "_onednn")
    assert not any(hasattr(m, "_onednn") for m in encoder.modules())
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.lm_head.weight.T, atol=1e-5, rtol=1e-5)
    assert pack_linears(model, lambda m: m is not model.lm_head) == 2 * 4  # qkv, o, gate_up, down per layer


def test_choose_kernel_times_both_and_names_a_row_count():
    assert choose_kernel([(16, 24), (24, 16)], rows=(1, 4)) in (None, 1, 4)


@pytest.mark.parametrize("ratios,want", [
    ({1: 1.4, 4: 0.8, 16: 0.88, 64: 0.9, 256: 0.92}, 4),  # one row slower (AVX2 on an EPYC core): from 4 rows
    ({1: 0.7, 4: 0.6, 16: 0.9, 64: 0.9, 256: 0.9}, 1),  # faster everywhere
    ({1: 1.3, 4: 1.1, 16: 1.02, 64: 0.98, 256: 0.99}, None),  # saves under 5% over all buckets: no copy
    ({1: 0.9, 4: 1.5, 16: 0.95, 64: 0.7, 256: 0.7}, 16),  # where the saving from there up is largest
])
def test_the_row_threshold_is_where_taking_onednn_saves_most(monkeypatch, ratios, want):
    """choose_kernel's rule on given time ratios (oneDNN's time over the dense one per row bucket)."""
    calls: list[int] = []

    def fake_time(fn, repeats=3):
        calls.append(0)
        return 1.0 if len(calls) % 2 == 0 else ratios[ROWS[len(calls) // 2 % len(ROWS)]]

    ROWS = tuple(ratios)
    monkeypatch.setattr(linear_module, "_time", fake_time)
    assert choose_kernel([(8, 8)], rows=ROWS) == want


def test_fewer_rows_than_the_threshold_take_the_dense_weight():
    torch.manual_seed(2)
    seq = nn.Sequential(nn.Linear(16, 8))
    pack_linears(seq, from_rows=3)
    lin = seq[0]  # NOTE: the PackedLinear that took the plain layer's place
    lin.weight = nn.Parameter(lin.weight.detach() * 2)  # the packed copy is stale: a call's result shows which
    x = torch.randn(5, 16)
    dense, packed = x @ lin.weight.T + lin.bias, x @ (lin.weight / 2).T + lin.bias
    torch.testing.assert_close(linear(lin, x[:2]), dense[:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(lin, x[:3]), packed[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(lin, x.view(1, 5, 16)), packed.view(1, 5, 8), atol=1e-5, rtol=1e-5)
    assert LoRALinear(lin)._onednn_from == 3  # a wrapper keeps the threshold with the copy


@pytest.mark.slow
def test_engine_results_equal_with_and_without_onednn():
    from orthrus_rag import Engine

    dense = Engine.from_pretrained(SMOL, kernel_overrides={"linears": "dense"}, **engine_overrides())
    packed = Engine.from_pretrained(SMOL, kernel_overrides={"linears": "onednn"}, **engine_overrides())
    assert not any(getattr(m, "_onednn", None) is not None for m in dense.runner.model.modules())
    fused = [f for m in packed.runner.model.modules() for f in getattr(m, "fusions", {}).values()]
    assert len(fused) == 2 * 30 and all(getattr(f.carrier, "_onednn", None) is not None for f in fused)
    assert isinstance(packed.runner.model.model.layers[0].self_attn.o_proj, PackedLinear)
    prompts = ["The capital of France is", "List three colours:"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.token_ids for o in dense.generate(prompts, params)]
    got = [o.token_ids for o in packed.generate(prompts, params)]
    assert got == want
    texts = ["a short sentence about rivers", "another one, about mountains and snow"]
    e_dense = torch.stack([o.embedding for o in dense.embed(texts, PoolingParams(pooling="mean"))])
    e_packed = torch.stack([o.embedding for o in packed.embed(texts, PoolingParams(pooling="mean"))])
    assert torch.nn.functional.cosine_similarity(e_dense, e_packed).min() > 0.99999


def _needs_gemv():
    why = linear_module.gemv_available(torch.bfloat16, "cpu")
    if why is not None:
        pytest.skip(f"the few-row bf16 product cannot run here: {why} (decode steps keep oneDNN or dense weights)")


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n,bias", [(64, 7, False), (600, 1001, True), (576, 960, False)])
def test_the_few_row_product_is_the_fp32_product_rounded_once(rows, k, n, bias):
    """Each output is the exact fp32 dot product of bf16 operands rounded once to bf16: equal to it but for the
    odd last bit where the two summation orders straddle a rounding boundary. K of 600 takes the masked tail."""
    from orthrus_rag.layers.cpu_extension import kernels

    _needs_gemv()
    torch.manual_seed(rows)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else torch.empty(0, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    got = kernels().gemv_bf16(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)
    assert (got == want.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.slow
def test_the_few_row_product_refuses_what_it_does_not_take():
    from orthrus_rag.layers.cpu_extension import kernels

    _needs_gemv()
    w = torch.randn(8, 64).bfloat16()
    none = torch.empty(0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x \[T <= 4, K\]"):
        kernels().gemv_bf16(torch.randn(5, 64).bfloat16(), w, none)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        kernels().gemv_bf16(torch.randn(1, 64), w, none)
    with pytest.raises(RuntimeError, match=r"the bias is \[N\] bf16"):
        kernels().gemv_bf16(torch.randn(1, 64).bfloat16(), w, torch.randn(3).bfloat16())


@pytest.mark.slow
def test_few_rows_take_the_few_row_product_and_more_rows_the_other_kernel():
    """`use_gemv` routes inputs of up to its row count (and only outside autograd) through the C++ product, the
    rest through the packed or dense weight as before; a plain Linear becomes a PackedLinear for it."""
    from orthrus_rag.layers.cpu_extension import kernels

    _needs_gemv()
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(96, 80)).to(torch.bfloat16)
    assert linear_module.use_gemv(seq, rows=2) == 1
    lin = seq[0]
    assert isinstance(lin, PackedLinear) and linear_module.gemv_rows(lin) == 2
    assert linear_module.gemv_rows(LoRALinear(lin)) == 2  # an adapter attached later keeps it
    x = torch.randn(3, 96).bfloat16()
    with torch.inference_mode():
        assert torch.equal(linear(lin, x[:2]), kernels().gemv_bf16(x[:2], lin.weight, lin.bias))
        assert torch.equal(linear(lin, x.view(1, 3, 96)[:, :1]), kernels().gemv_bf16(x[:1], lin.weight,
                                                                                    lin.bias).view(1, 1, 80))
        assert torch.equal(linear(lin, x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    # NOTE: with autograd recording, the product that has a backward
    assert torch.equal(linear(lin, x[:1]).detach(), torch.nn.functional.linear(x[:1], lin.weight, lin.bias).detach())
    fp32 = nn.Sequential(nn.Linear(8, 8))
    assert linear_module.use_gemv(fp32) == 0 and linear_module.gemv_rows(fp32[0]) == 0
