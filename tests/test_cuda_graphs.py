"""Decode steps through CUDA-graph buckets (engine/executor/cuda_graphs.py), run eagerly on the CPU: padding the batch
and every sequence's keys to a bucket, scratch rows for padding, masks and sliding windows give the same tokens
as the ordinary path. Only capture and replay themselves need a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from orthrus_rag import CacheConfig, Engine, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from orthrus_rag.engine.executor.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, _bucket, _width
from orthrus_rag.models.llama import CausalLM, apply_rotary

pytestmark = pytest.mark.slow  # builds engines (make test-fast skips it)

VOCAB = 128


class _Tokenizer:
    eos_token_id = VOCAB - 1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _model(sliding: bool) -> CausalLM:
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=VOCAB - 1)
    cfg = MistralConfig(**common, sliding_window=8) if sliding else LlamaConfig(**common)
    torch.manual_seed(3)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.fuse_projections()
    return model


def _engine(model: CausalLM) -> Engine:
    cfg = EngineConfig(model=ModelConfig(name="tiny", device="cpu"),
                       cache=CacheConfig(block_size=4, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64, max_chunk_tokens=16, max_num_seqs=32,
                                                 cost_budget=False))
    return Engine(cfg, model, _Tokenizer())


@pytest.mark.parametrize("sliding", [False, True])
def test_bucketed_decode_gives_the_same_tokens(sliding):
    model = _model(sliding)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 9, 17, 30, 41)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in _engine(model).generate(prompts, params)]
    eng = _engine(model)
    r = eng.runner
    graphs = DecodeGraphs(model, r.kv_caches, r.windows, r.num_slots, 8, eng.max_seq_len, r.device, capture=False)
    r.decode_graphs = graphs
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert graphs.num_steps >= 10, "decode steps did not go through the buckets"
    assert {b for b, _ in graphs.graphs} <= set(BATCH_BUCKETS) and len(graphs.graphs) >= 2
    assert got == want
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_buckets():
    assert [_bucket(n) for n in (1, 3, 17, 64, 65)] == [1, 4, 24, 64, 96]
    assert [_width(n) for n in (1, 64, 65, 300)] == [64, 64, 128, 512]


def test_compiled_elementwise_kernels_give_the_same_tokens():
    """The fused kernels the engine uses on CUDA (torch.compile; C++ here) change no token."""
    model = _model(sliding=False)
    prompts = [[5, 9, 33, 2], list(range(40, 70))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in _engine(model).generate(prompts, params)]
    model.compile_elementwise()
    assert model.model.layers[0].self_attn.rotary is not apply_rotary  # the compiled kernel is in use
    got = [o.token_ids for o in _engine(model).generate(prompts, params)]
    assert got == want
