"""Greedy SmolLM2 generation through the engine equals transformers' generate."""

from __future__ import annotations

from orthrus_rag import SamplingParams
from tests.parity import check_greedy_close, hf_greedy
import pytest

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three fruits:",
    "Question: what is the boiling point of water at sea level in degrees Celsius?\nAnswer:",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
    " ".join(["The history of the printing press begins in the fifteenth century."] * 6),
    " ".join(f"Item {i}: a short note about number {i}." for i in range(20)),
]
MAX_TOKENS = 12


def test_greedy_matches_transformers_in_mixed_steps(engine, hf_smol, smol_tokenizer):
    prompt_ids = [smol_tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS), "prompts should have different lengths"
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    # the 64-token budget and 32-token chunks force steps where some prompts are mid-prefill while others decode
    steps = list(engine.step_stats)[-40:]
    # counted from what the forward carried: one forward with every planned prefill and decode row
    assert any(s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 and s.ran_as_scheduled for s in steps)
    for ids, out in zip(prompt_ids, outs):
        assert out.prompt_token_ids == ids
        assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length"
        check_greedy_close(hf_smol, ids, out.token_ids, hf_greedy(hf_smol, ids, MAX_TOKENS))
        assert out.text == smol_tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_and_text(engine):
    out = engine.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=20, temperature=0.0, stop=[" 6"]))[0]
    assert out.finish_reason == "stop"
    assert " 6" not in out.text


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    a = engine.generate(["Tell me a story"], params)[0]
    b = engine.generate(["Tell me a story", "Another prompt runs beside it"], params)[0]
    assert a.token_ids == b.token_ids


def test_logprobs_are_the_sampling_steps_raw_distribution(engine, hf_smol, smol_tokenizer):
    """`SamplingParams.logprobs`: each sampled token's log-probability and the top k, taken from the logits that
    sampled it, under the raw distribution (temperature does not change them), equal to transformers' forward
    over the same tokens; a greedy token is the top one."""
    import torch

    ids = smol_tokenizer("The capital of France is")["input_ids"]
    greedy, hot = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3), \
        SamplingParams(max_tokens=5, temperature=1.5, seed=11, logprobs=0)
    outs = [engine.generate([ids], p)[0] for p in (greedy, hot)]
    plain = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert plain.logprobs is None and outs[0].token_ids == plain.token_ids  # asking changes no token
    for out, k in zip(outs, (3, 0)):
        assert [x.token_id for x in out.logprobs] == out.token_ids
        with torch.no_grad():
            logits = hf_smol(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].float()
        want = torch.log_softmax(logits, dim=-1)
        for t, (x, row) in enumerate(zip(out.logprobs, want)):
            assert abs(x.logprob - row[x.token_id].item()) < 1e-3, t
            assert len(x.top) == k
            if k:
                assert [i for i, _ in x.top] == row.topk(k).indices.tolist()
                assert x.top[0][0] == x.token_id  # greedy took the best


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(engine, smol_tokenizer):
    """vLLM's `min_tokens`: the tokens that would end the output are masked out of sampling until that many are
    out, and no stop string ends it before then; the greedy tokens up to the first stop are those without it."""
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    free = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 40, "the reply should end at EOS"
    n = len(free.token_ids)
    held = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, min_tokens=n + 4))[0]
    assert len(held.token_ids) >= n + 4
    assert held.token_ids[:n - 1] == free.token_ids[:n - 1]  # everything before the EOS it held back
    assert not set(held.token_ids[:n + 3]) & engine.eos_token_ids
    # a stop token id is held too, and ends the output once min_tokens are out
    second = free.token_ids[1]
    stop_id = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[second]))[0]
    assert stop_id.token_ids == free.token_ids[:2] and stop_id.finish_reason == "stop"
    held_id = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[second],
                                                       min_tokens=3))[0]
    assert second not in held_id.token_ids[:3] and len(held_id.token_ids) >= 3
    # a stop string in the first tokens does not end it
    first_word = smol_tokenizer.decode(free.token_ids[:1]).strip()
    by_string = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=[first_word],
                                                         min_tokens=6))[0]
    assert len(by_string.token_ids) >= 6 and by_string.text.startswith(first_word)


def test_min_tokens_is_checked(engine):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


def test_prompt_logprobs_are_the_reference_forwards_and_survive_chunking(engine, hf_smol, smol_tokenizer):
    """`SamplingParams.prompt_logprobs`: each prompt token's log-probability given the ones before it, its rank and
    the top k, from the prefill rows, equal to transformers' forward over the prompt; a prompt longer than a step's
    budget (scored over several chunks) and one whose prefix the cache holds are scored whole."""
    import torch

    text = " ".join(f"Item {i}: a short note about number {i}." for i in range(12))
    ids = smol_tokenizer(text)["input_ids"]
    assert len(ids) > 64, "the prompt should span several prefill chunks"
    engine.generate([text], SamplingParams(max_tokens=1, temperature=0.0))  # its prefix is now in the cache
    out = engine.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    scored = out.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    assert [s.token_id for s in scored[1:]] == ids[1:]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([s.logprob for s in scored[1:]])
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)  # the engine computes in its dtype
    for pos, s in enumerate(scored[1:], start=1):
        assert len(s.top) == 2 and s.top[0][1] >= s.top[1][1]
        assert (s.rank == 1) == (s.token_id == s.top[0][0])
    plain = engine.generate([text], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
