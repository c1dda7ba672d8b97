"""Per-row multi-adapter LoRA against PEFT's own merged model, on a tiny random Llama."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from orthrus_rag.layers.context import ForwardContext, forward_context  # noqa: E402
from orthrus_rag.layers.lora import LoRALinear, attach_adapters, load_peft_adapter  # noqa: E402

SEQ = 7


def _base_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    return LlamaForCausalLM(cfg).eval()


def _make_adapter(base: LlamaForCausalLM, out: Path, seed: int, safe: bool = True, **lora_kwargs) -> torch.nn.Module:
    """Save a PEFT adapter with non-zero B for a copy of ``base``; return PEFT's merged model."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(str(out), safe_serialization=safe)
    return peft_model.merge_and_unload().eval()


def _hidden(model: torch.nn.Module, ids: torch.Tensor, lora_rows: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    with torch.no_grad(), forward_context(ForwardContext(lora_rows=lora_rows)):
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora")
    base = _base_model()
    merged1 = _make_adapter(base, tmp / "a1", seed=1, r=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj", "gate_proj"])
    # a second adapter with other targets, rank and rsLoRA scaling, saved as .bin
    merged2 = _make_adapter(base, tmp / "a2", seed=2, safe=False, r=8, lora_alpha=16, use_rslora=True,
                            target_modules=["k_proj", "o_proj", "down_proj", "up_proj"])
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return dict(tmp=tmp, base=base, merged1=merged1, merged2=merged2, ids=ids)


def test_load_peft_adapter(setup: dict) -> None:
    a1 = load_peft_adapter(setup["tmp"] / "a1")
    assert a1.name == "a1" and a1.rank == 4 and a1.scaling == pytest.approx(2.0)
    assert len(a1.weights) == 2 * 3  # 2 layers x 3 targets
    a, b = a1.weights["model.layers.0.self_attn.q_proj"]
    assert a.shape == (4, 64) and b.shape == (64, 4) and b.abs().sum() > 0
    a2 = load_peft_adapter(setup["tmp"] / "a2", name="other")  # .bin
    assert a2.name == "other" and a2.scaling == pytest.approx(16 / 8 ** 0.5)


def test_all_rows_equal_peft_merged(setup: dict) -> None:
    model = copy.deepcopy(setup["base"])
    assert attach_adapters(model, [load_peft_adapter(setup["tmp"] / "a1")]) == {"a1": 1}
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoRALinear)
    assert not isinstance(model.model.layers[0].self_attn.k_proj, LoRALinear)
    ids = setup["ids"]
    got = _hidden(model, ids, [(1, torch.arange(ids.numel()))])
    want = _hidden(setup["merged1"], ids, [])
    assert not torch.allclose(want, _hidden(setup["base"], ids, []), atol=1e-3)  # the adapter does matter
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # attaching must not change the state_dict's keys (the weight loader still finds "...q_proj.weight")
    assert model.state_dict().keys() == setup["base"].state_dict().keys()


def test_no_rows_equal_base_exactly(setup: dict) -> None:
    model = copy.deepcopy(setup["base"])
    attach_adapters(model, [load_peft_adapter(setup["tmp"] / "a1")])
    ids = setup["ids"]
    want = _hidden(setup["base"], ids, [])
    assert torch.equal(_hidden(model, ids, []), want)
    assert torch.equal(_hidden(model, ids, [(1, torch.empty(0, dtype=torch.long))]), want)


def test_two_adapters_on_disjoint_rows(setup: dict) -> None:
    model = copy.deepcopy(setup["base"])
    # two calls: slots keep counting
    assert attach_adapters(model, [load_peft_adapter(setup["tmp"] / "a1")]) == {"a1": 1}
    assert attach_adapters(model, [load_peft_adapter(setup["tmp"] / "a2")]) == {"a1": 1, "a2": 2}
    ids = setup["ids"]
    # sequence 0 -> adapter 1, sequence 1 -> adapter 2 (rows index the flattened [B*S] batch)
    got = _hidden(model, ids, [(1, torch.arange(0, SEQ)), (2, torch.arange(SEQ, 2 * SEQ))])
    alone1 = _hidden(model, ids[:1], [(1, torch.arange(SEQ))])
    alone2 = _hidden(model, ids[1:], [(2, torch.arange(SEQ))])
    torch.testing.assert_close(got[0], alone1[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], alone2[0], atol=1e-5, rtol=1e-5)
    # and each alone equals PEFT's merged model for that adapter
    torch.testing.assert_close(alone2, _hidden(setup["merged2"], ids[1:], []), atol=1e-5, rtol=1e-5)
    # mixed base / adapter rows inside one sequence: only the adapter's rows (and, via attention, later ones) move
    mixed = _hidden(model, ids[:1], [(1, torch.arange(3, SEQ))])
    base = _hidden(setup["base"], ids[:1], [])
    torch.testing.assert_close(mixed[:, :3], base[:, :3], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(mixed[:, 3:], base[:, 3:])


def test_errors(setup: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_peft_adapter(tmp_path / "missing")
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((setup["tmp"] / "a1" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        load_peft_adapter(dora)
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="adapter_model"):
        load_peft_adapter(dora)  # config fine, weights missing

    adapter = load_peft_adapter(setup["tmp"] / "a1")
    adapter.weights["model.layers.9.self_attn.q_proj"] = adapter.weights["model.layers.0.self_attn.q_proj"]
    model = copy.deepcopy(setup["base"])
    with pytest.raises(ValueError, match="not in the model"):
        attach_adapters(model, [adapter])
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing half-attached
