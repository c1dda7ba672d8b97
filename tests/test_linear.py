"""oneDNN-packed Linear layers compute what the dense ones do, leave the model's Parameters as they were, and
the engine gives the same results with and without them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orthrus_rag.layers.linear import PackedLinear, choose_kernel, linear, onednn_available, pack_linears
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


def test_lora_wrapping_keeps_the_packed_copy():
    lin = nn.Linear(12, 6)
    seq = nn.Sequential(lin)
    pack_linears(seq)
    wrapped = LoRALinear(seq[0])
    assert wrapped._onednn is seq[0]._onednn
    x = torch.randn(5, 12)
    torch.testing.assert_close(wrapped(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=1e-5)


def test_choose_kernel_times_both_and_names_one():
    assert choose_kernel([(16, 24), (24, 16)], rows=(1, 4)) in ("dense", "onednn")


@pytest.mark.slow
def test_engine_results_equal_with_and_without_onednn():
    from orthrus_rag import Engine

    dense = Engine.from_pretrained(SMOL, linear_kernel="dense", **engine_overrides())
    packed = Engine.from_pretrained(SMOL, linear_kernel="onednn", **engine_overrides())
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
