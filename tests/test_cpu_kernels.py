"""The CPU extension's chunked-prefill attention and fused elementwise kernels against the torch ops they
replace: attention within the error SDPA itself makes in bf16 (every step shape of the backend tests, sliding
windows, GQA, head sizes 32 to 128) and within fp32 rounding of the exact attention in fp32 (its fp32 body, every
x86-64 CPU), the elementwise kernels rounding as the eager bf16 ops do, and the model with them on within
cosine 0.999 of the model with them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.attention import cpu_prefill, grouped

from tests import attention_reference as reference
from orthrus_rag.models.llama import RMSNorm, apply_rotary
from tests.test_attention import SCENARIOS, _run, _scenario

# NOTE: the extension builds on first use (a minute on a fresh machine): not part of the fast subset
pytestmark = [pytest.mark.slow, pytest.mark.isa]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    if not cpu_elementwise.available(torch.float32):
        pytest.fail("the CPU extension did not build (a compiler and ninja are installed with the project)")


def _needs_bf16_kernel():
    if not cpu_prefill.prefill_kernel_runs(torch.bfloat16, 64):
        pytest.skip("this CPU has no AVX512-BF16: chunks keep SDPA there (the grouped backend's own tests)")


@pytest.fixture(params=["amx", "avx512_bf16"])
def bf16_body(request):
    """Each bf16 body of the kernel that runs here: on an AMX CPU both (the AVX512-BF16 one inside
    `avx512_bf16_body`), elsewhere the AVX512-BF16 one."""
    _needs_bf16_kernel()
    if request.param == "amx" and not cpu_prefill.amx_body():
        pytest.skip("no AMX tiles here: bf16 runs the AVX512-BF16 body")
    if request.param == "amx" or not cpu_prefill.amx_body():
        yield request.param
        return
    with cpu_prefill.avx512_bf16_body():
        yield request.param


class _PrefillKernel:
    """The grouped backend with chunks on the prefill kernel and decodes on the decode kernel."""

    @staticmethod
    def plan(meta, windows):
        meta.prefill_kernel = meta.decode_kernel = True
        plan = grouped.plan(meta, windows)
        assert (plan.chunks is not None) == any(n > 1 for n in meta.query_lens)
        return plan

    forward = staticmethod(grouped.forward)


def _bf16(*tensors):
    return [t.bfloat16() for t in tensors]


def _kernel_against_sdpa(meta, q, k, v, k_cache, v_cache, window):
    """The kernel's output and cache writes, its largest error to the fp32 attention, and SDPA's own in bf16 (with
    SDPA's cache writes)."""
    exact, _, _ = _run(reference, meta, *[t.float() for t in (q, k, v, k_cache, v_cache)], window)
    sdpa, want_k, want_v = _run(reference, meta, q, k, v, k_cache, v_cache, window)
    got, got_k, got_v = _run(_PrefillKernel, meta, q, k, v, k_cache, v_cache, window)
    err, sdpa_err = ((x.float() - exact).abs().max().item() for x in (got, sdpa))
    return got, (got_k, got_v), (want_k, want_v), err, sdpa_err


@pytest.mark.parametrize("window", [None, 4, 50])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 32), (9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_prefill_kernel_is_within_sdpas_own_bf16_error(name, heads, kv_heads, dim, window, bf16_body):
    meta, _, q, k, v, k_cache, v_cache = _scenario(SCENARIOS[name], heads, kv_heads, dim=dim)
    q, k, v, k_cache, v_cache = _bf16(q, k, v, k_cache, v_cache)
    got, (got_k, got_v), (want_k, want_v), err, sdpa_err = _kernel_against_sdpa(meta, q, k, v, k_cache, v_cache,
                                                                                 window)
    assert got.dtype is torch.bfloat16
    # NOTE: both round P and the output to bf16; the kernel's scores and sums are fp32, as SDPA's are
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("window", [None, 100])  # 100: the rows' first keys past the first score blocks
@pytest.mark.parametrize("prefix,chunk", [(250, 120), (2100, 70)])
def test_prefill_kernel_takes_one_long_chunk_over_a_long_cached_prefix(prefix, chunk, window, bf16_body):
    meta, _, q, k, v, k_cache, v_cache = _scenario([(prefix, chunk, True), (0, 1, True)], 9, 3, dim=64, num_blocks=600)
    _, _, _, err, sdpa_err = _kernel_against_sdpa(meta, *_bf16(q, k, v, k_cache, v_cache), window)
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)


def test_prefill_kernel_takes_head_sizes_of_odd_multiples_of_32(bf16_body):
    """Heads of 96 (Phi-3's): the AMX body's products step through three 32-dim tiles of K and six of V, and P @ V in
    passes of 32 dims."""
    meta, _, q, k, v, k_cache, v_cache = _scenario([(40, 37, True), (0, 19, True), (7, 1, True)], 6, 2, dim=96)
    _, _, _, err, sdpa_err = _kernel_against_sdpa(meta, *_bf16(q, k, v, k_cache, v_cache), None)
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)


def test_prefill_kernel_reads_strided_queries_as_they_are(bf16_body):
    meta, _, q, k, v, k_cache, v_cache = _scenario([(20, 40, True), (0, 9, True)], 9, 3, dim=64)
    q, k, v, k_cache, v_cache = _bf16(q, k, v, k_cache, v_cache)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # the fused projection's output
    strided = qkv[:, :9 * 64].view(-1, 9, 64)
    assert not strided.is_contiguous()
    want, _, _ = _run(_PrefillKernel, meta, q, k, v, k_cache, v_cache, None)
    got, _, _ = _run(_PrefillKernel, meta, strided, k, v, k_cache, v_cache, None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("window", [None, 4, 50])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 32), (9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_fp32_prefill_kernel_is_the_exact_attention(name, heads, kv_heads, dim, window):
    """The fp32 body (any x86-64 CPU: AVX2's 8 lanes under `make test`'s AVX2 pass, AVX-512's 16 natively there)."""
    assert cpu_prefill.prefill_kernel_available(torch.float32, dim)
    meta, _, q, k, v, k_cache, v_cache = _scenario(SCENARIOS[name], heads, kv_heads, dim=dim)
    exact, want_k, want_v = _run(reference, meta, q, k, v, k_cache, v_cache, window)
    got, got_k, got_v = _run(_PrefillKernel, meta, q, k, v, k_cache, v_cache, window)
    assert got.dtype is torch.float32
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=1e-4)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_the_fp32_prefill_kernel_takes_one_long_chunk_over_a_long_cached_prefix():
    meta, _, q, k, v, k_cache, v_cache = _scenario([(250, 120, True), (0, 1, True)], 9, 3, dim=64)
    exact, _, _ = _run(reference, meta, q, k, v, k_cache, v_cache, None)
    got, _, _ = _run(_PrefillKernel, meta, q, k, v, k_cache, v_cache, None)
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=1e-4)


def test_the_kernel_takes_fp32_and_bf16_only_and_says_so():
    assert cpu_prefill.prefill_kernel_available(torch.float32, 64)
    assert not cpu_prefill.prefill_kernel_available(torch.float16, 64)
    assert not cpu_prefill.prefill_kernel_available(torch.float32, 48)  # head sizes: multiples of 32
    assert not cpu_prefill.prefill_kernel_available(torch.bfloat16, 48)
    meta, _, q, k, v, k_cache, v_cache = _scenario([(0, 6, True)], 4, 2, dim=32)
    meta.prefill_kernel = True
    chunks = grouped.plan(meta, {None}).chunks

    def attend(dtype, cache_dtype=None):
        cache_dtype = cache_dtype or dtype
        cpu_prefill.prefill_attention(q.to(dtype), k_cache.to(cache_dtype), v_cache.to(cache_dtype), chunks, 0.3,
                                      None, torch.empty_like(q, dtype=dtype))

    attend(torch.float32)
    with pytest.raises(RuntimeError, match="float32 tensors"):
        attend(torch.float16)
    with pytest.raises(RuntimeError, match="one dtype"):
        attend(torch.float32, torch.bfloat16)
    if not cpu_prefill.prefill_kernel_runs(torch.bfloat16, 64):  # NOTE: AVX2: bf16 is refused, naming why
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            attend(torch.bfloat16)


def test_bf16_on_amx_takes_the_kernel_where_its_amx_body_runs(monkeypatch):
    """On an AMX CPU the kernel's AMX body ran 1.5-2.6x torch's SDPA (which runs on AMX tiles there): bf16 takes the
    kernel. Where that body cannot run (the OS refused the tile state), SDPA, 1.7-2.9x the AVX512-BF16 body there,
    keeps bf16."""
    from orthrus_rag import machine

    flags = machine._proc_flags()
    monkeypatch.setattr(machine, "_proc_flags", lambda: flags | {"amx_bf16", "amx_tile"})
    runs = cpu_prefill.prefill_kernel_runs(torch.bfloat16, 64)
    assert cpu_prefill.prefill_kernel_available(torch.bfloat16, 64) is (runs and cpu_prefill.amx_body())
    monkeypatch.setattr(cpu_prefill, "amx_body", lambda: False)
    assert not cpu_prefill.prefill_kernel_available(torch.bfloat16, 64)
    assert cpu_prefill.prefill_kernel_available(torch.float32, 64)  # fp32: SDPA has no AMX path
    monkeypatch.setattr(machine, "_proc_flags", lambda: flags - {"amx_bf16", "amx_tile", "amx_int8"})
    assert cpu_prefill.prefill_kernel_available(torch.bfloat16, 64) is runs
    if runs:
        from orthrus_rag.layers.attention.cpu_encoder import encoder_kernel_available

        assert encoder_kernel_available(torch.zeros(2, 12, 32, dtype=torch.bfloat16))


def test_the_amx_body_runs_wherever_the_cpu_has_amx():
    """Built for this CPU (`-march=native`), an AMX CPU gets the AMX body: a build that loses it (a compiler without
    AMX-BF16, the OS's tile state refused) fails here rather than falling back to the slower bodies unseen."""
    from orthrus_rag import machine

    native_amx = machine.isa() != "avx2" and {"amx_bf16", "amx_tile"} <= machine._proc_flags()
    assert cpu_prefill.amx_body() is native_amx, (
        "an AMX CPU without the kernel's AMX body: the compiler lacks AMX-BF16 (GCC 11+ has it) or Linux refused the "
        "tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    assert (cpu_prefill.prefill_kernel_available(torch.bfloat16, 64)
            is cpu_prefill.prefill_kernel_runs(torch.bfloat16, 64))


def test_bf16_on_amx_without_the_amx_body_keeps_sdpa(monkeypatch):
    """Where the AMX body cannot run on an AMX CPU (a compiler without AMX-BF16, the tile state refused), bf16
    chunks keep torch's SDPA, which runs on AMX tiles there, and the plan says so."""
    from orthrus_rag import Engine, machine
    from tests.conftest import SMOL, engine_overrides

    _needs_bf16_kernel()
    flags = machine._proc_flags()
    monkeypatch.setattr(machine, "_proc_flags", lambda: flags | {"amx_bf16", "amx_tile"})
    monkeypatch.setattr(cpu_prefill, "amx_body", lambda: False)
    assert not cpu_prefill.prefill_kernel_available(torch.bfloat16, 64)
    assert cpu_prefill.prefill_kernel_available(torch.float32, 64)
    eng = Engine.from_pretrained(SMOL, **engine_overrides(dtype="bfloat16"))
    assert not eng.runner.prefill_kernel
    assert str(eng.plan.cell("prefill_attention")) == "prefill_attention: sdpa (padded groups)"
    # asked for by name, the kernel's AVX512-BF16 body runs there
    eng = Engine.from_pretrained(SMOL, **engine_overrides(dtype="bfloat16",
                                                          kernel_overrides={"prefill_attention": "cpp"}))
    assert eng.runner.prefill_kernel
    assert str(eng.plan.cell("prefill_attention")) == "prefill_attention: cpp (AVX512-BF16 body)"


def _packed_sdpa(q, k, v, lens):
    """One SDPA call per sequence of a packed [T, H, D] batch, every key of a sequence visible."""
    outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in x))[0].transpose(0, 1)
            for x in zip(q.split(lens), k.split(lens), v.split(lens))]
    return torch.cat(outs)


@pytest.mark.parametrize("heads,dim", [(12, 32), (4, 64)])
@pytest.mark.parametrize("lens", [[1], [7, 1, 40, 33], [256, 3, 129, 64, 1, 95]])
def test_encoder_kernel_is_within_sdpas_own_bf16_error(lens, heads, dim, bf16_body):
    """Bidirectional attention within each packed sequence (an encoder's: models/bert.py), every length from one
    token to past several key blocks."""
    from orthrus_rag.layers.attention.cpu_encoder import encoder_attention

    torch.manual_seed(len(lens) * dim)
    q, k, v = (torch.randn(sum(lens), heads, dim).bfloat16() for _ in range(3))
    exact = _packed_sdpa(q.float(), k.float(), v.float(), lens)
    sdpa = _packed_sdpa(q, k, v, lens)
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    got = encoder_attention(q, k, v, starts, torch.tensor(lens), dim ** -0.5)
    assert got.dtype is torch.bfloat16 and got.shape == q.shape
    sdpa_err = (sdpa.float() - exact).abs().max().item()
    err = (got.float() - exact).abs().max().item()
    assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)
    # every row saw its whole sequence and nothing of the others: a sequence alone gives its same rows
    last = lens[-1]
    alone = encoder_attention(q[-last:], k[-last:], v[-last:], torch.tensor([0]), torch.tensor([last]), dim ** -0.5)
    assert torch.equal(alone, got[-last:])


@pytest.mark.parametrize("heads,dim", [(12, 32), (4, 64)])
@pytest.mark.parametrize("lens", [[1], [7, 1, 40, 33], [256, 3, 129, 64, 1, 95]])
def test_the_fp32_encoder_kernel_is_sdpa_in_fp32(lens, heads, dim):
    from orthrus_rag.layers.attention.cpu_encoder import encoder_attention, encoder_kernel_available

    torch.manual_seed(len(lens) * dim)
    q, k, v = (torch.randn(sum(lens), heads, dim) for _ in range(3))
    assert encoder_kernel_available(q)
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    got = encoder_attention(q, k, v, starts, torch.tensor(lens), dim ** -0.5)
    assert got.dtype is torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, _packed_sdpa(q.double(), k.double(), v.double(), lens).float(), atol=2e-5,
                               rtol=1e-4)
    last = lens[-1]
    alone = encoder_attention(q[-last:], k[-last:], v[-last:], torch.tensor([0]), torch.tensor([last]), dim ** -0.5)
    assert torch.equal(alone, got[-last:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_kernel_reads_strided_queries_and_refuses_other_dtypes(dtype):
    if dtype is torch.bfloat16:
        _needs_bf16_kernel()
    from orthrus_rag.layers.attention.cpu_encoder import encoder_attention, encoder_kernel_available

    qkv = torch.randn(10, 3 * 4 * 32).to(dtype)
    q, k, v = (qkv[:, i * 128:(i + 1) * 128].view(10, 4, 32) for i in range(3))
    assert not q.is_contiguous()
    bounds = torch.tensor([0, 4]), torch.tensor([4, 6])
    assert torch.equal(encoder_attention(q, k, v, *bounds, 0.2), encoder_attention(q.contiguous(), k, v, *bounds, 0.2))
    assert not encoder_kernel_available(q.half())
    assert not encoder_kernel_available(torch.randn(3, 2, 48).to(dtype))  # head sizes: multiples of 32
    with pytest.raises(RuntimeError, match="float32 tensors"):
        encoder_attention(q.half(), k.half(), v.half(), *bounds, 0.2)
    with pytest.raises(RuntimeError, match="outside the batch"):  # rows past the end are refused, not read
        encoder_attention(q, k, v, torch.tensor([0, 4]), torch.tensor([4, 7]), 0.2)
    with pytest.raises(RuntimeError, match="int64"):
        encoder_attention(q, k, v, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4, 6]), 0.2)


# ---- fused elementwise kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_fused_bf16_kernels_round_as_the_eager_ops_do(rows):
    torch.manual_seed(rows)
    dt = torch.bfloat16
    x, res, w = torch.randn(rows, 576).to(dt), torch.randn(rows, 576).to(dt), torch.randn(576).to(dt)
    norm = RMSNorm(576, 1e-5).to(dt)
    norm.weight.data = w
    running = res.clone()
    out = cpu_elementwise.add_rms_norm(x, running, w, 1e-5)
    assert torch.equal(running, res + x)
    # NOTE: the norm's fp32 sum of squares is added in another order than torch's: a last-bit difference in the
    # scale flips a bf16 rounding now and then, never by more than one bf16 step
    want = norm(res + x)
    assert (out == want).float().mean() >= 0.99
    torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=2 ** -7)

    qkv = torch.randn(rows, 960).to(dt)  # rotary in place on strided views of the fused projection's output
    q = qkv[:, :576].view(rows, 9, 64)
    freqs = torch.arange(rows).float()[:, None] / (10000 ** (torch.arange(0, 64, 2) / 64))[None]
    cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(dt)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1).to(dt)
    want = apply_rotary(q, cos, sin)
    untouched = qkv[:, 576:].clone()
    assert torch.equal(cpu_elementwise.rotary(q, cos, sin), want) and torch.equal(qkv[:, 576:], untouched)  # exact

    gate, up = torch.randn(rows, 3072).to(dt).split(1536, dim=-1)
    assert torch.equal(cpu_elementwise.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_of_a_very_negative_gate_is_zero_not_nan(dtype):
    gate, up = torch.tensor([[-100.0, -1e4, 100.0, 0.0]]).to(dtype), torch.ones(1, 4).to(dtype)
    got = cpu_elementwise.silu_mul(gate, up)
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), atol=1e-30, rtol=0)


def test_a_full_delta_adapters_norms_are_not_fused(smol_path):
    from orthrus_rag.layers.row_deltas import RowDeltaModule
    from orthrus_rag.models.loader import load_decoder

    model = load_decoder(smol_path, torch.bfloat16, "cpu")
    layer = model.model.layers[3]
    layer.post_attention_layernorm = RowDeltaModule(layer.post_attention_layernorm)  # what attach_full_deltas does
    model.use_cpu_kernels()
    assert not model.model.fused_norms  # the wrapper's per-slot deltas would be skipped
    assert model.attention_layers[0].rotary is cpu_elementwise.rotary  # the rest still fuse
    ids = torch.tensor([1, 504, 3458, 282])
    assert torch.isfinite(_forward(model, ids, torch.arange(4))).all()


def test_fused_fp32_kernels_are_close_to_the_eager_ops():
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    running = res.clone()
    out = cpu_elementwise.add_rms_norm(x, running, w, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(res + x, (64,), w, 1e-6))
    gate, up = torch.randn(5, 40), torch.randn(5, 40)
    torch.testing.assert_close(cpu_elementwise.silu_mul(gate, up), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_elementwise.silu_mul(gate.half(), up.half())


def test_the_model_with_the_kernels_equals_the_model_without(smol_path):
    from orthrus_rag.models.loader import load_decoder

    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 2, 28, 9, 100])
    positions = torch.arange(len(ids))
    for dtype in (torch.float32, torch.bfloat16):
        model = load_decoder(smol_path, dtype, "cpu")
        hidden = _forward(model, ids, positions)
        model.use_cpu_kernels()
        assert model.model.fused_norms
        fused = _forward(model, ids, positions)
        # NOTE: bf16: the same roundings op for op but the norms' sums, whose rare last-bit flips 30 layers carry on
        cosines = F.cosine_similarity(fused.float(), hidden.float(), dim=-1)
        assert cosines.min() >= (0.999 if dtype is torch.bfloat16 else 0.99999), cosines


def _forward(model, ids, positions):
    from orthrus_rag.layers.attention import build_metadata
    from orthrus_rag.layers.context import ForwardContext, forward_context

    layers = model.attention_layers
    caches = [(torch.zeros(64, a.num_kv_heads, a.head_dim, dtype=model.lm_head.weight.dtype),
               torch.zeros(64, a.num_kv_heads, a.head_dim, dtype=model.lm_head.weight.dtype)) for a in layers]
    meta = build_metadata([len(ids)], [0], [[0]], [True], 16, 48, torch.device("cpu"))
    meta.plan = grouped.plan(meta, {None})
    with torch.inference_mode(), forward_context(ForwardContext(attn=meta, attn_backend=grouped, kv_caches=caches)):
        return model(ids, positions)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_switches_turn_each_kernel_off_and_the_tokens_stay_close(smol_path, smol_tokenizer, dtype):
    from transformers import AutoModelForCausalLM

    from orthrus_rag import Engine
    from orthrus_rag.params import SamplingParams
    from tests.conftest import SMOL, engine_overrides
    from tests.parity import check_greedy_close

    if dtype == "bfloat16":
        _needs_bf16_kernel()
    on = Engine.from_pretrained(SMOL, **engine_overrides(dtype=dtype))
    off = Engine.from_pretrained(SMOL, **engine_overrides(dtype=dtype, kernel_overrides={
        "prefill_attention": "sdpa", "layers": "torch"}))
    # NOTE: bf16 on AMX without the AMX body keeps SDPA (test_bf16_on_amx_takes_the_kernel_where_its_amx_body_runs)
    assert on.runner.prefill_kernel is cpu_prefill.prefill_kernel_available(getattr(torch, dtype), 64)
    assert on.runner.model.model.fused_norms
    assert not off.runner.prefill_kernel and not off.runner.model.model.fused_norms
    # NOTE: longer than the test budget (64 tokens): chunks after cached prefixes, beside the decode
    prompt = smol_tokenizer("Rivers begin in the mountains, where rain and snow")["input_ids"] * 6
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got, want = on.generate([prompt], params)[0], off.generate([prompt], params)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=getattr(torch, dtype)).eval()
    check_greedy_close(hf, prompt, list(got.token_ids), list(want.token_ids), tol=1e-3,
                       tol_std=0.1 if dtype == "bfloat16" else 0.0)
