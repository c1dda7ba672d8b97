"""Greedy parity the way vLLM's tests check it: identical up to the first divergence, which must be a
near-tie (each side's token in the other's top-2 with nearly equal logits)."""

from __future__ import annotations

import torch


def hf_greedy(hf_model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                       dtype=torch.long),
                                max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def check_greedy_close(hf_model: torch.nn.Module, prompt_ids: list[int], ours: list[int], ref: list[int],
                       tol: float = 1e-3) -> None:
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            with torch.inference_mode():
                logits = hf_model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1].float()
            top2 = torch.topk(logits, 2).indices.tolist()
            gap = abs(float(logits[ours[i]] - logits[ref[i]]))
            assert ours[i] in top2 and ref[i] in top2 and gap < tol, (
                f"diverged at output token {i}: ours {ours[i]} vs ref {ref[i]}, logit gap {gap:.2e}, top2 {top2}")
            return
    assert len(ours) == len(ref) or min(len(ours), len(ref)) == n, "length mismatch without divergence"
