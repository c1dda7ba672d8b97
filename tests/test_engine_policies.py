"""Policies change timing, never results: one mixed workload on the real model under every policy gives
identical greedy tokens and embeddings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orthrus_rag import Engine, PoolingParams, SamplingParams
from orthrus_rag.engine.core.policies import POLICIES

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

PROMPTS = ["The tallest mountain on Earth is", "Write a short poem about rain:",
           " ".join(["A long prompt about the history of trains."] * 6), "2 + 2 ="]
TEXTS = [" ".join(["Passage about rivers and films."] * k) for k in (1, 3, 9, 20, 2)]


@pytest.fixture(scope="module")
def reference(smol_engine):
    return smol_engine.run(prompts=PROMPTS, sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                           ignore_eos=True),
                           texts=TEXTS, pooling_params=PoolingParams(pooling="mean"))


def _run_as_the_reference(engine: Engine, reference) -> None:
    """The mixed workload on `engine`: the reference's greedy tokens and embeddings."""
    gens, embs = engine.run(prompts=PROMPTS, sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                            ignore_eos=True),
                            texts=TEXTS, pooling_params=PoolingParams(pooling="mean"))
    ref_gens, ref_embs = reference
    assert [g.token_ids for g in gens] == [g.token_ids for g in ref_gens]
    for a, b in zip(embs, ref_embs):
        assert torch.allclose(a.embedding, b.embedding, atol=1e-5)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_gives_identical_results(policy, smol_engine, reference):
    sched = replace(smol_engine.config.scheduler, policy=policy, max_num_batched_tokens=48, max_chunk_tokens=16)
    engine = Engine(replace(smol_engine.config, scheduler=sched), smol_engine.runner.model, smol_engine.tokenizer)
    _run_as_the_reference(engine, reference)
    steps = list(engine.step_stats)
    assert all(s.ran_as_scheduled for s in steps)  # is_mixed below counts what each forward carried
    if policy == "unified-homo":
        assert not any(s.is_mixed for s in steps)
    else:
        assert any(s.is_mixed for s in steps)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_latency_targets_change_timing_never_results(smol_engine, reference):
    """An inter-token target on CPU turns the step-cost model on (calibrated at start-up) and cuts steps that
    carry decodes; the tokens and embeddings stay the reference's, and every sampled token's gap is reported."""
    from orthrus_rag.config import SloConfig

    sched = replace(smol_engine.config.scheduler, max_num_batched_tokens=48, max_chunk_tokens=16,
                    slo=SloConfig(itl_s=1e-4, generate_p95_s=1e-3))  # NOTE: unreachable: every decode step is cut
    engine = Engine(replace(smol_engine.config, scheduler=sched), smol_engine.runner.model, smol_engine.tokenizer)
    assert engine.scheduler.cost_model is not None and engine.scheduler.cost_model.num_observed > 0
    _run_as_the_reference(engine, reference)
    steps = list(engine.step_stats)
    assert sum(len(s.decode_gaps) for s in steps) == len(PROMPTS) * 9  # 10 tokens: 9 gaps each
    assert all(g > 0 for s in steps for g in s.decode_gaps)
    assert any(s.time_capped for s in steps) and any(s.generate_at_risk for s in steps)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
