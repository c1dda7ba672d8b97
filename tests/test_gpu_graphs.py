"""GPU set, the decode fast path and the step loop: CUDA graph capture and replay in every batch bucket (tokens
identical to graphs off, key widths past 64, eviction from the graph cache), compiled elementwise kernels (no
token changed, no recompilation per step), the cost model's step time against CUDA-event timing, and every
block and byte of device memory released at the end.

Token identity is checked in fp32, where graphs and eager decodes run the same grouped attention and differ only
in padding; bf16 graphs are checked by the defaults test (tests/test_gpu_attention.py). Run on a GPU machine: see
README, "GPU checks". Skipped without CUDA."""

from __future__ import annotations

import gc
import statistics

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig

from orthrus_rag import PoolingParams, SamplingParams
from orthrus_rag.engine.executor.cuda_graphs import BATCH_BUCKETS, _width
from orthrus_rag.models.llama import apply_rotary
from tests.gpu_support import (DEVICE, assert_released, cuda_only, engine, gpu, ids, save_random_model,
                               smol_config)

pytestmark = gpu
VOCAB = 256
TOKENS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = (3, 20, 70, 130)  # keys past 64: graph widths 64 .. 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # NOTE: weights of std 0.2 keep logits far from tied, so fp32 rounding of padded GEMMs cannot flip a token
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, initializer_range=0.2,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return save_random_model(cfg, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return save_random_model(smol_config(num_layers=6), tmp_path_factory.mktemp("small"))


def _tiny_engine(folder, graphs: bool):
    return engine(folder, dtype="float32", kernel_overrides={"cuda_graphs": "auto" if graphs else "off"},
                  cost_budget=False, max_num_batched_tokens=8192, max_chunk_tokens=2048, max_num_seqs=512)


def _prompts(n: int, seed: int) -> list[list[int]]:
    return [ids(LENGTHS[i % len(LENGTHS)] if n > 2 else LENGTHS[i * 2], seed + i, VOCAB) for i in range(n)]


def _batch(bucket: int) -> int:
    """A batch that pads to `bucket` (one row short of it where the bucket below is smaller)."""
    below = max((b for b in BATCH_BUCKETS if b < bucket), default=0)
    return bucket - 1 if bucket - 1 > below else bucket


@cuda_only
def test_every_decode_bucket_captures_and_replays_with_the_tokens_of_graphs_off(tiny):
    on, off = _tiny_engine(tiny, True), _tiny_engine(tiny, False)
    graphs = on.runner.decode_graphs
    assert graphs.max_batch == BATCH_BUCKETS[-1]
    widths = set()
    for bucket in BATCH_BUCKETS:
        prompts = _prompts(_batch(bucket), seed=bucket)
        before = graphs.num_steps
        got = [o.token_ids for o in on.generate(prompts, TOKENS)]
        assert got == [o.token_ids for o in off.generate(prompts, TOKENS)], f"bucket {bucket}: tokens differ"
        captured = [key for key, g in graphs.graphs.items() if key[0] == bucket and g.graph is not None]
        assert captured, f"no graph captured for bucket {bucket}"
        assert graphs.num_steps - before >= TOKENS.max_tokens // 2, f"bucket {bucket}: few decodes replayed"
        widths.update(w for _, w in captured)
    assert {64, 256} <= widths and max(widths) == _width(max(LENGTHS) + TOKENS.max_tokens)
    assert_released(on)
    assert_released(off)


@cuda_only
def test_evicted_graphs_are_captured_again_with_the_same_tokens(tiny):
    on, off = _tiny_engine(tiny, True), _tiny_engine(tiny, False)
    graphs = on.runner.decode_graphs
    graphs.max_graphs = 2
    made: list[tuple[int, int]] = []
    new = graphs._new
    graphs._new = lambda batch, width: made.append((batch, width)) or new(batch, width)
    for n in (1, 3, 7, 1, 3):
        prompts = [ids(5, 50 + n + i, VOCAB) for i in range(n)]
        assert [o.token_ids for o in on.generate(prompts, TOKENS)] == [o.token_ids for o in off.generate(prompts,
                                                                                                       TOKENS)]
        assert len(graphs.graphs) <= 2
    assert made.count((1, 64)) == 2, f"bucket 1 was not evicted and captured again: {made}"
    assert all(g.graph is not None for g in graphs.graphs.values())
    assert_released(on)


def test_compiled_kernels_change_no_token_and_compile_once(small):
    prompts = [ids(n, 200 + n) for n in (1, 9, 40, 100)]
    plain = engine(small, dtype="float32", kernel_overrides={"layers": "torch"})
    want = [o.token_ids for o in plain.generate(prompts, TOKENS)]
    del plain
    eng = engine(small, dtype="float32", kernel_overrides={"layers": "torch"})
    eng.runner.model.compile_elementwise()  # NOTE: explicitly, so a dry run on the CPU compiles too
    assert eng.runner.model.model.layers[0].self_attn.rotary is not apply_rotary
    assert [o.token_ids for o in eng.generate(prompts, TOKENS)] == want
    compiled = counters["stats"]["unique_graphs"]
    more = [ids(n, 300 + n) for n in (2, 17, 33, 64, 90)]  # other step sizes, decodes of other batch sizes
    eng.generate(more, TOKENS)
    assert counters["stats"]["unique_graphs"] == compiled, "the compiled kernels recompiled for new step shapes"
    assert_released(eng)


@cuda_only
def test_the_cost_models_step_time_is_within_10_percent_of_cuda_event_timing(small):
    eng = engine(small)  # the CUDA defaults: bf16, graphs, the cost budget
    cost = eng.scheduler.cost_model
    assert cost is not None and cost.num_observed > 0  # calibrated at start-up
    execute = eng.runner.execute
    predicted: list[float] = []
    events: list[float] = []
    reported: list[float] = []

    def timed(sched):
        predicted.append(cost.predict(sched.shape()))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = execute(sched)
        end.record()
        end.synchronize()
        events.append(begin.elapsed_time(end) / 1e3)
        reported.append(out.seconds)
        return out

    eng.runner.execute = timed
    eng.generate([ids(64, 400 + i) for i in range(48)], SamplingParams(max_tokens=64, ignore_eos=True))
    assert len(events) > 40
    # the step time the model learns, every step: the device's time (within 10% of CUDA events), not launch time
    off = [abs(r - e) / e for r, e in zip(reported, events)]
    assert max(off) <= 0.10, f"a step's reported time is {max(off):.0%} off its CUDA-event time"
    # and what it predicts follows it (a fit of one linear model over prefill and decode steps: not exact)
    errors = [abs(p - e) / e for p, e in zip(predicted[-30:], events[-30:])]
    assert statistics.median(errors) < 0.25, f"median prediction error {statistics.median(errors):.0%}"
    assert_released(eng)


def _allocated() -> int:
    """Device memory held by live tensors. cuBLAS keeps a workspace per stream for the life of the process
    (torch's own leak check, CudaMemoryLeakCheck, clears them before counting too): not the engine's memory."""
    gc.collect()
    if DEVICE.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


def test_every_block_and_all_device_memory_are_released_at_the_end(small):
    before = _allocated()
    eng = engine(small)
    outs = eng.run(prompts=[ids(n, 500 + n) for n in (5, 60, 200)], sampling_params=TOKENS,
                   texts=[ids(n, 600 + n) for n in (8, 300)], pooling_params=PoolingParams())
    assert len(outs[0]) == 3 and len(outs[1]) == 2
    assert_released(eng)
    del eng, outs
    left = _allocated() - before
    assert left <= 1 << 20, f"{left / 2**20:.1f} MiB of device memory still allocated"
