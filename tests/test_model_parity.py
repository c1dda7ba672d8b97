"""Our decoder, run through the real engine (chunked prefill, paged KV cache, decode steps), against
transformers' own forward on tiny random-initialised Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 configs.

Logits of every position come out of the engine as an embedding request with `pooling="all"` (the final
normed hidden states) passed through `model.compute_logits`; greedy generation is compared token for token
with `generate(do_sample=False)` under vLLM's `check_logprobs_close` rule (DESIGN.md, "Testing notes").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, PretrainedConfig,
                          Qwen2Config, Qwen3Config)

from orthrus_rag import CacheConfig, Engine, EngineConfig, ModelConfig, PoolingParams, SamplingParams, SchedulerConfig
from orthrus_rag.models.loader import load_decoder

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

ATOL = 1e-4  # max abs logit difference, fp32
NEAR_TIE = 1e-4  # top-2 logit gap under which two correct fp32 implementations may pick different tokens
VOCAB = 256
EOS = VOCAB - 1
SEQ_LEN = 40
ALL = PoolingParams(pooling="all", normalize=False)

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5,
               # larger than the default 0.02 so attention is far from uniform and logits far from tied
               initializer_range=0.15, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# Gemma 3: sliding and global layers alternating (window 8 < SEQ_LEN), each kind with its own rotary base, the
# global kind also linearly scaled; a query scale that is not head_dim**-0.5; soft-capped logits
_GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=3.0,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})


def _config(name: str) -> PretrainedConfig:
    if name == "qwen3_qk_norm":  # head_dim 24 is not hidden / heads (16), as in the real Qwen3 sizes
        return Qwen3Config(**_COMMON, head_dim=24, tie_word_embeddings=False)
    if name == "gemma3_alternating":
        return Gemma3TextConfig(**_COMMON, **_GEMMA3)
    if name == "mistral_sliding":
        return MistralConfig(**_COMMON, sliding_window=8)
    if name == "qwen2_bias":
        return Qwen2Config(**_COMMON, tie_word_embeddings=False)
    if name in ("llama3_rope", "llama3_rope_legacy_json"):
        return LlamaConfig(**_COMMON, rope_parameters=dict(_LLAMA3_ROPE))
    if name == "llama_tied":
        return LlamaConfig(**_COMMON, tie_word_embeddings=True)
    raise KeyError(name)


MODELS = ["mistral_sliding", "qwen2_bias", "llama3_rope", "llama3_rope_legacy_json", "llama_tied", "qwen3_qk_norm",
          "gemma3_alternating"]


class _StubTokenizer:
    """The engine needs only `eos_token_id` and `decode` when every input is a token-id list."""

    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _build(name: str, path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(sum(map(ord, name)))
    hf = AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias"):  # qkv biases: the default init zeroes them
                p.copy_(torch.randn_like(p) * 0.3)
            elif "norm" in pname:  # RMSNorm weights: the default init is all ones
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(str(path))
    if name == "llama3_rope_legacy_json":  # how older hub checkpoints (e.g. Llama-3.x) spell it
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        (path / "config.json").write_text(json.dumps(cfg))
    return hf, load_decoder(path, torch.float32, "cpu")


@pytest.fixture(scope="module", params=MODELS)
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    hf, ours = _build(request.param, tmp_path_factory.mktemp(request.param))
    return dict(name=request.param, hf=hf, ours=ours)


def _engine(model: torch.nn.Module, chunk: int, budget: int | None = None) -> Engine:
    cfg = EngineConfig(model=ModelConfig(name="tiny", dtype="float32", device="cpu"),
                       cache=CacheConfig(block_size=16, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget or max(chunk, 16),
                                                 max_chunk_tokens=chunk))
    return Engine(cfg, model, _StubTokenizer())


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, EOS, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def _engine_logits(engine: Engine, out) -> torch.Tensor:
    return engine.runner.model.compute_logits(out.embedding)


def _assert_all_blocks_free(engine: Engine) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- sanity: the features under test change the reference output ----------------------------------------
def test_feature_matters(models: dict) -> None:
    """Each config's special feature must change HF's logits, or the parity test would not cover it."""
    name, hf = models["name"], models["hf"]
    ids = _ids(SEQ_LEN, 0)
    ref = _hf_logits(hf, ids)
    if name == "mistral_sliding":
        assert len(ids) > hf.config.sliding_window
        hf.config.sliding_window = None
        try:
            plain = _hf_logits(hf, ids)
        finally:
            hf.config.sliding_window = 8
        assert torch.allclose(ref[:8], plain[:8], atol=ATOL)  # inside the window: identical
        assert (ref[8:] - plain[8:]).abs().max() > 100 * ATOL
    elif name.startswith("llama3_rope"):
        rope = models["ours"].model.rotary_emb
        head_dim = models["ours"].model.layers[0].self_attn.head_dim
        default = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        assert not torch.allclose(rope.inv_freq, default)
        torch.testing.assert_close(rope.inv_freq, hf.model.rotary_emb.inv_freq, atol=0, rtol=1e-6)
    elif name == "qwen2_bias":
        assert models["ours"].model.layers[0].self_attn.q_proj.bias.abs().min() > 0
    elif name == "llama_tied":
        assert models["ours"].lm_head.weight is models["ours"].model.embed_tokens.weight
    elif name == "qwen3_qk_norm":
        _assert_qk_norm_matters(models["ours"], ids, ref)
    elif name == "gemma3_alternating":
        _assert_qk_norm_matters(models["ours"], ids, ref)
        _assert_gemma3_features_matter(models, ids, ref)


def _assert_qk_norm_matters(ours: torch.nn.Module, ids: list[int], ref: torch.Tensor) -> None:
    """Without the per-head q/k norms our logits would be far from HF's (the parity tests below cover them)."""
    attns = ours.attention_layers
    saved = [(a.q_norm, a.k_norm) for a in attns]
    try:
        for a in attns:
            a.q_norm = a.k_norm = None
        (out,) = _engine(ours, SEQ_LEN).embed([ids], ALL)
        assert (_engine_logits(_engine(ours, SEQ_LEN), out) - ref).abs().max() > 100 * ATOL
    finally:
        for a, (qn, kn) in zip(attns, saved):
            a.q_norm, a.k_norm = qn, kn


def _assert_gemma3_features_matter(models: dict, ids: list[int], ref: torch.Tensor) -> None:
    hf, ours = models["hf"], models["ours"]
    assert {layer.self_attn.window for layer in ours.model.layers} == {8, None}  # alternating kinds
    hf.config.sliding_window = SEQ_LEN
    try:
        plain = _hf_logits(hf, ids)
    finally:
        hf.config.sliding_window = 8
    assert torch.allclose(ref[:8], plain[:8], atol=ATOL) and (ref[8:] - plain[8:]).abs().max() > 100 * ATOL
    local, glob = ours.model.rotary_embs["sliding_attention"], ours.model.rotary_embs["full_attention"]
    assert not torch.allclose(local.inv_freq, glob.inv_freq)  # own bases (and scaling) per kind
    for kind, rope in ours.model.rotary_embs.items():
        torch.testing.assert_close(rope.inv_freq, getattr(hf.model.rotary_emb, f"{kind}_inv_freq"), atol=0,
                                   rtol=1e-6)
    cap = hf.config.final_logit_softcapping
    assert ref.abs().max() < cap  # soft-capped ...
    hf.config.final_logit_softcapping = None
    try:
        assert _hf_logits(hf, ids).abs().max() > cap  # ... and the cap binds
    finally:
        hf.config.final_logit_softcapping = cap


# ---- logits at every position, chunked through the paged KV cache ---------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 16, SEQ_LEN])
def test_logits_chunked(models: dict, chunk: int) -> None:
    ids = _ids(SEQ_LEN, 0)
    ref = _hf_logits(models["hf"], ids)
    engine = _engine(models["ours"], chunk)
    (out,) = engine.embed([ids], ALL)
    assert engine.num_steps == -(-SEQ_LEN // chunk)
    got = _engine_logits(engine, out)
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff < ATOL, f"{models['name']} chunk={chunk}: max |logit diff| {diff:.2e}"
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("chunk,budget", [(7, 16), (16, 40), (5, 64)])
def test_logits_several_sequences(models: dict, chunk: int, budget: int) -> None:
    """Sequences of different lengths in one run: their chunks share steps, each equals HF run alone."""
    lengths = [40, 3, 23, 1, 17, 33]
    seqs = [_ids(n, 10 + i) for i, n in enumerate(lengths)]
    engine = _engine(models["ours"], chunk, budget)
    outs = engine.embed(seqs, ALL)
    assert engine.num_steps < sum(-(-n // chunk) for n in lengths)  # chunks of several sequences shared steps
    for ids, out in zip(seqs, outs):
        diff = (_engine_logits(engine, out) - _hf_logits(models["hf"], ids)).abs().max().item()
        assert diff < ATOL, f"{models['name']} len={len(ids)}: max |logit diff| {diff:.2e}"
    _assert_all_blocks_free(engine)


# ---- greedy generation ------------------------------------------------------------------------------------
def _check_greedy_close(ours: list[int], theirs: list[int], hf_scores: list[torch.Tensor], engine: Engine,
                        prompt: list[int]) -> None:
    """vLLM's check_logprobs_close for greedy: equal up to the first divergence; there, each side's token is
    in the other's top-2 with a near-equal logit. Then stop comparing."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        (our_out,) = engine.embed([prompt + ours[:i]], ALL)
        for logits, other in ((hf_scores[i], a), (_engine_logits(engine, our_out)[-1], b)):
            top2 = logits.topk(2)
            assert other in top2.indices.tolist(), f"step {i}: token {other} not in top-2 {top2}"
            assert (top2.values[0] - logits[other]).abs() < NEAR_TIE, f"step {i}: divergence is not a near-tie"
        return
    assert len(ours) == len(theirs), f"lengths differ: {len(ours)} vs {len(theirs)}"


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    res = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, eos_token_id=EOS,
                      pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return res.sequences[0, len(prompt):].tolist(), [x[0].float() for x in res.logits]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_greedy_generation(models: dict, chunk: int) -> None:
    prompts = [_ids(n, 20 + n) for n in (5, 19, 30)]
    engine = _engine(models["ours"], chunk, budget=max(chunk, 24))
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    for prompt, out in zip(prompts, outs):
        theirs, scores = _hf_greedy(models["hf"], prompt, 20)
        _check_greedy_close(out.token_ids, theirs, scores, engine, prompt)
    _assert_all_blocks_free(engine)


# ---- embedding and generation mixed in the same steps -----------------------------------------------------
def test_mixed_generate_and_embed(models: dict) -> None:
    prompt, text = _ids(13, 30), _ids(SEQ_LEN, 31)
    params = SamplingParams(max_tokens=24, temperature=0)
    solo_gen = _engine(models["ours"], 64).generate([prompt], params)[0].token_ids
    engine = _engine(models["ours"], 7, budget=10)
    (gen,), (emb,) = engine.run(prompts=[prompt], sampling_params=params, texts=[text], pooling_params=ALL)
    assert all(s.ran_as_scheduled for s in engine.step_stats)
    mixed = [s for s in engine.step_stats if s.is_mixed]
    assert any(s.num_decode_tokens and s.num_embed_tokens for s in mixed), "no step decoded while embedding"
    assert any(s.num_prefill_tokens and s.num_embed_tokens for s in mixed), "no step prefilled while embedding"
    assert gen.token_ids == solo_gen
    theirs, scores = _hf_greedy(models["hf"], prompt, 24)
    _check_greedy_close(gen.token_ids, theirs, scores, engine, prompt)
    diff = (_engine_logits(engine, emb) - _hf_logits(models["hf"], text)).abs().max().item()
    assert diff < ATOL, f"{models['name']} mixed embedding: max |logit diff| {diff:.2e}"
    _assert_all_blocks_free(engine)
