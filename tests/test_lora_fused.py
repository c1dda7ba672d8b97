"""The CPU LoRA kernel (layers/lora_fused.py, csrc/lora.h): against float64 arithmetic, on its rows only, and as
LoRALinear and the fused projections call it, beside torch's per-slot ops."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from orthrus_rag.layers import cpu_elementwise
from orthrus_rag.layers.context import ForwardContext, forward_context
from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.layers.lora import LoRAAdapter, attach_adapters, set_lora_kernel, use_cpu_lora_kernel
from orthrus_rag.layers.lora_fused import _b_operand
from orthrus_rag.models.llama import CausalLM

# NOTE: the extension builds on first use (a minute on a fresh machine): not part of the fast subset
pytestmark = [pytest.mark.slow, pytest.mark.isa]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    if not cpu_elementwise.available(torch.float32):
        pytest.fail("the CPU extension did not build (a compiler and ninja are installed with the project)")


@pytest.mark.parametrize("dtype,pairs", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("width", [64, 40])  # 40: not the vdpbf16ps path's multiple of 32, nor of 16
def test_the_kernel_adds_each_parts_update_to_its_rows_only(dtype, pairs, width):
    """`pairs`: B in bf16 pairs (the AVX512-BF16 products, where this build has them), h rounded to bf16."""
    if pairs and not kernels().lora_bf16_pairs():
        pytest.skip("this CPU has no AVX512-BF16: the kernel takes B in fp32 only (the other cases)")
    torch.manual_seed(0)
    x = torch.randn(10, width, dtype=dtype)
    wide = torch.randn(10, 120, dtype=dtype)
    y = wide[:, 8:104]  # a view with strided rows, as a fused projection's output seen through a slice
    # two parts: rank 4 (A's rows 0-3), rank 8 (rows 4-11); A in fp32, and in bf16 too for bf16 rows (as LoRAGroup
    # passes it); the factors hold values of the rows' dtype
    a = torch.randn(12, width).to(dtype).float()
    a16 = a.bfloat16() if dtype == torch.bfloat16 else torch.empty(0, dtype=torch.bfloat16)
    b1, b2 = torch.randn(32, 4).to(dtype), torch.randn(46, 8).to(dtype)
    rows = torch.tensor([7, 1, 3])
    want = y.double().clone()
    h = x.double()[rows] @ a.double().T * 0.5
    want[rows, 0:32] += h[:, 0:4] @ b1.double().T
    want[rows, 50:96] += h[:, 4:12] @ b2.double().T
    before = wide.clone()
    kernels().lora_add(x, y, rows, a, a16, [_b_operand(b1, pairs), _b_operand(b2, pairs)], [0, 50], [0, 4], 0.5)
    # fp32 sums, one rounding to the output's dtype (and h's rounding to bf16 in pairs)
    size = want.abs().clone()
    size[rows, 0:32] += h[:, 0:4].abs() @ b1.double().abs().T
    size[rows, 50:96] += h[:, 4:12].abs() @ b2.double().abs().T
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert ((y.double() - want).abs() <= tol * size.clamp(min=1)).all()
    others = [i for i in range(10) if i not in (1, 3, 7)]
    assert torch.equal(wide[others], before[others])  # other rows
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 104:], before[:, 104:])  # outside y
    assert torch.equal(y[rows, 32:50], before[rows, 40:58])  # columns no part covers
    assert not torch.equal(y[rows, :32], before[rows, 8:40])


@pytest.mark.parametrize("rank", [3, 130])
def test_odd_and_wide_ranks_keep_b_in_fp32_beside_a_pairs_part_with_a_long_tail(rank):
    """bf16 rows: a part of rank 3 (odd) or 130 (past the pairs path's 128) takes B in fp32, beside a rank-8 part in
    bf16 pairs whose 50 columns end in an 18-column tail (the second masked load)."""
    pairs = bool(kernels().lora_bf16_pairs())
    torch.manual_seed(3)
    x, y = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(6, 100, dtype=torch.bfloat16)
    a = torch.randn(rank + 8, 64).bfloat16().float()
    b1, b2 = torch.randn(50, rank).bfloat16(), torch.randn(50, 8).bfloat16()
    ops = [_b_operand(b1, pairs), _b_operand(b2, pairs)]
    assert ops[0].dim() == 2 and ops[0].dtype == torch.float32 and ops[1].dim() == (3 if pairs else 2)
    rows = torch.tensor([5, 0, 2])
    want = y.double().clone()
    h = x.double()[rows] @ a.double().T * 0.25
    want[rows, :50] += h[:, :rank] @ b1.double().T
    want[rows, 50:] += h[:, rank:] @ b2.double().T
    size = want.abs().clone()
    size[rows, :50] += h[:, :rank].abs() @ b1.double().abs().T
    size[rows, 50:] += h[:, rank:].abs() @ b2.double().abs().T
    got = y.clone()
    kernels().lora_add(x, got, rows, a, a.bfloat16(), ops, [0, 50], [0, rank], 0.25)
    assert ((got.double() - want).abs() <= 2 ** -8 * size.clamp(min=1)).all()
    assert torch.equal(got[[1, 3, 4]], y[[1, 3, 4]])


def test_the_kernel_names_bad_arguments():
    x, y, a, bt = torch.randn(4, 16), torch.randn(4, 8), torch.randn(2, 16), torch.randn(2, 8)
    E = torch.empty(0, dtype=torch.bfloat16)  # noqa: N806 (no bf16 copy of A)
    with pytest.raises(RuntimeError, match="row 4 outside"):
        kernels().lora_add(x, y, torch.tensor([4]), a, E, [bt], [0], [0], 1.0)
    with pytest.raises(RuntimeError, match="x and y of one dtype"):
        kernels().lora_add(x, y.bfloat16(), torch.tensor([0]), a, E, [bt], [0], [0], 1.0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels().lora_add(x.bfloat16(), y.bfloat16(), torch.tensor([0]), a.bfloat16(), E, [bt], [0], [0], 1.0)
    with pytest.raises(RuntimeError, match="part 0 does not fit"):
        kernels().lora_add(x, y, torch.tensor([0]), a, E, [bt], [1], [0], 1.0)  # 8 columns from column 1 of 8
    with pytest.raises(RuntimeError, match="A \\[R, in\\]"):
        kernels().lora_add(x, y, torch.tensor([0]), a[:, :8], E, [bt], [0], [0], 1.0)
    with pytest.raises(RuntimeError, match="A in bf16 of A's shape"):
        kernels().lora_add(x, y, torch.tensor([0]), a, a[:1].bfloat16(), [bt], [0], [0], 1.0)


def _model(dtype: torch.dtype, rounded_to: torch.dtype | None = None) -> CausalLM:
    """A 2-layer Llama with two adapters of other ranks and targets (fused as the engine loads it); `rounded_to`:
    every weight and factor rounded through that dtype first (a float64 copy of a bf16 model)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = CausalLM(config).eval().to(rounded_to or dtype).to(dtype)
    model.fuse_projections()
    modules = dict(model.named_modules())
    adapters = []
    for name, rank, targets in (("a", 4, ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
                                          "mlp.up_proj", "mlp.down_proj")),
                                ("b", 8, ("self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"))):
        names = [f"model.layers.{i}.{m}" for i in range(2) for m in targets]
        factors = {n: (0.3 * torch.randn(rank, modules[n].in_features), 0.3 * torch.randn(modules[n].out_features,
                                                                                          rank)) for n in names}
        factors = {n: tuple(t.to(rounded_to or dtype).to(dtype) for t in ab) for n, ab in factors.items()}
        adapters.append(LoRAAdapter(name, rank, 2.0 / rank, factors))
    attach_adapters(model, adapters)
    return model


def _projections(model: CausalLM, x: torch.Tensor, lora_rows) -> list[torch.Tensor]:
    """Every adapted projection of layer 0 on `x` (Q/K/V and gate/up through their fusions, O and down alone)."""
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    with torch.inference_mode(), forward_context(ForwardContext(lora_rows=lora_rows)):
        qkv = att.fusions["qkv"](att, x)
        gate_up = mlp.fusions["gate_up"](mlp, x)
        o = att.o_proj(x)
        down = mlp.down_proj(torch.cat([x, x[:, :32]], dim=1))
    return [*qkv, *gate_up, o, down]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_and_single_layers_on_the_kernel_match_torchs_ops(dtype):
    """Two adapters of other ranks and targets, and base rows, in one call: the kernel's outputs are torch's per-slot
    ones within a rounding, base rows bit for bit; in bf16 the kernel is the closer to float64 arithmetic."""
    model = _model(dtype)
    torch.manual_seed(1)
    x = torch.randn(9, 64).to(dtype)
    lora_rows = [(1, torch.tensor([0, 1, 2, 3])), (2, torch.tensor([6, 7]))]  # rows 4, 5, 8: the base weights
    set_lora_kernel(model, "per_slot")
    torch_ops = _projections(model, x, lora_rows)
    set_lora_kernel(model, "auto")
    for got, want in zip(_projections(model, x, lora_rows), torch_ops):
        assert torch.equal(got, want)  # `auto` without the switch: torch's ops (per-slot, for two adapters)
    assert use_cpu_lora_kernel(model) == 14  # 7 projections of 2 layers carry an adapter
    kernel = _projections(model, x, lora_rows)
    reference = _projections(_model(torch.float64, rounded_to=dtype), x.double(), lora_rows)
    base = [4, 5, 8]
    for got, want in zip(kernel, torch_ops):
        assert torch.equal(got[base], want[base])
        assert not torch.equal(got, want) or dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 0.05, rtol=1e-2)
    if dtype == torch.bfloat16:  # torch's ops round h, the update and the sum; the kernel rounds once
        err = sum((g.double() - e).abs().sum() for g, e in zip(kernel, reference))
        err_torch = sum((w.double() - e).abs().sum() for w, e in zip(torch_ops, reference))
        assert err < err_torch
    use_cpu_lora_kernel(model, enabled=False)  # the switch off again: torch's ops, bit for bit as before
    for got, want in zip(_projections(model, x, lora_rows), torch_ops):
        assert torch.equal(got, want)


def test_an_adapter_attached_later_is_seen():
    """Cached per projection, the kernel's arguments are rebuilt when adapters change."""
    model = _model(torch.float32)
    use_cpu_lora_kernel(model)
    x = torch.randn(3, 64)
    rows = [(3, torch.tensor([0, 1]))]
    before = _projections(model, x, rows)  # no adapter in slot 3 yet: base outputs
    name = "model.layers.0.self_attn.k_proj"
    attach_adapters(model, [LoRAAdapter("c", 2, 1.0, {name: (torch.randn(2, 64), torch.randn(32, 2))})])
    lm = "lm_head"  # a projection no adapter wrapped before: its new wrapper takes the model's settings
    set_lora_kernel(model, "per_slot")
    attach_adapters(model, [LoRAAdapter("d", 2, 1.0, {lm: (torch.randn(2, 64), torch.randn(64, 2))})])
    assert model.lm_head.kernel == "per_slot" and model.lm_head.cpu_kernel
    set_lora_kernel(model, "auto")
    after = _projections(model, x, rows)
    assert not torch.equal(after[1][:2], before[1][:2]) and torch.equal(after[1][2], before[1][2])
    assert torch.equal(after[0], before[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_split_over_threads_give_the_same_bits(dtype):
    """An embedding chunk's hundreds of adapter rows run in parallel blocks: the same bits as on one thread (a row's
    sums never depend on the split), near float64 arithmetic."""
    torch.manual_seed(2)
    x = torch.randn(301, 576).to(dtype)
    y0 = torch.randn(301, 960).to(dtype)
    a = torch.randn(24, 576).to(dtype).float() * 0.05
    a16 = a.bfloat16() if dtype == torch.bfloat16 else torch.empty(0, dtype=torch.bfloat16)
    pairs = dtype == torch.bfloat16 and bool(kernels().lora_bf16_pairs())
    bs = [torch.randn(o, 8).to(dtype) * 0.05 for o in (576, 192, 192)]
    rows = torch.arange(300, -1, -1)[::2].contiguous()  # every other row, in reverse
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = y0.clone()
            kernels().lora_add(x, y, rows, a, a16, [_b_operand(b, pairs) for b in bs], [0, 576, 768], [0, 8, 16], 2.0)
            outs.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    h = x.double()[rows] @ a.double().T * 2.0
    want = y0.double().clone()
    for i, (b, start) in enumerate(zip(bs, (0, 576, 768))):
        want[rows, start:start + b.shape[0]] += h[:, 8 * i:8 * i + 8] @ b.double().T
    torch.testing.assert_close(outs[0].double(), want, atol=1e-4 if dtype == torch.float32 else 0.05, rtol=1e-2)
    assert torch.equal(outs[0][1::2], y0[1::2])
