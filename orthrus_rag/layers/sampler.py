"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds (vLLM semantics)."""

from __future__ import annotations

import torch

from orthrus_rag.params import SamplingParams


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


class Sampler:
    """Turns a step's last-position logits into one token id per request.

    Temperature, top-k and top-p are applied to all rows at once; only the draw itself runs per row for
    seeded requests, so a seeded request's tokens do not depend on what else is in the batch.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """logits [n, V] (any float dtype) -> token ids [n] (long)."""
        assert logits.dim() == 2 and logits.size(0) == len(params) == len(generators)
        logits = logits.float()
        # NOTE: greedy rows must be exactly torch.argmax of the row (parity with transformers' greedy search)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return token_ids
        rows = torch.tensor(random_rows, device=logits.device)
        probs = self._probs([params[i] for i in random_rows], logits[rows])
        sampled = self._draw(probs, [generators[i] for i in random_rows])
        token_ids[rows] = sampled
        return token_ids

    @staticmethod
    def _probs(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled, top-k/top-p-filtered probabilities [m, V] for the non-greedy rows."""
        num_rows, vocab_size = logits.shape
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        logits = logits / temperatures.unsqueeze(1)
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        if all(k == vocab_size for k in top_ks) and all(p >= 1.0 for p in top_ps):
            return torch.softmax(logits, dim=-1)
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

    @staticmethod
    def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One multinomial draw per row; seeded rows draw alone from their own generator."""
        sampled = torch.empty(probs.size(0), dtype=torch.long, device=probs.device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            rows = torch.tensor(unseeded, device=probs.device)
            sampled[rows] = torch.multinomial(probs[rows], 1).squeeze(1)
        for i, generator in enumerate(generators):
            if generator is not None:
                sampled[i] = torch.multinomial(probs[i], 1, generator=generator).squeeze(0)
        return sampled
