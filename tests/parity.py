"""Greedy parity the way vLLM's tests check it: identical up to the first divergence, which must be a
near-tie (each side's token in the other's top-2 with nearly equal logits); without a divergence, the same
number of tokens."""

from __future__ import annotations

import torch


def hf_greedy(hf_model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens for exactly `max_tokens` steps, EOS included and not stopping there (as the
    engine does under `ignore_eos`); `generate` would stop at EOS and leave only a prefix to compare."""
    tokens: list[int] = []
    dev = hf_model.device
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt_ids], device=dev), use_cache=True)
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == max_tokens:
                return tokens
            out = hf_model(torch.tensor([[tokens[-1]]], device=dev), past_key_values=out.past_key_values,
                           use_cache=True)


def check_greedy_close(hf_model: torch.nn.Module, prompt_ids: list[int], ours: list[int], ref: list[int],
                       tol: float = 1e-3, tol_std: float = 0.0) -> None:
    """`tol`: the largest logit gap of a near-tie; `tol_std` widens it to that fraction of the logits' standard
    deviation (bf16, whose rounding scales with the logits)."""
    for i in range(min(len(ours), len(ref))):
        if ours[i] != ref[i]:
            with torch.inference_mode():
                logits = hf_model(torch.tensor([prompt_ids + ref[:i]], device=hf_model.device)).logits[0, -1].float()
            top2 = torch.topk(logits, 2).indices.tolist()
            gap = abs(float(logits[ours[i]] - logits[ref[i]]))
            tol = max(tol, tol_std * float(logits.std()))
            assert ours[i] in top2 and ref[i] in top2 and gap < tol, (
                f"diverged at output token {i}: ours {ours[i]} vs ref {ref[i]}, logit gap {gap:.2e}, top2 {top2}")
            return
    assert len(ours) == len(ref), f"no divergence but lengths differ: {len(ours)} vs {len(ref)}"
