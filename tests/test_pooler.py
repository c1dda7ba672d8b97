"""Incremental poolers: chunked updates equal pooling the whole sequence, and pool_whole equals the formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orthrus_rag.layers.pooler import PoolerState, make_pooler_state, pool_whole
from orthrus_rag.params import POOLING_TYPES, PoolingParams

DIM = 64
LENGTHS = (1, 5, 300, 1024)
CHUNKS = (1, 7, 16, 64, 256)


def _hidden(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # an offset keeps the mean away from zero, so normalisation is well conditioned
    return (torch.randn(n, DIM, generator=g) + 0.5).to(dtype)


def _run_chunked(hidden: torch.Tensor, params: PoolingParams, sizes) -> torch.Tensor:
    """Feed `hidden` to a fresh state in chunks of the given sizes (cycled), then finish."""
    n = hidden.shape[0]
    state = make_pooler_state(params, n)
    start, i = 0, 0
    while start < n:
        end = min(n, start + sizes[i % len(sizes)])
        state.update(hidden[start:end], torch.arange(start, end, dtype=torch.long))
        start, i = end, i + 1
    return state.finish()


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cos >= 0.99999, f"cosine {cos}"
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_chunked_equals_whole(pooling: str, n: int, chunk: int, normalize: bool) -> None:
    hidden = _hidden(n, seed=n * 1000 + chunk)
    params = PoolingParams(pooling=pooling, normalize=normalize)
    want = pool_whole(hidden, params)
    _assert_close(_run_chunked(hidden, params, [chunk]), want)
    assert want.shape == ((n, DIM) if pooling == "all" else (DIM,))


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_uneven_chunks(pooling: str) -> None:
    """Chunk boundaries that vary step to step (as a token budget hands them out)."""
    hidden = _hidden(1000, seed=7)
    params = PoolingParams(pooling=pooling)
    _assert_close(_run_chunked(hidden, params, [3, 250, 1, 97, 64, 400]), pool_whole(hidden, params))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk", (1, 7, 64))
@pytest.mark.parametrize("n", (1, 5, 300))
def test_caller_weights(n: int, chunk: int, normalize: bool) -> None:
    hidden = _hidden(n, seed=n + chunk)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(n)).add(0.1).tolist()
    params = PoolingParams(pooling="weighted_mean", normalize=normalize, weights=weights)
    w = torch.tensor(weights)
    want = (hidden * w[:, None]).sum(0) / w.sum()
    if normalize:
        want = want / want.norm()
    _assert_close(pool_whole(hidden, params), want)
    _assert_close(_run_chunked(hidden, params, [chunk]), want)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chunk", (1, 16, 256))
def test_head_for_all(chunk: int, normalize: bool) -> None:
    hidden = _hidden(300, seed=3)
    proj = torch.randn(DIM, 32, generator=torch.Generator().manual_seed(1))

    def head(rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(rows @ proj).max(0).values  # a deterministic [n, d] -> [32] head

    params = PoolingParams(pooling="all", normalize=normalize, head=head)
    want = head(hidden)
    if normalize:
        want = want / want.norm()
    _assert_close(pool_whole(hidden, params), want)
    _assert_close(_run_chunked(hidden, params, [chunk]), want)


def test_pool_whole_formulas() -> None:
    """pool_whole against explicit formulas, so the chunked tests compare with something right."""
    n = 37
    hidden = _hidden(n, seed=11)
    raw = {p: pool_whole(hidden, PoolingParams(pooling=p, normalize=False)) for p in POOLING_TYPES}
    t = torch.arange(1, n + 1, dtype=torch.float32)
    torch.testing.assert_close(raw["mean"], hidden.mean(0))
    torch.testing.assert_close(raw["weighted_mean"], (t[:, None] * hidden).sum(0) / (n * (n + 1) / 2))
    torch.testing.assert_close(raw["cls"], hidden[0])
    torch.testing.assert_close(raw["first"], hidden[0])
    torch.testing.assert_close(raw["last"], hidden[n - 1])
    torch.testing.assert_close(raw["all"], hidden)
    for p in POOLING_TYPES:
        unit = pool_whole(hidden, PoolingParams(pooling=p, normalize=True))
        torch.testing.assert_close(unit, raw[p] / raw[p].norm(dim=-1, keepdim=True))
        torch.testing.assert_close(unit.norm(dim=-1), torch.ones_like(unit.norm(dim=-1)))


def test_weights_length_mismatch_raises() -> None:
    params = PoolingParams(pooling="weighted_mean", weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="3 pooling weights for 4 tokens"):
        make_pooler_state(params, 4)
    with pytest.raises(ValueError, match="3 pooling weights for 2 tokens"):
        pool_whole(_hidden(2), params)


def test_finish_before_all_tokens_raises() -> None:
    state = make_pooler_state(PoolingParams(pooling="mean"), 10)
    state.update(_hidden(4), torch.arange(4))
    with pytest.raises(RuntimeError, match="4 of 10"):
        state.finish()


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_low_precision_input_gives_float32(pooling: str) -> None:
    hidden = _hidden(300, seed=5, dtype=torch.bfloat16)
    params = PoolingParams(pooling=pooling)
    got = _run_chunked(hidden, params, [16])
    _assert_close(got, pool_whole(hidden.float(), params))


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_reused_runner_buffer(pooling: str) -> None:
    """The runner may pass views of one buffer that it overwrites next step; the state must not alias it."""
    hidden = _hidden(40, seed=9)
    params = PoolingParams(pooling=pooling, normalize=False)
    state = make_pooler_state(params, 40)
    buf = torch.empty(8, DIM)
    for start in range(0, 40, 8):
        buf.copy_(hidden[start : start + 8])
        state.update(buf, torch.arange(start, start + 8))
    buf.fill_(float("nan"))
    _assert_close(state.finish(), pool_whole(hidden, params))


@pytest.mark.parametrize("pooling", [p for p in POOLING_TYPES if p != "all"])
def test_memory_is_o_d(pooling: str) -> None:
    """Only 'all' may keep per-token state; the others hold at most a few [d] tensors."""
    n = 512
    state: PoolerState = make_pooler_state(PoolingParams(pooling=pooling), n)
    hidden = _hidden(n)
    for start in range(0, n, 64):
        state.update(hidden[start : start + 64], torch.arange(start, start + 64))
    held = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    assert held and all(v.numel() <= DIM for v in held)
