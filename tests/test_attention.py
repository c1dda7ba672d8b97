"""Attention backends against a per-sequence reference SDPA, and the step metadata against hand-built values.

Each scenario is a step of sequences (cached tokens, new tokens, whether the cache keeps their K/V) over a random
paged cache; every backend must give the reference's output within 1e-5 (fp32) and write the same cache rows.
The CUDA varlen backend runs here with a CPU stand-in for `varlen_attn` that implements flash attention's
documented semantics (cumulative lengths, bottom-right causal alignment, `window_size=(left, 0)`), so what is
checked is everything around the kernel: the gather, the cumulative key lengths, the head expansion and the
window mapping.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_rag.layers.attention import build_metadata, grouped, key_slots, select_backend, varlen

from tests import attention_reference as reference
from orthrus_rag.layers.attention.cpu_kernels import decode_kernel_available

pytestmark = pytest.mark.isa  # make test runs this file again under ORTHRUS_CPU_ISA=avx2

BLOCK = 4
NUM_BLOCKS = 96
SCRATCH = 256


def _scenario(seqs: list[tuple[int, int, bool]], heads: int, kv_heads: int, dim: int = 8, seed: int = 0,
              num_blocks: int = NUM_BLOCKS):
    """seqs: (cached, new, keeps_kv) per sequence. Returns metadata inputs, q/k/v and caches."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for cached, new, keeps in seqs:
        kept = cached + (new if keeps else 0)
        tables.append([free.pop() for _ in range(-(-kept // BLOCK))])
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(n for _, n, _ in seqs)
    rows = num_blocks * BLOCK + SCRATCH
    k_cache, v_cache = torch.randn(rows, kv_heads, dim, generator=g), torch.randn(rows, kv_heads, dim, generator=g)
    q = torch.randn(num_tokens, heads, dim, generator=g)
    k, v = torch.randn(num_tokens, kv_heads, dim, generator=g), torch.randn(num_tokens, kv_heads, dim, generator=g)
    meta = build_metadata([n for _, n, _ in seqs], [c for c, _, _ in seqs], tables, [kp for _, _, kp in seqs],
                          BLOCK, num_blocks * BLOCK, torch.device("cpu"))
    return meta, tables, q, k, v, k_cache, v_cache


def _run(backend, meta, q, k, v, k_cache, v_cache, window):
    meta.plan = backend.plan(meta, {None, window})
    kc, vc = k_cache.clone(), v_cache.clone()
    return backend.forward(q, k, v, kc, vc, meta, 0.3, window), kc, vc


def _fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """flash attention's varlen semantics in plain torch: per sequence, bottom-right aligned causal mask."""
    assert window_size[1] == 0 and (enable_gqa or q.shape[1] == k.shape[1])
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        n, length = qe - qs, ke - ks
        q_pos = torch.arange(length - n, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        mask = k_pos <= q_pos
        if window_size[0] >= 0:
            mask &= k_pos >= q_pos - window_size[0]
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                           v[ks:ke].transpose(0, 1), attn_mask=mask, scale=scale,
                                           enable_gqa=enable_gqa)
        out[qs:qe] = o.transpose(0, 1)
    return out


class _DecodeKernel:
    """The grouped backend with its decode groups on the C++ kernel (CPU, fp32)."""

    @staticmethod
    def plan(meta, windows):
        meta.decode_kernel = True
        plan = grouped.plan(meta, windows)
        assert any(g.lengths is not None for g in plan.groups) == (1 in meta.query_lens)
        return plan

    forward = staticmethod(grouped.forward)


# NOTE: the C++ kernel builds on first use (minutes on a fresh machine): not part of the fast subset
@pytest.fixture(params=["grouped", pytest.param("grouped-decode-kernel", marks=pytest.mark.slow), "varlen"])
def backend(request, monkeypatch):
    if request.param == "grouped":
        return grouped
    if request.param == "grouped-decode-kernel":
        if not decode_kernel_available():
            pytest.fail("the C++ decode kernel did not build (a compiler and ninja are installed with the project)")
        return _DecodeKernel
    monkeypatch.setattr(varlen, "_varlen_attn", lambda: _fake_varlen_attn)
    return varlen


SCENARIOS = {
    "decode, equal lengths": [(9, 1, True)] * 5,
    "decode, very different lengths": [(0, 1, True), (3, 1, True), (40, 1, True), (150, 1, True), (7, 1, True)],
    "chunks after cached prefixes": [(32, 8, True), (0, 12, True), (100, 5, True)],
    "fresh equal chunks (causal fast path)": [(0, 6, True)] * 4,
    "embedding final chunks keep no KV": [(8, 6, False), (0, 5, False), (12, 3, True)],
    "everything in one step": [(60, 1, True), (0, 1, True), (20, 16, True), (0, 9, False), (33, 4, False),
                               (200, 1, True), (0, 30, True), (5, 1, True)],
}


@pytest.mark.parametrize("window", [None, 4, 50])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_backend_equals_per_sequence_reference(backend, name, heads, kv_heads, window):
    meta, _, q, k, v, k_cache, v_cache = _scenario(SCENARIOS[name], heads, kv_heads)
    want, want_k, want_v = _run(reference, meta, q, k, v, k_cache, v_cache, window)
    got, got_k, got_v = _run(backend, meta, q, k, v, k_cache, v_cache, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_reference_equals_dense_causal_attention_of_each_whole_sequence():
    """The reference itself: a sequence's chunk after its cached prefix sees exactly what full causal attention
    over the whole sequence gives those positions (the cached K/V are the sequence's own earlier K/V)."""
    heads, kv_heads, dim, cached, new = 4, 2, 8, 13, 5
    meta, tables, q, k, v, k_cache, v_cache = _scenario([(cached, new, True)], heads, kv_heads, dim)
    slots = key_slots(meta, [0], cached)[0]
    k_all = torch.cat([k_cache[slots], k])
    v_all = torch.cat([v_cache[slots], v])
    q_all = torch.cat([torch.randn(cached, heads, dim), q])
    dense = F.scaled_dot_product_attention(q_all.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1),
                                           is_causal=True, scale=0.3, enable_gqa=True).transpose(0, 1)
    got, _, _ = _run(reference, meta, q, k, v, k_cache, v_cache, None)
    torch.testing.assert_close(got, dense[cached:], atol=1e-5, rtol=1e-5)


def test_metadata_equals_a_hand_built_reference():
    seqs = [(5, 1, True), (0, 3, False), (6, 4, True)]
    meta, tables, *_ = _scenario(seqs, 2, 1)
    assert meta.query_start_loc.tolist() == [0, 1, 4, 8]
    assert meta.seq_lens.tolist() == [6, 3, 10]
    assert meta.positions.tolist() == [5, 0, 1, 2, 6, 7, 8, 9]
    width = max(len(t) for t in tables)
    assert meta.block_tables.shape == (3, width) and meta.block_tables.dtype == torch.int32
    for i, t in enumerate(tables):
        assert meta.block_tables[i, :len(t)].tolist() == t

    def slot(table, pos):
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    scratch = NUM_BLOCKS * BLOCK
    want = [slot(tables[0], 5), scratch + 1, scratch + 2, scratch + 3] + [slot(tables[2], p) for p in range(6, 10)]
    assert meta.slot_mapping.tolist() == want
    keys = key_slots(meta, [0, 1, 2], 10)
    assert keys[0, :6].tolist() == [slot(tables[0], p) for p in range(6)]
    assert keys[1, :3].tolist() == [scratch + 1, scratch + 2, scratch + 3]
    assert keys[2].tolist() == [slot(tables[2], p) for p in range(10)]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens, meta.num_seqs) == (4, 10, 8, 3)


def test_varlen_plan_packs_each_sequences_keys():
    meta, tables, *_ = _scenario([(5, 1, True), (0, 3, False), (6, 4, True)], 2, 1)
    plan = varlen.plan(meta, {None})
    assert plan.cu_seq_k.tolist() == [0, 6, 9, 19]
    assert (plan.max_q, plan.max_k) == (4, 10)
    full = key_slots(meta, [0, 1, 2], 10)
    assert plan.key_slots.tolist() == full[0, :6].tolist() + full[1, :3].tolist() + full[2].tolist()
    assert varlen.window_size(None) == (-1, 0) and varlen.window_size(8) == (7, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 600)), min_size=1, max_size=40))
def test_groups_partition_the_sequences_and_keep_decodes_apart(shapes):
    query_lens = [n for n, _ in shapes]
    seq_lens = [n + c for n, c in shapes]
    groups = grouped.plan_groups(query_lens, seq_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(shapes)))
    for g in groups:
        assert len({query_lens[i] == 1 for i in g}) == 1


def test_one_group_for_a_uniform_step_and_separate_calls_for_outliers():
    assert grouped.plan_groups([1] * 32, [100] * 32) == [list(range(32))]
    groups = grouped.plan_groups([1] * 8 + [1], [20] * 8 + [3000])
    assert [8] in groups  # the long decode does not widen everyone's keys to 3,000


def test_backend_selection():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) is grouped
    with pytest.raises(ValueError, match="backend 'reference'; expected one of auto, grouped, varlen"):
        select_backend("reference", cpu)  # the test oracle is not a user's choice
    with pytest.raises(ValueError, match="CUDA only"):
        select_backend("varlen", cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", cpu)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device as the backend choice sees it (nothing runs on it): CUDA available, torch 2.11's varlen_attn."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        raise AssertionError("never called: the backend choice reads only the signature")

    monkeypatch.setattr(varlen, "_varlen_attn", lambda: fake)
    return torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_takes_varlen_on_cuda_in_half_precision(fake_cuda, dtype):
    assert select_backend("auto", fake_cuda, dtype, 64) is varlen
    assert select_backend("varlen", fake_cuda, dtype, 128) is varlen
    assert select_backend("grouped", fake_cuda, dtype, 64) is grouped  # an explicit choice is kept


def test_fp32_on_cuda_falls_back_to_grouped_and_explicit_varlen_says_why(fake_cuda, caplog):
    with caplog.at_level("INFO", logger="orthrus_rag.layers.attention"):
        assert select_backend("auto", fake_cuda, torch.float32, 64) is grouped
    assert "float16 / bfloat16" in caplog.text
    with pytest.raises(ValueError, match="float16 / bfloat16"):
        select_backend("varlen", fake_cuda, torch.float32, 64)


@pytest.mark.parametrize("head_dim", [100, 264])
def test_head_sizes_flash_cannot_take_fall_back(fake_cuda, head_dim):
    assert select_backend("auto", fake_cuda, torch.bfloat16, head_dim) is grouped
    with pytest.raises(ValueError, match="head sizes"):
        select_backend("varlen", fake_cuda, torch.bfloat16, head_dim)


def test_without_the_kernel_auto_falls_back(fake_cuda, monkeypatch):
    monkeypatch.setattr(varlen, "_varlen_attn", lambda: None)  # no torch.nn.attention.varlen at all
    assert select_backend("auto", fake_cuda, torch.bfloat16, 64) is grouped
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(varlen, "_varlen_attn", lambda: _fake_varlen_attn)
    assert select_backend("auto", fake_cuda, torch.bfloat16, 64) is grouped


def test_the_runner_chooses_by_its_models_dtype_and_head_size(monkeypatch):
    """The runner hands the cache dtype and the model's head size to the choice (fp32 on CUDA -> grouped)."""
    from transformers import LlamaConfig

    from orthrus_rag.config.build import engine_config
    from orthrus_rag.engine.executor import runner as runner_module
    from orthrus_rag.models.llama import CausalLM

    seen = []

    def spy(name, device, dtype, head_dim):
        seen.append((name, device.type, dtype, head_dim))
        return grouped

    monkeypatch.setattr(runner_module, "choose_attention", spy)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=32)
    config = engine_config(block_size=4, max_num_batched_tokens=8, kernels="torch",
                           kernel_overrides={"attention": "auto"})
    runner_module.ModelRunner(CausalLM(cfg), config, 4, torch.bfloat16)
    assert seen == [("auto", "cpu", torch.bfloat16, 24)]
