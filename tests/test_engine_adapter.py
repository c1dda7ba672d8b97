"""The embedding model = the generation model + a LoRA adapter, applied to embedding rows only."""

from __future__ import annotations

import copy

import pytest
import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams
from tests.conftest import SMOL, engine_overrides

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

TEXTS = ["Who directed the film Blue Lagoon?", " ".join(["The film was shot on location in Fiji."] * 12),
         "Paris"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, hf_smol):
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(hf_smol), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], init_lora_weights=False))
    with torch.no_grad():  # keep the adapter a modest perturbation of the backbone
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(path))
    merged = peft_model.merge_and_unload().eval()
    return path, merged


@pytest.fixture(scope="module")
def adapter_engine(adapter):
    return Engine.from_pretrained(SMOL, embedding_adapters=str(adapter[0]), **engine_overrides())


def test_embeddings_equal_peft_merged_model(adapter, adapter_engine, smol_tokenizer):
    _, merged = adapter
    params = PoolingParams(pooling="mean", normalize=True)
    outs = adapter_engine.embed(TEXTS, params)
    for text, out in zip(TEXTS, outs):
        ids = smol_tokenizer(text)["input_ids"]
        with torch.inference_mode():
            want = merged.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
        want = torch.nn.functional.normalize(want, dim=-1)
        assert torch.nn.functional.cosine_similarity(out.embedding, want, dim=0) >= 0.99999


def test_adapter_changes_embeddings_but_not_generation(adapter_engine, engine):
    params = PoolingParams(pooling="mean")
    with_adapter = adapter_engine.embed(TEXTS[:1], params)[0].embedding
    base = engine.embed(TEXTS[:1], params)[0].embedding
    assert torch.nn.functional.cosine_similarity(with_adapter, base, dim=0) < 0.999

    prompts = ["The capital of Italy is", "Name a colour:"]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    base_gen = [o.token_ids for o in engine.generate(prompts, sp)]
    start = adapter_engine.num_steps
    gens, embs = adapter_engine.run(prompts=prompts, sampling_params=sp, texts=TEXTS * 3, pooling_params=params)
    assert any(s.is_mixed for s in adapter_engine.step_stats if s.step >= start)
    assert [g.token_ids for g in gens] == base_gen
    assert torch.allclose(embs[0].embedding, with_adapter, atol=1e-5)


def test_unknown_adapter_is_rejected(adapter_engine):
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        adapter_engine.add_embed("text", PoolingParams(adapter="nope"))
    assert not adapter_engine.has_unfinished()
