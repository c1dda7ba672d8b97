"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds (vLLM semantics).

A sampled row draws one uniform u from its request's generator (or the global one, unseeded) and takes the token whose
cumulative-probability interval holds u: the inverse CDF, exact in distribution. `torch.multinomial`, which this
replaced, draws one exponential per vocabulary entry (its Gumbel-max fast path): ~20 ns each on an EPYC core, 55 ms a
step for 58 rows of SmolLM2's 49,152 tokens, as long as the model's own decode step (docs/design/cpu-kernels.md).
vLLM's CPU sampler fuses its own noise into one kernel for the same reason. On the CPU the draw is a C++ kernel
(layers/csrc/sampling.h: block sums, then one block's scan, all in fp64); elsewhere an fp64 cumsum and `searchsorted`
do the same.
"""

from __future__ import annotations

import logging

import torch

from orthrus_rag.layers.cpu_extension import kernels
from orthrus_rag.params import SamplingParams

logger = logging.getLogger(__name__)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator for a request, or None when the request is unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int,
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of `token_ids` [n] under the raw logits [n, V] (the distribution before temperature and
    filtering, as OpenAI and vLLM report it) and the `top_k` best per row; one log-softmax over the rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids[:, None]).squeeze(1).tolist()
    if top_k == 0:
        return chosen, [[] for _ in chosen]
    top = lp.topk(top_k, dim=-1)
    return chosen, [list(zip(ids, vals)) for ids, vals in zip(top.indices.tolist(), top.values.tolist())]


def hold_tokens(logits: torch.Tensor, held: dict[int, list[int]]) -> torch.Tensor:
    """`logits` [n, V] with each held row's tokens at -inf (a generation short of its `min_tokens` holds the tokens
    that would stop it: `SamplingParams.held_token_ids`). A copy: log-probabilities still read the model's own.
    Ids past the vocabulary are skipped (they are never sampled anyway)."""
    vocab = logits.size(1)
    rows = [r for r, ids in held.items() for t in ids if t < vocab]
    cols = [t for ids in held.values() for t in ids if t < vocab]
    if not rows:
        return logits
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return out


def uniforms(generators: list[torch.Generator | None], device: torch.device | str) -> torch.Tensor:
    """One fp64 uniform in [0, 1) per row: a seeded row's from its own generator (so its tokens do not depend on
    what else is in the batch), the others' from one call on the global generator."""
    u = torch.rand(len(generators), dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """Per row of probs [m, V] (non-negative, any scale), the token whose cumulative interval holds u * the row's
    mass; a token of zero probability is never drawn. A row with no positive mass (every token masked, or NaN)
    falls back to its argmax, with a warning, rather than failing the step's other rows."""
    k = kernels() if use_kernel and probs.device.type == "cpu" else None
    if k is not None:
        return _checked(k.sample_probs(probs.float().contiguous(), u.double()), probs)
    cdf = probs.double().cumsum(dim=-1)
    ids = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # NOTE: past the end only when the target rounded up to the total, or the row has no mass; a drawn token of
    # zero probability only if a parallel scan's (CUDA) roundings left its step of the CDF not quite flat
    ids = ids.clamp(max=probs.size(1) - 1)
    return _checked(torch.where(probs.gather(1, ids.unsqueeze(1)).squeeze(1) > 0, ids, -1), probs)


def sample_logits(logits: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf(softmax(logits / temperatures), u)` in one C++ pass per row that writes no probabilities
    (logits [m, V] fp32 on the CPU, -inf where masked; the kernels must be built)."""
    # NOTE: 1/T capped: a temperature under ~3e-39 would make it inf, and 0 * inf NaN for the top token
    inv_t = (1.0 / temperatures.double()).clamp(max=1e30).float().contiguous()
    return _checked(kernels().sample_logits(logits.contiguous(), inv_t, u.double()), logits)


def _checked(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The kernels' -1 (a row with no positive mass) as that row's argmax, logged."""
    missing = ids < 0
    if bool(missing.any()):
        logger.warning("%d sampled row(s) had no positive probability; took their argmax", int(missing.sum()))
        ids = torch.where(missing, weights.argmax(dim=-1), ids)
    return ids


class Sampler:
    """Turns a step's last-position logits into one token id per request.

    Temperature, top-k and top-p are applied to all rows at once, and the draw too: each row takes one uniform,
    a seeded row's from its own generator, so a seeded request's tokens do not depend on what else is in the
    batch. `use_kernel`: the CPU draw in C++ (else torch's ops; same draws up to fp64 rounding).
    """

    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """logits [n, V] (any float dtype) -> token ids [n] (long)."""
        assert logits.dim() == 2 and logits.size(0) == len(params) == len(generators)
        logits = logits.float()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:  # NOTE: greedy rows are exactly torch.argmax of the row (transformers' greedy search)
            return self._argmax(logits)
        if len(random_rows) == len(params):  # the common serving case: no row gather, no argmax over the vocab
            return self._sample(params, logits, generators)
        token_ids = self._argmax(logits)
        rows = torch.tensor(random_rows, device=logits.device)
        token_ids[rows] = self._sample([params[i] for i in random_rows], logits[rows],
                                       [generators[i] for i in random_rows])
        return token_ids

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(dim=-1)`, bit for bit; on the CPU a C++ pass per row. torch's CPU argmax runs ~15x
        slower than its max over the same rows: 1.5-2 ms of a 32-row decode step over SmolLM2's vocabulary,
        against 0.3 ms here."""
        k = kernels() if self.use_kernel and logits.device.type == "cpu" and logits.size(1) > 0 else None
        return k.argmax_rows(logits.contiguous()) if k is not None else logits.argmax(dim=-1)

    def _sample(self, params: list[SamplingParams], logits: torch.Tensor,
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Token ids [m] for the non-greedy rows: temperature, the filters, one draw each. Each row's path depends
        on its own parameters only (rows without top-k / top-p always take the fused kernel on the CPU), so a
        seeded request's tokens do not depend on its neighbours' filters either."""
        u = uniforms(generators, logits.device)
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        vocab_size = logits.size(1)
        filtered = [i for i, p in enumerate(params) if _filters(p, vocab_size)]
        if not filtered:
            return self._plain(logits, temperatures, u)
        if len(filtered) == len(params):
            return inverse_cdf(self._probs(params, logits / temperatures.unsqueeze(1)), u, self.use_kernel)
        plain = sorted(set(range(len(params))) - set(filtered))
        ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
        f, p = torch.tensor(filtered, device=logits.device), torch.tensor(plain, device=logits.device)
        ids[p] = self._plain(logits[p], temperatures[p], u[p])
        ids[f] = inverse_cdf(self._probs([params[i] for i in filtered], logits[f] / temperatures[f].unsqueeze(1)),
                             u[f], self.use_kernel)
        return ids

    def _plain(self, logits: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Rows at temperature only: the fused kernel on the CPU (one pass, no [m, V] temporaries), else softmax."""
        if self.use_kernel and logits.device.type == "cpu" and kernels() is not None:
            return sample_logits(logits, temperatures, u)
        return inverse_cdf(torch.softmax(logits / temperatures.unsqueeze(1), dim=-1), u, self.use_kernel)

    @staticmethod
    def _probs(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
        """Top-k/top-p-filtered probabilities [m, V] of temperature-scaled logits."""
        num_rows, vocab_size = logits.shape
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        positions = torch.arange(vocab_size, device=logits.device).expand(num_rows, vocab_size)
        # top-k: drop every sorted position at or past k
        k = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
        drop = positions >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        # top-p: keep the smallest prefix whose mass reaches top_p, i.e. drop a token when the mass strictly
        # before it already reaches top_p; the top token has zero mass before it, so it is always kept
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_ps, dtype=torch.float32, device=logits.device).unsqueeze(1)
        drop |= (mass_before >= p) & (p < 1.0)
        drop[:, 0] = False
        mask = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
        return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a row restricts its support by top-k or top-p."""
    return 0 < params.top_k < vocab_size or params.top_p < 1.0
