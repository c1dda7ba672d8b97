"""The C++ layer loop's column-split form (layers/cpu_layer_split.py): the whole-weight loop's result to the dtype's
rounding, on the steps it is for, and never on the others."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag.layers.cpu_layer_split import SplitParts, even_parts
from tests.test_cpu_layer_loop import (NO_PACKED_BF16, PACKED_BF16, STEPS, Spy, _model, _steps,
                                      assert_same_greedy_tokens)

pytestmark = [pytest.mark.slow, pytest.mark.isa]


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_even_parts_tile_the_columns():
    assert even_parts(576, 2, 32) == [288, 288]
    assert even_parts(1536, 3, 32) == [512, 512, 512]
    assert even_parts(100, 3, 32) == [32, 32, 36]  # the remainder to the last
    assert even_parts(40, 2, 32) == [20, 20]  # too narrow to align: single columns
    assert sum(even_parts(960, 5, 64)) == 960


def _split_model(kind: str, dtype: torch.dtype, lora: str | None = None):
    model = _model(kind, dtype, True, lora)
    assert model.use_cpu_layer_loop()
    loop = model.model.layer_loop
    loop.split_from = 1  # NOTE: the tests' steps are a few rows; the engine's threshold is for speed only
    return model, loop


@pytest.mark.parametrize("kind", ["llama", "qwen2", "biases", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_loop_equals_the_whole_weight_loop(kind, dtype):
    """Every step of the loop's plans (decodes, chunks, both, past a sliding window, the identity plan) in the split
    form against the whole-weight loop: hidden states and the caches it wrote."""
    if dtype is torch.bfloat16 and not PACKED_BF16:
        pytest.skip(NO_PACKED_BF16)
    from orthrus_rag.layers.attention import cpu_prefill

    prefill_kernel = cpu_prefill.prefill_kernel_runs(dtype, 32)
    model, loop = _split_model(kind, dtype)
    loop.split = False
    want, want_caches = _steps(model, STEPS, prefill_kernel)
    loop.split = True
    spy = model.model.layer_loop = Spy(loop)
    got, got_caches = _steps(model, STEPS, prefill_kernel)
    assert loop.split_steps == spy.taken == (5 if prefill_kernel else 3)
    # NOTE: oneDNN may block a part's reduction otherwise than the whole weight's (a last-bit difference)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        torch.testing.assert_close(gk, wk, **tol)
        torch.testing.assert_close(gv, wv, **tol)


def test_the_parts_tile_every_projection_at_head_boundaries():
    model, _ = _split_model("biases", torch.float32)
    parts = SplitParts(model.model, 3)
    att = model.model.layers[0].self_attn
    qkv, o, inter, down = ([parts.cols[p * 8 + k] for p in range(3)] for k in (1, 3, 5, 7))
    assert sum(qkv) == (att.num_heads + 2 * att.num_kv_heads) * att.head_dim
    assert all(w % att.head_dim == 0 for w in qkv)
    assert sum(o) == sum(down) == 128 and sum(inter) == 96
    assert [parts.cols[p * 8] for p in range(3)] == [0, qkv[0], qkv[0] + qkv[1]]
    # per layer, per thread: four packed parts, each with its slice of the bias
    assert len(parts.tensors) == 3 * 3 * 8
    gate_up = model.model.layers[0].mlp.fusions["gate_up"].carrier
    first = parts.cols[4], parts.cols[5]  # thread 0's intermediate columns: its gate and its up slices
    want = torch.cat((gate_up.bias[first[0]:first[0] + first[1]], gate_up.bias[96 + first[0]:96 + first[0] + first[1]]))
    assert torch.equal(parts.tensors[5], want)


def test_one_thread_adapter_rows_and_the_switch_keep_the_whole_weight_loop():
    model, loop = _split_model("llama", torch.float32, lora="kernel")
    torch.set_num_threads(1)
    _steps(model, STEPS[:1], False)
    assert loop.split_steps == 0 and loop._parts is None  # one thread: no parts are made
    torch.set_num_threads(2)
    _steps(model, STEPS[:1], False, {0: 1})  # a step with adapter rows
    assert loop.split_steps == 0 and loop._parts is not None
    _steps(model, STEPS[:1], False)
    assert loop.split_steps == 1
    loop.split = False
    _steps(model, STEPS[:1], False)
    assert loop.split_steps == 1 and loop._parts is None
    loop.split, loop.split_from = True, 4  # a 3-row step under the threshold
    _steps(model, STEPS[:1], False)
    assert loop.split_steps == 1


def test_parts_that_do_not_tile_a_product_are_refused_before_any_thread_runs():
    """The model's C++ arguments check parts when they take them; refused parts leave the ones they held."""
    model, loop = _split_model("llama", torch.float32)
    want, _ = _steps(model, STEPS[:1], False)
    parts = loop._parts
    parts.cols[1] -= loop._args.head_dim  # thread 0's Q/K/V one head short
    with pytest.raises(RuntimeError, match="column-split parts"):
        loop._set_parts(parts)
    assert loop._args.split_threads == 2
    got, _ = _steps(model, STEPS[:1], False)
    assert loop.split_steps == 2 and torch.equal(got[0], want[0])


def test_the_engine_switch(smol_path, smol_tokenizer):
    """SmolLM2 in fp32 through the engine: the split form's greedy tokens are the whole-weight form's."""
    from orthrus_rag import Engine
    from tests.conftest import SMOL, engine_overrides

    on = Engine.from_pretrained(SMOL, **engine_overrides(kernel_overrides={"linears": "onednn", "layers": "split"}))
    off = Engine.from_pretrained(SMOL, **engine_overrides(kernel_overrides={"linears": "onednn", "layers": "loop"}))
    assert on.runner.model.model.layer_loop.split and not off.runner.model.model.layer_loop.split
    loop = on.runner.model.model.layer_loop
    loop.split_from = 8
    assert_same_greedy_tokens(on, off, smol_tokenizer, repeat=3, max_tokens=8)
    assert loop.split_steps > 0


def test_an_error_on_one_thread_mid_region_is_raised_and_the_next_step_runs():
    """A part that oneDNN refuses, on thread 0 in the middle of a layer's region: the other thread meets every barrier
    (no hang), the step raises, and a step after the part is mended gives the whole-weight loop's result."""
    model, loop = _split_model("llama", torch.float32)
    want, _ = _steps(model, STEPS[:1], False)
    parts = loop._parts
    o_part = (1 * parts.threads + 0) * 8 + 2  # layer 1, thread 0: its O part
    good = parts.tensors[o_part]
    parts.tensors[o_part] = torch.zeros(good.shape[0], 7)  # inner size 7, not the 128 of the layer's o_in
    loop._set_parts(parts)  # NOTE: its counts and columns pass the check; oneDNN refuses it mid-region
    with pytest.raises(RuntimeError):
        _steps(model, STEPS[:1], False)
    parts.tensors[o_part] = good
    loop._set_parts(parts)
    got, _ = _steps(model, STEPS[:1], False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
