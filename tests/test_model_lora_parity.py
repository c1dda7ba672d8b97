"""LoRA on the embedding rows only, per decoder family: through the real engine, an adapter's embedding rows
equal PEFT's merged model at every position (logits within the parity tolerance), while generation rows in the
same steps stay exactly the base model's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from orthrus_rag import PoolingParams, SamplingParams  # noqa: E402
from orthrus_rag.layers.lora import attach_adapters, load_peft_adapter  # noqa: E402
from tests.test_model_parity import (ATOL, SEQ_LEN, _assert_all_blocks_free, _build,  # noqa: E402
                                     _check_greedy_close, _engine, _engine_logits, _hf_greedy, _hf_logits, _ids)

pytestmark = pytest.mark.slow  # builds engines (make test-fast skips it)

FAMILIES = ["llama_tied", "qwen3_qk_norm", "gemma3_alternating"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp: Path = tmp_path_factory.mktemp(request.param)
    hf, ours = _build(request.param, tmp / "base")
    torch.manual_seed(7)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                               init_lora_weights=False))
    peft_model.save_pretrained(str(tmp / "adapter"))
    merged = peft_model.merge_and_unload().eval()
    slots = attach_adapters(ours, [load_peft_adapter(tmp / "adapter", name="emb")])
    return dict(name=request.param, hf=hf, merged=merged, ours=ours, slots=slots)


def _adapter_engine(family: dict, chunk: int, budget: int | None = None):
    engine = _engine(family["ours"], chunk, budget)
    engine.adapter_slots = dict(family["slots"])  # what Engine.from_config passes from load_models
    return engine


@pytest.mark.parametrize("chunk", [1, 7, SEQ_LEN])
def test_adapter_rows_equal_peft_merged(family: dict, chunk: int) -> None:
    ids = _ids(SEQ_LEN, 0)
    want = _hf_logits(family["merged"], ids)
    assert (want - _hf_logits(family["hf"], ids)).abs().max() > 100 * ATOL  # the adapter does matter
    engine = _adapter_engine(family, chunk)
    (out,) = engine.embed([ids], PoolingParams(pooling="all", normalize=False, adapter="emb"))
    diff = (_engine_logits(engine, out) - want).abs().max().item()
    assert diff < ATOL, f"{family['name']} chunk={chunk}: max |logit diff| {diff:.2e}"
    (bare,) = engine.embed([ids], PoolingParams(pooling="all", normalize=False, adapter=""))
    assert (_engine_logits(engine, bare) - _hf_logits(family["hf"], ids)).abs().max() < ATOL
    _assert_all_blocks_free(engine)


def test_mixed_steps_adapter_only_on_embedding_rows(family: dict) -> None:
    """Decodes and prefill chunks share steps with adapter embedding rows and stay the base model's tokens."""
    prompt, text = _ids(13, 30), _ids(SEQ_LEN, 31)
    params = SamplingParams(max_tokens=16, temperature=0)
    solo = _adapter_engine(family, 64).generate([prompt], params)[0].token_ids
    engine = _adapter_engine(family, 7, budget=10)
    (gen,), (emb,) = engine.run(prompts=[prompt], sampling_params=params, texts=[text],
                                pooling_params=PoolingParams(pooling="all", normalize=False))  # default adapter
    assert any(s.num_decode_tokens and s.num_embed_tokens for s in engine.step_stats)
    assert any(s.num_prefill_tokens and s.num_embed_tokens for s in engine.step_stats)
    assert gen.token_ids == solo
    theirs, scores = _hf_greedy(family["hf"], prompt, 16)  # the base model's, not the merged one's
    # NOTE: an engine without adapters, so a near-tie check at a divergence reads the base model's logits
    _check_greedy_close(gen.token_ids, theirs, scores, _engine(family["ours"], 64), prompt)
    assert _hf_greedy(family["merged"], prompt, 16)[0] != theirs  # else this would not tell the two apart
    diff = (_engine_logits(engine, emb) - _hf_logits(family["merged"], text)).abs().max().item()
    assert diff < ATOL, f"{family['name']} mixed adapter embedding: max |logit diff| {diff:.2e}"
    _assert_all_blocks_free(engine)
