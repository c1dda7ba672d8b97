"""GPU set, the engine against transformers on the same weights: SmolLM2 greedy under the near-tie rule (chunked
prefill after a cached prefix), a sliding-window Mistral's logits, embeddings, and a 4k-token bf16 prompt.

The real SmolLM2 where its converted checkpoint is on the machine ($ORTHRUS_SMOL), else a random model of its
shape (GPU machines have no weights). Run on a GPU machine: see README, "GPU checks". Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig

from orthrus_rag import PoolingParams, SamplingParams
from orthrus_rag.layers.attention import grouped, varlen
from tests.gpu_support import (DEVICE, ON_CUDA, assert_released, engine, gpu, hf_model, ids, save_random_model,
                               smol_checkpoint)
from tests.parity import check_greedy_close, hf_greedy

pytestmark = gpu
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# bf16: a near-tie is a gap under this fraction of the logits' standard deviation (bf16 rounding scales with them)
BF16_TIE_STD = 0.1
HALF = "bfloat16" if ON_CUDA else "float32"  # the dry run on the CPU stays in fp32


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    folder, _ = smol_checkpoint(tmp_path_factory)
    return folder


@pytest.mark.parametrize("dtype", ["float32", HALF])
def test_greedy_equals_transformers_with_chunked_prefill_after_a_cached_prefix(smol, dtype):
    """The first prompt fills the prefix cache; the others reuse its blocks and prefill the rest in chunks of
    32 next to each other's decodes. Each equals transformers' greedy tokens up to a near-tie."""
    eng = engine(smol, dtype=dtype, max_num_batched_tokens=64, max_chunk_tokens=32, enable_prefix_caching=True)
    assert eng.runner.attn_backend is (varlen if dtype == "bfloat16" else grouped)
    prefix = ids(96, 0)
    prompts = [prefix + ids(5, 1), prefix + ids(40, 2), prefix + ids(77, 3), ids(130, 4)]
    outs = eng.generate(prompts[:1], GREEDY) + eng.generate(prompts[1:], GREEDY)
    assert eng.block_manager.num_hit_tokens >= 2 * 96  # two prompts found the prefix's blocks
    hf = hf_model(smol, torch.float32 if dtype == "float32" else torch.bfloat16)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf, prompt, GREEDY.max_tokens)
        check_greedy_close(hf, prompt, list(out.token_ids), ref, tol=1e-3,
                           tol_std=0.0 if dtype == "float32" else BF16_TIE_STD)
    assert_released(eng)


@pytest.mark.parametrize("dtype", ["float32", HALF])
def test_sliding_window_mistral_logits_match_transformers(tmp_path, dtype):
    cfg = MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, sliding_window=16,
                        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = save_random_model(cfg, tmp_path)
    eng = engine(folder, dtype=dtype, max_num_batched_tokens=48, max_chunk_tokens=7)
    seqs = [ids(n, 10 + n, vocab=512) for n in (100, 9, 40)]  # past the window, chunks crossing it
    outs = eng.embed(seqs, PoolingParams(pooling="all", normalize=False))
    hf = hf_model(folder, torch.float32)  # the reference in fp32, whatever the engine runs in
    for seq, out in zip(seqs, outs):
        with torch.inference_mode():
            want = hf(torch.tensor([seq], device=DEVICE)).logits[0].float()
            got = eng.compute_logits(out.embedding.to(DEVICE, eng.runner.kv_caches[0][0].dtype))
        err = float((got - want).abs().max() / want.abs().max())
        assert err < (1e-4 if dtype == "float32" else 3e-2), f"len {len(seq)}: max |logit diff| {err:.2e} of max"
    assert_released(eng)


@pytest.mark.parametrize("dtype,threshold", [("float32", 0.99999), (HALF, 0.999)])
def test_embeddings_match_transformers(smol, dtype, threshold):
    eng = engine(smol, dtype=dtype, max_num_batched_tokens=256, max_chunk_tokens=128)
    texts = [ids(n, 100 + n) for n in (7, 64, 129, 300, 700)]
    outs = eng.embed(texts, PoolingParams(pooling="mean", normalize=False))
    hf = hf_model(smol, torch.float32 if dtype == "float32" else torch.bfloat16)
    for text, out in zip(texts, outs):
        with torch.inference_mode():
            want = hf.model(torch.tensor([text], device=DEVICE)).last_hidden_state[0].float().mean(0)
        cos = float(torch.nn.functional.cosine_similarity(out.embedding.to(DEVICE).float(), want, dim=0))
        assert cos >= threshold, f"len {len(text)}: cosine {cos:.6f}"
    assert_released(eng)


def test_a_4k_token_prompt_gives_finite_logits(smol):
    """Prefill logits at every position of a 4,096-token prompt, and every decode step's logits after it."""
    eng = engine(smol, dtype=HALF, max_num_batched_tokens=2048, max_chunk_tokens=1024)
    prompt = ids(4096, 7)
    (hidden,) = eng.embed([prompt], PoolingParams(pooling="all", normalize=False))
    with torch.inference_mode():
        logits = eng.compute_logits(hidden.embedding.to(DEVICE, eng.runner.kv_caches[0][0].dtype))
    assert logits.shape[0] == 4096 and torch.isfinite(logits).all()
    finite: list[bool] = []
    sampler = eng.runner.sampler

    def checked(step_logits, params, generators):  # NOTE: logits are computed eagerly, after any graph replay
        finite.append(bool(torch.isfinite(step_logits).all()))
        return sampler(step_logits, params, generators)

    eng.runner.sampler = checked
    (out,) = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 8 and finite == [True] * 8
    assert_released(eng)
