"""GPU set, attention: what CUDA runs by default, the fp32 fallback, and the real flash varlen kernel against the
per-sequence reference (the CPU suite checks the varlen backend only with a stand-in written from the same
reading of flash attention's semantics: bottom-right causal alignment after a cached prefix, windows, GQA).

Run on a GPU machine: see README, "GPU checks". Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from orthrus_rag import ModelConfig, SamplingParams
from orthrus_rag.layers.attention import grouped, select_backend, varlen

from tests import attention_reference as reference
from orthrus_rag.models.llama import apply_rotary
from tests.gpu_support import DEVICE, assert_released, cuda_only, engine, gpu, ids, save_random_model, smol_config
from tests.test_attention import SCENARIOS, _scenario

pytestmark = gpu


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return save_random_model(smol_config(num_layers=4), tmp_path_factory.mktemp("small"))


@cuda_only
def test_cuda_defaults_are_bf16_varlen_graphs_and_the_cost_budget(small):
    assert ModelConfig(device="cuda").torch_dtype == torch.bfloat16
    eng = engine(small)
    assert eng.runner.attn_backend is varlen
    assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert eng.runner.decode_graphs is not None and eng.scheduler.cost_model is not None
    assert eng.runner.model.model.layers[0].self_attn.rotary is not apply_rotary  # compiled elementwise kernels
    outs = eng.generate([ids(30, 1), ids(70, 2)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert eng.runner.decode_graphs.num_steps > 0  # decode steps replayed graphs
    assert_released(eng)


def test_fp32_runs_through_the_grouped_fallback(small):
    eng = engine(small, dtype="float32")
    assert eng.runner.attn_backend is grouped
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="float16 / bfloat16"):
            select_backend("varlen", DEVICE, torch.float32, 64)
    outs, embs = eng.run(prompts=[ids(40, 3), ids(300, 4)],
                         sampling_params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                         texts=[ids(90, 5)])
    assert [len(o.token_ids) for o in outs] == [6, 6] and torch.isfinite(embs[0].embedding).all()
    assert_released(eng)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 4, 50])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_flash_kernel_equals_the_reference(name, heads, kv_heads, window, dtype):
    meta, _, q, k, v, k_cache, v_cache = _scenario(SCENARIOS[name], heads, kv_heads, dim=64)
    meta = type(meta)(**{f: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for f, x in vars(meta).items()})
    # NOTE: inputs rounded to `dtype` first, so the comparison measures the kernel, not the inputs' rounding
    q, k, v, k_cache, v_cache = (t.to(DEVICE, dtype).float() for t in (q, k, v, k_cache, v_cache))
    meta.plan = reference.plan(meta, {None, window})
    want = reference.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125, window)  # fp32
    meta.plan = varlen.plan(meta, {None, window})
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    got = varlen.forward(q.to(dtype), k.to(dtype), v.to(dtype), kc, vc, meta, 0.125, window)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(kc[meta.slot_mapping].float(), k.to(dtype).float())  # K written where it belongs
