"""The decoder's layer loop in C++ (layers/cpu_layer_loop.py): bit for bit the Python loop of the same kernels,
taken only on the steps it covers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.attention import build_metadata, cpu_prefill, grouped
from orthrus_rag.layers.context import ForwardContext, forward_context
from orthrus_rag.layers.linear import gemv_available, onednn_available, pack_linears, pack_module, use_gemv
from orthrus_rag.layers.lora import LoRAAdapter, attach_adapters, set_lora_kernel, use_cpu_lora_kernel
from orthrus_rag.models.llama import CausalLM

# NOTE: the extension builds on first use (a minute on a fresh machine): not part of the fast subset
pytestmark = [pytest.mark.slow, pytest.mark.isa]

BLOCK = 4
# packed bf16 needs torch's oneDNN bf16 (not on AVX2-only CPUs, nor under ORTHRUS_CPU_ISA=avx2): packed fp32 there
PACKED_BF16 = onednn_available(torch.bfloat16, "cpu")
NO_PACKED_BF16 = "oneDNN's packed bf16 needs avx512bw/vl/dq or avx_ne_convert (the dense bf16 cases run)"
COMMON = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)  # head_dim 32: the prefill kernel's


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    if not cpu_elementwise.available(torch.float32):
        pytest.fail("the CPU extension did not build (a compiler and ninja are installed with the project)")


def _model(kind: str, dtype: torch.dtype, packed: bool | int, lora: str | None = None) -> CausalLM:
    """`packed`: the oneDNN copies taken from 1 row (True), from that many rows (an int), or none (False).
    `lora`: None, "torch" (two adapters on torch's ops) or "kernel" (on the LoRA kernel, as the engine loads)."""
    config = {"llama": LlamaConfig(**COMMON), "qwen2": Qwen2Config(**COMMON),  # qwen2: Q/K/V biases
              "biases": LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),  # every projection's
              "mistral": MistralConfig(**COMMON, sliding_window=6), "qwen3": Qwen3Config(**COMMON, head_dim=32)}[kind]
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model = model.to(dtype)
    model.fuse_projections()
    model.use_cpu_kernels()
    if lora:  # wrapped as an engine with adapters has them, before packing (as loading.py does)
        modules = dict(model.named_modules())
        adapters = []
        # NOTE: two adapters of other ranks and targets: one leaves k and gate unadapted, the other v, o and down
        for name, rank, targets in (("a", 4, ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
                                               "mlp.up_proj", "mlp.down_proj")),
                                    ("b", 8, ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj",
                                              "mlp.up_proj"))):
            names = [f"model.layers.{i}.{m}" for i in range(COMMON["num_hidden_layers"]) for m in targets]
            weights = {n: (0.3 * torch.randn(rank, modules[n].in_features, dtype=dtype),
                           0.3 * torch.randn(modules[n].out_features, rank, dtype=dtype)) for n in names}
            adapters.append(LoRAAdapter(name, rank, 2.0 / rank, weights))
        attach_adapters(model, adapters)
        if lora == "kernel":
            use_cpu_lora_kernel(model)
    if packed:
        pack_linears(model, from_rows=1 if packed is True else packed)
    return model


class Spy:
    """Counts the steps the C++ loop took (a result) and left to the Python loop (None)."""

    def __init__(self, loop) -> None:
        self.loop, self.taken, self.left = loop, 0, 0

    def __getattr__(self, name: str):  # NOTE: the loop's other members (refresh, describe, ...) as they are
        return getattr(self.loop, name)

    def __call__(self, *args):
        out = self.loop(*args)
        self.taken += out is not None
        self.left += out is None
        return out


def _steps(model: CausalLM, steps, prefill_kernel: bool, slots: dict[int, int] | None = None,
           decode_kernel: bool = True):
    """Run `steps` (each a list of (sequence, new tokens)) on fresh caches; the hidden states of every step.
    `slots`: the adapter slot of each sequence that has one (its rows are the step's adapter rows)."""
    layers = model.attention_layers
    dtype = model.lm_head.weight.dtype
    caches = [(torch.zeros(128, a.num_kv_heads, a.head_dim, dtype=dtype),
               torch.zeros(128, a.num_kv_heads, a.head_dim, dtype=dtype)) for a in layers]
    tables = {0: [0, 1, 2, 3], 1: [9, 5, 6], 2: [12, 13, 14, 15]}  # scattered blocks: key slots are not in order
    done = {s: 0 for s in tables}
    torch.manual_seed(1)
    outs = []
    for step in steps:
        ids = torch.randint(0, 64, (sum(n for _, n in step),))
        meta = build_metadata([n for _, n in step], [done[s] for s, _ in step], [tables[s] for s, _ in step],
                              [True] * len(step), BLOCK, 64, torch.device("cpu"))
        meta.decode_kernel, meta.prefill_kernel = decode_kernel, prefill_kernel
        meta.plan = grouped.plan(meta, {a.window for a in layers})
        rows: dict[int, list[int]] = {}
        start = 0
        for s, n in step:
            if (slots or {}).get(s):
                rows.setdefault(slots[s], []).extend(range(start, start + n))
            start += n
        lora_rows = [(slot, torch.tensor(r)) for slot, r in sorted(rows.items())]
        with torch.inference_mode(), forward_context(ForwardContext(attn=meta, attn_backend=grouped,
                                                                    kv_caches=caches, lora_rows=lora_rows)):
            outs.append(model(ids, meta.positions))
        for s, n in step:
            done[s] += n
    return outs, caches


STEPS = [
    [(0, 1), (1, 1), (2, 1)],  # decodes only, no cache yet beyond the new row
    [(0, 9), (1, 5)],  # chunks
    [(0, 1), (1, 1), (2, 7)],  # decodes beside a chunk
    [(0, 1), (1, 1), (2, 1)],  # decodes over cached keys, all three past mistral's window of 6
    [(2, 1)],  # one decode: the identity plan
]


@pytest.mark.parametrize("kind,lora", [("llama", None), ("qwen2", None), ("biases", None), ("mistral", None),
                                       ("llama", "torch"), ("llama", "kernel")])
@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.float32, True), (torch.float32, 4),
                                          (torch.bfloat16, False), (torch.bfloat16, True), (torch.bfloat16, 4)])
def test_the_loop_equals_the_python_loop_bit_for_bit(kind, lora, dtype, packed):
    """Every step of a plain model; a LoRA-wrapped model's steps without adapter rows on torch's ops (its wrappers
    add nothing then), and with rows of two adapters beside base rows on the LoRA kernel. Packed from 4 rows: the
    steps of 1 and 3 rows multiply by the dense weights, those of 9 and 14 by the packed ones, in both loops."""
    if packed and dtype is torch.bfloat16 and not PACKED_BF16:
        pytest.skip(NO_PACKED_BF16)
    prefill_kernel = cpu_prefill.prefill_kernel_runs(dtype, 32)
    model = _model(kind, dtype, packed, lora)
    slots = {0: 1, 2: 2} if lora == "kernel" else None  # sequence 1 stays on the base weights
    want, want_caches = _steps(model, STEPS, prefill_kernel, slots)
    assert model.use_cpu_layer_loop()
    spy = model.model.layer_loop = Spy(model.model.layer_loop)
    got, got_caches = _steps(model, STEPS, prefill_kernel, slots)
    assert spy.loop.packed_from == (0 if not packed else 1 if packed is True else packed)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    # chunks on SDPA where the prefill kernel does not run (bf16 without AVX512-BF16) take the loop too
    assert (spy.taken, spy.left) == (5, 0)
    if slots:  # and the adapters did change the adapter rows
        assert not torch.equal(_steps(model, STEPS[:1], prefill_kernel)[0][0], got[0])


@pytest.mark.parametrize("kind,lora", [("llama", None), ("qwen2", None), ("biases", None), ("llama", "kernel")])
def test_steps_of_few_rows_take_the_few_row_product_in_both_loops(kind, lora):
    """With the few-row bf16 product up to 3 rows (packed from 4 where oneDNN runs bf16): the steps of 1 and 3 rows
    multiply by it, bit for bit in the C++ loop and the Python one, and within bf16's rounding of the model
    without it."""
    if (why := gemv_available(torch.bfloat16, "cpu")) is not None:
        pytest.skip(f"the few-row bf16 product cannot run here: {why}")
    prefill_kernel = cpu_prefill.prefill_kernel_runs(torch.bfloat16, 32)
    slots = {0: 1, 2: 2} if lora == "kernel" else None
    plain = _model(kind, torch.bfloat16, 4 if PACKED_BF16 else False, lora)
    without, _ = _steps(plain, STEPS, prefill_kernel, slots)
    model = _model(kind, torch.bfloat16, 4 if PACKED_BF16 else False, lora)
    assert use_gemv(model, rows=3) == 3 * 4 + 1  # four products a layer (Q/K/V and gate/up fused) and the head
    want, want_caches = _steps(model, STEPS, prefill_kernel, slots)  # NOTE: the Python loop first
    assert model.use_cpu_layer_loop()
    spy = model.model.layer_loop = Spy(model.model.layer_loop)
    assert spy.loop.gemv_rows == 3
    got, got_caches = _steps(model, STEPS, prefill_kernel, slots)
    assert (spy.taken, spy.left) == (5, 0)
    for g, w, o in zip(got, want, without):
        assert torch.equal(g, w)
        torch.testing.assert_close(g.float(), o.float(), rtol=0.05, atol=0.05 * o.float().abs().max().item())
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


@pytest.mark.parametrize("kind,lora", [("llama", None), ("qwen2", None), ("mistral", None), ("llama", "kernel")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_kernel", [True, False])
def test_groups_on_sdpa_run_in_the_loop_bit_for_bit(kind, lora, dtype, decode_kernel):
    """Chunks without the prefill kernel (bf16 without AVX512-BF16, or on AMX where the kernel's AMX body cannot run,
    takes SDPA) and, without the decode kernel,
    decodes: the plan's SDPA groups (padded, masked, windowed on mistral, causal) through the same torch ops from
    C++, beside the kernels' groups; with adapter rows too."""
    model = _model(kind, dtype, True if dtype is torch.float32 or PACKED_BF16 else False, lora)
    slots = {0: 1, 2: 2} if lora else None
    want, want_caches = _steps(model, STEPS, False, slots, decode_kernel)
    assert model.use_cpu_layer_loop()
    spy = model.model.layer_loop = Spy(model.model.layer_loop)
    got, got_caches = _steps(model, STEPS, False, slots, decode_kernel)
    assert (spy.taken, spy.left) == (5, 0)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_a_step_with_adapter_rows_on_torchs_ops_or_autograd_keeps_the_python_loop():
    model = _model("llama", torch.float32, True, lora="torch")
    assert model.use_cpu_layer_loop()
    loop = model.model.layer_loop
    meta = build_metadata([1], [0], [[0]], [True], BLOCK, 64, torch.device("cpu"))
    meta.decode_kernel = True
    meta.plan = grouped.plan(meta, {None})
    caches = [(torch.zeros(80, 2, 32), torch.zeros(80, 2, 32)) for _ in model.attention_layers]
    h, residual, cos, sin = torch.randn(1, 128), torch.randn(1, 128), torch.ones(1, 32), torch.zeros(1, 32)
    with torch.inference_mode():
        assert loop(h, residual.clone(), cos, sin) is None  # outside a step: no metadata
    with forward_context(ForwardContext(attn=meta, attn_backend=grouped, kv_caches=caches)):
        with torch.inference_mode():
            assert loop(h, residual.clone(), cos, sin) is not None
        with torch.enable_grad():
            assert loop(h, residual.clone(), cos, sin) is None
    with torch.inference_mode(), forward_context(ForwardContext(attn=meta, attn_backend=grouped, kv_caches=caches,
                                                                lora_rows=[(1, torch.tensor([0]))])):
        assert loop(h, residual.clone(), cos, sin) is None  # the adapters' layers add through torch's ops
        use_cpu_lora_kernel(model)
        loop.refresh()  # NOTE: LoRA settings changed after the loop was made: its model arguments gathered again
        assert loop(h, residual.clone(), cos, sin) is not None  # through the kernel, which the loop calls too
        set_lora_kernel(model, "per_slot")
        loop.refresh()
        assert loop(h, residual.clone(), cos, sin) is None
    with torch.inference_mode(), forward_context(ForwardContext(attn=meta, attn_backend=grouped,
                                                                kv_caches=caches[:-1])):
        assert loop(h, residual.clone(), cos, sin) is None  # not this model's caches
    meta.decode_kernel = False  # a decode group on SDPA: the loop runs it through the same torch ops
    meta.plan = grouped.plan(meta, {None})
    with torch.inference_mode(), forward_context(ForwardContext(attn=meta, attn_backend=grouped, kv_caches=caches)):
        assert loop(h, residual.clone(), cos, sin) is not None
    with torch.inference_mode(), forward_context(ForwardContext(attn=meta, attn_backend=object(), kv_caches=caches)):
        assert loop(h, residual.clone(), cos, sin) is None  # a backend without a kernel plan


def test_models_with_other_layers_keep_the_python_loop():
    assert not _model("qwen3", torch.float32, False).use_cpu_layer_loop()  # per-head q/k norms
    unfused = _model("llama", torch.float32, False)
    unfused.model.fused_norms = False
    assert not unfused.use_cpu_layer_loop()


def test_the_loops_arguments_are_named_fields_checked_when_made():
    """The model's arguments (built once) and a step's (built per step) are C++ structures of named fields; the
    model's counts are checked when they are made, not at each step."""
    from orthrus_rag.layers.cpu_extension import kernels

    model = _model("llama", torch.float32, False)
    assert model.use_cpu_layer_loop()
    args = model.model.layer_loop._args
    assert (args.layers, args.heads, args.kv_heads, args.head_dim, args.intermediate, args.packed) == (3, 4, 2, 32,
                                                                                                       96, False)
    k = kernels()
    with pytest.raises(TypeError):
        k.LayerLoopStep(torch.zeros(1, dtype=torch.long))  # NOTE: keywords only
    shape = dict(eps=[1e-5] * 6, windows=[-1] * 3, heads=4, kv_heads=2, head_dim=32, intermediate=96, scale=1.0)
    with pytest.raises(RuntimeError, match="weights and two eps per layer"):
        k.LayerLoopModel(weights=[torch.empty(0)] * 29, **shape)
    with pytest.raises(RuntimeError, match="adapter arguments"):  # an entry count for 11 of the 12 projections
        k.LayerLoopModel(weights=[torch.empty(0)] * 30, adapter_ints=[0] * 11, **shape)
    with pytest.raises(RuntimeError, match="adapter arguments left over"):
        k.LayerLoopModel(weights=[torch.empty(0)] * 30, adapter_ints=[0] * 13, **shape)


def test_a_repacked_layer_is_gathered_again_on_refresh():
    model = _model("llama", torch.bfloat16 if PACKED_BF16 else torch.float32, True)
    assert model.use_cpu_layer_loop()
    spy = model.model.layer_loop = Spy(model.model.layer_loop)
    before, _ = _steps(model, STEPS[:1], False)  # on the weights the loop gathered when it was made
    down = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight.mul_(-1)
    pack_module(down)
    spy.loop.refresh()  # NOTE: whoever packs after the loop exists gathers its arguments again
    got, _ = _steps(model, STEPS[:1], False)
    assert spy.taken == 2
    model.model.layer_loop = None
    want, _ = _steps(model, STEPS[:1], False)
    assert torch.equal(got[0], want[0]) and not torch.equal(got[0], before[0])


def test_the_engine_switch_and_its_tokens(smol_path, smol_tokenizer):
    from orthrus_rag import Engine
    from tests.conftest import SMOL, engine_overrides

    on = Engine.from_pretrained(SMOL, **engine_overrides(dtype="bfloat16"))
    off = Engine.from_pretrained(SMOL, **engine_overrides(dtype="bfloat16", kernel_overrides={"layers": "fused"}))
    assert on.runner.model.model.layer_loop is not None and off.runner.model.model.layer_loop is None
    spy = on.runner.model.model.layer_loop = Spy(on.runner.model.model.layer_loop)
    # NOTE: longer than the test budget (64 tokens): chunks after cached prefixes, beside the other's decodes
    assert_same_greedy_tokens(on, off, smol_tokenizer, repeat=6, max_tokens=12)
    assert spy.taken > 0


def assert_same_greedy_tokens(on, off, tokenizer, repeat: int, max_tokens: int) -> None:
    """Two engines' greedy tokens for a long prompt (a sentence `repeat` times) beside a short one are the same."""
    from orthrus_rag.params import SamplingParams

    prompts = [tokenizer("Rivers begin in the mountains, where rain and snow")["input_ids"] * repeat,
               tokenizer("The capital of France is")["input_ids"]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    assert [list(r.token_ids) for r in got] == [list(r.token_ids) for r in want]


def test_the_shipped_adapters_rows_take_the_loop_and_its_embeddings(smol_path):
    """`model=smollm2_backbone` in bf16: embedding rows under the shipped adapter run in the C++ loop (through the
    LoRA kernel) and embed as the Python loop of the same kernels does, bit for bit; generations beside them too."""
    from orthrus_rag import Engine, PoolingParams
    from orthrus_rag.params import SamplingParams
    from tests.conftest import SMOL, engine_overrides

    kw = dict(embedding_adapters="smollm2_embed", dtype="bfloat16")
    on = Engine.from_pretrained(SMOL, **engine_overrides(**kw))
    off = Engine.from_pretrained(SMOL, **engine_overrides(**kw, kernel_overrides={"layers": "fused"}))
    lora = [m for m in on.runner.model.modules() if hasattr(m, "cpu_kernel")]
    assert lora and all(m.cpu_kernel for m in lora)
    spy = on.runner.model.model.layer_loop = Spy(on.runner.model.model.layer_loop)
    texts = ["Rivers begin in the mountains, where rain and snow collect.", "Paris is the capital of France."]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    pooling = PoolingParams(input_type="document")
    got_gen, got_emb = on.run([[1, 2, 3, 4]], params, texts, pooling)
    want_gen, want_emb = off.run([[1, 2, 3, 4]], params, texts, pooling)
    # NOTE: without the bf16 prefill kernel (AVX2; AMX without the kernel's AMX body), chunk steps keep the Python loop:
    # decodes take it
    assert spy.taken > 0 and (spy.left == 0 or not cpu_prefill.prefill_kernel_available(torch.bfloat16, 64))
    assert any(s.num_adapter_embed_rows for s in on.step_stats)
    for g, w in zip(got_emb, want_emb):
        assert torch.equal(g.embedding, w.embedding)
    assert got_gen[0].token_ids == want_gen[0].token_ids
