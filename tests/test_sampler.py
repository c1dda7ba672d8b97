"""Sampler contracts: greedy is argmax, filters collapse to argmax, seeds reproduce, frequencies match, the C++ and
torch draws agree."""

from __future__ import annotations

import logging

import pytest
import torch

from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.layers.sampler import Sampler, inverse_cdf, make_generator, sample_logits
from orthrus_rag.params import SamplingParams

pytestmark = pytest.mark.isa  # make test runs this file again under ORTHRUS_CPU_ISA=avx2

VOCAB = 50


def _logits(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, VOCAB, generator=g) * 3).to(dtype)


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(7), make_generator(7)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_greedy_equals_argmax() -> None:
    """temperature 0 returns exactly torch.argmax of each row, for any float dtype."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = _logits(8, dtype=dtype)
        out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
        assert out.dtype == torch.long and out.shape == (8,)
        assert torch.equal(out, torch.argmax(logits, dim=-1))


def test_top_k_one_is_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.1, 0.5, 1.0, 2.0, 10.0, 100.0)]
    out = Sampler()(logits, params, [None] * 6)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_tiny_top_p_is_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=t, top_p=1e-6) for t in (0.1, 0.5, 1.0, 2.0, 10.0, 100.0)]
    out = Sampler()(logits, params, [make_generator(i) if i % 2 else None for i in range(6)])
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_and_top_p_restrict_support() -> None:
    """Sampled tokens always lie in the top-k set, and in the nucleus for top_p."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 4]))
    logits = logits.expand(200, -1).contiguous()
    out_k = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=2)] * 200, [None] * 200)
    assert set(out_k.tolist()) <= {0, 1}
    # mass of {0, 1} is 0.8 >= 0.7, so the nucleus is exactly {0, 1}
    out_p = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 200, [None] * 200)
    assert set(out_p.tolist()) <= {0, 1}
    out_p = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=0.81)] * 200, [None] * 200)
    assert set(out_p.tolist()) <= {0, 1, 2} and 2 in out_p.tolist()


def _seeded_run(logits: torch.Tensor, params: list[SamplingParams], steps: int,
                sampler: Sampler | None = None) -> list[list[int]]:
    sampler = sampler or Sampler()
    generators = [make_generator(p.seed) for p in params]
    return [sampler(logits, params, generators).tolist() for _ in range(steps)]


def test_seeded_reproducible_and_batch_independent() -> None:
    """Same seed => same tokens across runs, whatever other rows share the batch."""
    logits = _logits(4)
    target = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=1234)
    alone = [row[0] for row in _seeded_run(logits[:1], [target], steps=20)]
    assert alone == [row[0] for row in _seeded_run(logits[:1], [target], steps=20)]
    # the same row last in a mixed batch: greedy, unseeded, and another seeded neighbour
    mixed_logits = torch.cat([_logits(3, seed=9), logits[:1]])
    mixed_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.5, seed=99),
        target,
    ]
    mixed = [row[3] for row in _seeded_run(mixed_logits, mixed_params, steps=20)]
    assert mixed == alone
    assert len(set(alone)) > 1  # it really sampled


def test_distribution_matches_probabilities() -> None:
    """A 2-token vocabulary with p = (0.3, 0.7): seeded sample frequencies within tolerance."""
    probs = torch.tensor([0.3, 0.7])
    n = 4000
    logits = torch.log(probs).expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    out = Sampler()(logits, params, [make_generator(p.seed) for p in params])
    freq = out.float().mean().item()  # share of token 1
    assert abs(freq - 0.7) < 0.03  # ~4.1 sigma
    # temperature 2 flattens: p1 = 0.7^0.5 / (0.3^0.5 + 0.7^0.5)
    expected = (0.7**0.5) / (0.3**0.5 + 0.7**0.5)
    params = [SamplingParams(temperature=2.0)] * n
    out = Sampler()(logits, params, [None] * n)
    assert abs(out.float().mean().item() - expected) < 0.03


def test_unseeded_sampling_varies() -> None:
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler()
    tokens = {sampler(logits, [SamplingParams(temperature=1.0)], [None]).item() for _ in range(20)}
    assert len(tokens) > 1


# The draw: one uniform per row through the inverse CDF, in C++ on the CPU (layers/csrc/sampling.h) or in
# torch's ops; both must pick the same tokens, never a zero-probability one, at any vocabulary size.
BIG_VOCAB = 49152  # SmolLM2's: 192 blocks of the kernel's 256


@pytest.fixture
def cpu_kernels() -> None:
    if kernels() is None:
        pytest.skip("the CPU extension cannot be built here (no C++ compiler or ninja)")


def _big_logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, BIG_VOCAB, generator=g) * 3


def test_kernel_and_torch_draws_agree(cpu_kernels: None) -> None:
    """Same uniforms, same tokens: the probabilities' kernel exactly, the fused logits kernel up to exp roundings."""
    logits = _big_logits(64)
    temperatures = torch.linspace(0.3, 2.0, 64)
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    reference = inverse_cdf(probs, u, use_kernel=False)
    assert torch.equal(inverse_cdf(probs, u, use_kernel=True), reference)
    fused = sample_logits(logits, temperatures, u)
    assert (fused == reference).float().mean().item() >= 0.95
    assert len(set(reference.tolist())) > 32  # really spread over the vocabulary


def test_greedy_kernel_is_torch_argmax_bit_for_bit(cpu_kernels: None) -> None:
    """First index of the max; a NaN is the max (the first one); -0.0 ties +0.0; all -inf rows take index 0."""
    inf, nan = float("inf"), float("nan")
    rows = [[-inf] * 5, [-0.0, 0.0, -1.0], [-1.0, -0.0, 0.0], [1.0, nan, 2.0, nan], [-nan, 1.0], [3.0, 3.0, 1.0],
            [inf, inf, 1.0], [-5.0, -3.0, -3.0, -7.0], [1e-45, 0.0], [-1e-45, -0.0], [-inf, -3e38, -inf]]
    greedy = Sampler(use_kernel=True)
    for row in rows:
        x = torch.tensor([row])
        assert greedy._argmax(x).tolist() == x.argmax(dim=-1).tolist(), row
    logits = _big_logits(33)
    logits[5, 100:200] = logits[5].max()  # a tie over many entries: the first
    assert torch.equal(greedy(logits, [SamplingParams(temperature=0.0)] * 33, [None] * 33), logits.argmax(dim=-1))
    # greedy rows beside sampled ones: the argmax of all rows, then the sampled rows drawn over it
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(33)]
    out = greedy(logits, mixed, [make_generator(i) for i in range(33)])
    assert torch.equal(out[1::2], logits.argmax(dim=-1)[1::2])
    assert not torch.equal(out[0::2], logits.argmax(dim=-1)[0::2])


def test_inverse_cdf_boundaries() -> None:
    """u picks the token whose interval [cdf before, cdf) holds u * mass; zero-mass tokens never, at u = 0 or ~1."""
    probs = torch.zeros(1, BIG_VOCAB)
    probs[0, [0, 255, 256, BIG_VOCAB - 2]] = torch.tensor([0.25, 0.25, 0.3, 0.2])  # block edges, not the last id
    cases = {0.0: 0, 0.2499: 0, 0.2501: 255, 0.4999: 255, 0.5001: 256, 0.7999: 256, 0.8001: BIG_VOCAB - 2,
             1.0 - 2.0**-53: BIG_VOCAB - 2}
    for use_kernel in (True, False):
        for u, expected in cases.items():
            got = inverse_cdf(probs, torch.tensor([u], dtype=torch.float64), use_kernel).item()
            assert got == expected, (use_kernel, u, got)
        # an unnormalised row (any scale) draws the same
        got = inverse_cdf(probs * 7.0, torch.tensor([0.6], dtype=torch.float64), use_kernel).item()
        assert got == 256


def test_fused_draw_never_takes_masked_tokens(cpu_kernels: None) -> None:
    logits = _big_logits(16, seed=3)
    logits[:, 1::2] = float("-inf")  # a grammar's mask: every odd id
    temperatures = torch.full((16,), 0.7)
    for u in (0.0, 0.5, 1.0 - 2.0**-53):
        ids = sample_logits(logits, temperatures, torch.full((16,), u, dtype=torch.float64))
        assert bool((ids % 2 == 0).all()), u
    # a temperature so small that 1/T overflows fp32 is still the top token, not NaN's arbitrary pick
    ids = sample_logits(logits, torch.full((16,), 1e-39), torch.full((16,), 0.5, dtype=torch.float64))
    assert torch.equal(ids, logits.argmax(dim=-1))


def test_seeded_row_ignores_its_neighbours_filters() -> None:
    """A seeded row without top-k / top-p draws the same tokens whether a neighbour filters or not."""
    logits = _big_logits(2, seed=6)
    target = SamplingParams(temperature=0.9, seed=42)
    plain = _seeded_run(logits, [target, SamplingParams(temperature=0.9, seed=7)], steps=10)
    filtered = _seeded_run(logits, [target, SamplingParams(temperature=0.9, top_p=0.8, seed=7)], steps=10)
    assert [row[0] for row in plain] == [row[0] for row in filtered]
    assert len({row[0] for row in plain}) > 1


def test_row_without_mass_falls_back_to_argmax(caplog: pytest.LogCaptureFixture) -> None:
    """A fully masked row takes its argmax with a warning; the other rows of the batch draw as usual."""
    logits = _big_logits(3, seed=4)
    logits[1] = float("-inf")
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    for use_kernel in (True, False):
        with caplog.at_level(logging.WARNING, logger="orthrus_rag.layers.sampler"):
            out = Sampler(use_kernel)(logits, params, [make_generator(p.seed) for p in params])
        assert "no positive probability" in caplog.text
        assert out[1].item() == 0
        expected = Sampler(use_kernel)(logits[[0, 2]], [params[0], params[2]],
                                       [make_generator(0), make_generator(2)])
        assert out[[0, 2]].tolist() == expected.tolist()
        caplog.clear()


def test_big_vocabulary_frequencies_and_paths_agree() -> None:
    """Three tokens in different blocks at p = (0.2, 0.3, 0.5): frequencies through the Sampler, and the kernel and
    torch paths give the same seeded tokens over a 49k vocabulary (temperature only, and with top-p)."""
    logits = torch.full((1, 2048), float("-inf"))  # 8 of the kernel's blocks
    logits[0, [10, 300, 2047]] = torch.log(torch.tensor([0.2, 0.3, 0.5]))
    n = 3000
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    out = Sampler()(logits.expand(n, -1), params, [make_generator(p.seed) for p in params])
    for token, p in ((10, 0.2), (300, 0.3), (2047, 0.5)):
        assert abs((out == token).float().mean().item() - p) < 0.03  # ~3.5-4.3 sigma
    rows = _big_logits(12, seed=5)
    for extra in ({}, {"top_p": 0.9}):
        params = [SamplingParams(temperature=0.8, seed=100 + i, **extra) for i in range(12)]
        a = _seeded_run(rows, params, steps=5, sampler=Sampler(use_kernel=True))
        b = _seeded_run(rows, params, steps=5, sampler=Sampler(use_kernel=False))
        assert sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) >= 0.95 * 60

