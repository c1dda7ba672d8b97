"""Weight-only int8 / int4 linears (`model.quantization`, layers/quantized.py).

- Each quantizer's dequantized weight is within half a step of the weight, and the kernel's product is the product
  by that dequantized weight.
- An engine on quantized weights generates the greedy tokens, and pools the embeddings, of an engine whose
  checkpoint holds the dequantized weights (LoRA adapters on top too), and its plan names the format.
- Bad values and devices are refused, naming the valid ones."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag.config.build import engine_config
from orthrus_rag.config.engine import ModelConfig
from orthrus_rag.layers.quantized import INT4_GROUP, check_quantization, quantize_int4, quantize_int8
from tests.test_plan import _engine, _outputs, tiny  # noqa: F401  (tiny: the fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_is_within_half_a_step_and_the_kernel_multiplies_by_it(dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * torch.linspace(0.01, 2.0, 96)[:, None]  # rows of very different ranges
    q = quantize_int8(w, dtype)
    step = w.abs().amax(dim=1) / 127
    deq = quantize_int8(w, torch.float32).dequantize()
    assert ((deq - w).abs() <= step[:, None] * 0.5 + 1e-6).all()
    for rows in (1, 5, 33):
        x = torch.randn(rows, 128).to(dtype)
        want = x.float() @ q.dequantize().float().t()
        tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
        assert (q.matmul(x).float() - want).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_is_within_half_a_step_of_each_group_and_the_kernel_multiplies_by_it(dtype):
    torch.manual_seed(1)
    w = torch.randn(64, 4 * INT4_GROUP)
    q = quantize_int4(w, dtype)
    groups = w.view(64, 4, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    deq = quantize_int4(w, torch.float32).dequantize().view(64, 4, INT4_GROUP)
    assert ((deq - groups).abs() <= step[..., None] * 0.5 + 1e-5).all()
    x = torch.randn(3, 4 * INT4_GROUP).to(dtype)
    want = x.float() @ q.dequantize().float().t()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
    assert (q.matmul(x).float() - want).abs().max() <= tol
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(8, 40))


def test_bad_quantization_and_device_are_refused():
    with pytest.raises(ValueError, match="unknown quantization 'int3'; expected one of none, int8, int4"):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        engine_config("smollm2-135m-instruct", quantization="q4")  # the engine's keyword options too
    with pytest.raises(ValueError, match="runs on the CPU"):
        check_quantization("int8", "cuda")


def _dequantized_checkpoint(folder, kind: str, out):
    """`folder`'s model with every decoder linear (the LM head too, untied from the embeddings) replaced by its
    dequantized `kind` weight: what the quantized engine multiplies by."""
    from transformers import LlamaForCausalLM

    from orthrus_rag.layers.quantized import QUANTIZERS

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        head = model.lm_head.weight.detach().clone()
        model.lm_head.weight = torch.nn.Parameter(head)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(QUANTIZERS[kind](module.weight, torch.float32).dequantize())
    model.save_pretrained(str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("adapters", [False, True], ids=["base", "adapters"])
def test_a_quantized_engine_computes_what_its_dequantized_weights_compute(tiny, tmp_path, kind, adapters):  # noqa: F811
    folder, adapter_folders = tiny
    reference = _dequantized_checkpoint(folder, kind, tmp_path / "dequantized")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            (reference / name).write_bytes((folder / name).read_bytes())
    eng = _engine(tiny, quantization=kind, adapters=adapters)
    cell = eng.plan.cell("linears")
    assert cell.body.startswith(f"layers {kind} weight-only") and f"LM head {kind} weight-only" in cell.body, eng.plan
    ref = _engine((reference, adapter_folders), adapters=adapters)
    tokens, vectors = _outputs(eng)
    want_tokens, want_vectors = _outputs(ref)
    assert tokens == want_tokens
    assert torch.allclose(vectors, want_vectors, atol=1e-4, rtol=1e-4)
    # the dense weights are gone: the layers hold their quantized bytes only
    qkv = eng.runner.model.model.layers[0].self_attn.fusions["qkv"].carrier
    assert qkv.weight.numel() == 0 and qkv._quant.kind == kind
