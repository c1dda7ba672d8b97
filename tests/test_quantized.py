"""Weight-only int8 / int4 linears (`model.quantization`, layers/quantized.py).

- Each quantizer's dequantized weight is within half a step of the weight, and the kernel's product is the product
  by that dequantized weight.
- An engine on quantized weights generates the greedy tokens, and pools the embeddings, of an engine whose
  checkpoint holds the dequantized weights (LoRA adapters on top too), and its plan names the format.
- `auto` takes a GGUF file's own forms (the shipped SmolLM2: Q4_1 layers, exactly; its Q8_0 head as int8), and
  nothing for a checkpoint folder.
- Bad values and devices are refused, naming the valid ones."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag.config.build import engine_config
from orthrus_rag.config.engine import ModelConfig
from orthrus_rag.layers.quantized import (INT4_GROUP, check_quantization, dequantized, quantize_int4,
                                          quantize_int8)
from tests.conftest import SMOL
from tests.test_plan import _engine, _outputs, tiny  # noqa: F401  (tiny: the fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_is_within_half_a_step_and_the_kernel_multiplies_by_it(dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * torch.linspace(0.01, 2.0, 96)[:, None]  # rows of very different ranges
    q = quantize_int8(w, dtype)
    step = w.abs().amax(dim=1) / 127
    deq = dequantized(w, "int8")
    assert ((deq - w).abs() <= step[:, None] * 0.5 + 1e-6).all()
    for rows in (1, 5, 33):
        x = torch.randn(rows, 128).to(dtype)
        want = x.float() @ deq.t()
        tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
        assert (q.matmul(x).float() - want).abs().max() <= tol


def test_int8_takes_torchs_kernel_for_few_rows_and_the_widened_weight_for_many():
    """Below INT8_DENSE_FROM rows torch's int8 kernel; from it the codes widened to bf16, the dense product and the
    row scales after (torch's kernel takes time in proportion to the rows); the two agree to bf16's rounding."""
    from orthrus_rag.layers.quantized import INT8_DENSE_FROM

    torch.manual_seed(1)
    q = quantize_int8(torch.randn(80, 64), torch.bfloat16)
    x = torch.randn(INT8_DENSE_FROM, 64).bfloat16()
    few, many = q.matmul(x[:-1]), q.matmul(x)
    assert torch.equal(few, torch.ops.aten._weight_int8pack_mm(x[:-1], q.weight, q.scales))
    assert torch.equal(many, torch.nn.functional.linear(x, q.weight.bfloat16()) * q.scales)
    torch.testing.assert_close(many[:-1].float(), few.float(), rtol=2 ** -6, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_is_within_half_a_step_of_each_group_and_the_kernel_multiplies_by_it(dtype):
    torch.manual_seed(1)
    w = torch.randn(64, 4 * INT4_GROUP)
    q = quantize_int4(w, dtype)
    groups = w.view(64, 4, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    deq = dequantized(w, "int4")
    assert ((deq.view(64, 4, INT4_GROUP) - groups).abs() <= step[..., None] * 0.5 + 1e-5).all()
    x = torch.randn(3, 4 * INT4_GROUP).to(dtype)
    want = x.float() @ deq.t()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
    assert (q.matmul(x).float() - want).abs().max() <= tol
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(8, 40))


def test_bad_quantization_and_device_are_refused():
    with pytest.raises(ValueError, match="unknown quantization .int3.; expected one of none, int8, int4, auto"):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        engine_config("smollm2-135m-instruct", quantization="q4")  # the engine's keyword options too
    with pytest.raises(ValueError, match="runs on the CPU"):
        check_quantization("int8", "cuda")


def _dequantized_checkpoint(folder, kind: str, out):
    """`folder`'s model with every decoder linear (the LM head too, untied from the embeddings) replaced by its
    dequantized `kind` weight: what the quantized engine multiplies by."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        head = model.lm_head.weight.detach().clone()
        model.lm_head.weight = torch.nn.Parameter(head)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantized(module.weight, kind))
    model.save_pretrained(str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind,adapters", [("int8", False), ("int4", False), ("int4", True)],
                         ids=["int8", "int4", "int4-adapters"])  # NOTE: adapters take one path whatever the format
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


def test_auto_reads_the_shipped_gguf_as_int4_layers_and_an_int8_head():
    from orthrus_rag.models.registry import gguf_quantization, gguf_source

    source = gguf_source(SMOL)
    assert source is not None and source.suffix == ".gguf"
    assert gguf_quantization(source) == ("int4", "int8")  # Q4_1 blocks; the tied embeddings in Q8_0
    assert gguf_source("all-minilm-l6-v2") is None and gguf_source("/no/such/model.gguf") is None


@pytest.mark.slow
def test_int4_of_a_q4_1_files_layers_is_the_files_own_weights(smol_path):
    """Each Q4_1 block's smallest and largest weights are its codes 0 and 15, so requantizing the dequantized
    weights recovers the file's scales, zeros and codes: `auto` multiplies by exactly the file's weights."""
    from safetensors import safe_open

    with safe_open(str(next(smol_path.glob("*.safetensors"))), "pt") as f:
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.17.mlp.down_proj.weight"):
            w = f.get_tensor(key).float()
            assert torch.equal(dequantized(w, "int4"), w), key
            x = torch.randn(3, w.shape[1])  # and the kernel multiplies by them
            torch.testing.assert_close(quantize_int4(w, torch.float32).matmul(x), x @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_an_auto_engine_takes_the_gguf_forms_and_answers_as_the_dense_one(tiny, engine):  # noqa: F811
    from orthrus_rag import Engine, SamplingParams
    from tests.conftest import engine_overrides

    auto = Engine.from_pretrained(SMOL, **engine_overrides(quantization="auto"))
    body = auto.plan.cell("linears").body
    assert body.startswith("layers int4 weight-only (groups of 32), LM head int8 weight-only"), auto.plan
    assert "int4 weights" in auto.plan.cell("layers").body  # the C++ layer loop takes them
    prompts = ["The capital of France is", "Water is made of hydrogen and"]
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in auto.generate(prompts, greedy)] == \
        [o.token_ids for o in engine.generate(prompts, greedy)]
    # a checkpoint folder has no GGUF form: auto quantizes nothing
    plain = _engine(tiny, quantization="auto")
    assert "weight-only" not in plain.plan.cell("linears").body
