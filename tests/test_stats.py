"""Step statistics aggregated incrementally: totals equal the sums over every step, histograms bound their quantiles,
memory does not grow with the number of steps."""

from __future__ import annotations

import random

import numpy as np
import pytest

from orthrus_rag.engine.stats import STEP_TIME_EDGES, Histogram, StepAggregator, summarize_steps
from orthrus_rag.outputs import StepStats


def _step(i: int, rng: random.Random) -> StepStats:
    s = StepStats(i, rng.choice([0, 0, 32]), rng.randint(0, 256), rng.randint(0, 64), rng.choice([0, 40]),
                  rng.randint(1, 64), rng.randint(0, 100), rng.randint(0, 64), rng.choice([0, 0, 0, 1]),
                  rng.randint(0, 500), step_time=rng.lognormvariate(-3, 1))
    # executed as planned: one decoder forward with the planned rows
    s.num_decoder_forwards = int(s.num_embed_tokens + s.num_prefill_tokens + s.num_decode_tokens > 0)
    s.num_forward_embed_rows, s.num_forward_encoder_rows = s.num_embed_tokens, s.num_encoder_tokens
    s.num_forward_generate_rows = s.num_prefill_tokens + s.num_decode_tokens
    return s


def test_a_step_is_mixed_only_when_one_forward_carried_both_kinds():
    planned = StepStats(0, 32, 0, 4, 0, 5, 0, 5, 0, 3)
    assert not planned.is_mixed  # the plan alone: nothing ran
    planned.num_decoder_forwards, planned.num_forward_embed_rows, planned.num_forward_generate_rows = 1, 32, 4
    assert planned.is_mixed and planned.ran_as_scheduled
    planned.num_decoder_forwards = 2  # the same rows in two forwards: not one shared forward
    assert not planned.is_mixed and not planned.ran_as_scheduled
    planned.num_decoder_forwards, planned.num_forward_embed_rows = 1, 0  # the embedding rows were dropped
    assert not planned.is_mixed and not planned.ran_as_scheduled
    encoder = StepStats(0, 0, 0, 4, 40, 5, 0, 5, 0, 3, num_decoder_forwards=1, num_forward_generate_rows=4,
                        num_forward_encoder_rows=40)
    assert encoder.is_mixed and encoder.ran_as_scheduled


def test_totals_are_the_sums_over_every_step():
    rng = random.Random(0)
    steps = [_step(i, rng) for i in range(5_000)]
    agg = StepAggregator()
    for s in steps:
        agg.add(s)
    got = agg.summary()
    assert got["num_steps"] == 5_000
    assert got["num_mixed_steps"] == sum(s.is_mixed for s in steps)
    assert got["prefill_tokens"] == sum(s.num_prefill_tokens for s in steps)
    assert got["decode_tokens"] == sum(s.num_decode_tokens for s in steps)
    assert got["encoder_tokens"] == sum(s.num_encoder_tokens for s in steps)
    assert got["num_preempted"] == sum(s.num_preempted for s in steps)
    assert got["max_kv_blocks_used"] == max(s.kv_blocks_used for s in steps)
    assert got["busy_time"] == pytest.approx(sum(s.step_time for s in steps))
    assert got["step_time_s"]["total"] == 5_000 and sum(got["step_time_s"]["counts"]) == 5_000
    assert summarize_steps(steps)["decode_tokens"] == got["decode_tokens"]


def test_histogram_quantiles_fall_in_the_true_quantiles_bucket():
    rng = random.Random(1)
    values = [rng.lognormvariate(-3, 1.5) for _ in range(20_000)]
    h = Histogram(STEP_TIME_EDGES)
    for v in values:
        h.add(v)
    for q in (0.5, 0.95, 0.99):
        true = float(np.quantile(values, q))
        assert true / 1.3 <= h.quantile(q) <= true * 1.3  # buckets are ~26% wide
    assert h.to_json()["max"] == max(values) and h.quantile(1.0) <= max(values)
    assert Histogram([1.0]).quantile(0.5) != Histogram([1.0]).quantile(0.5)  # empty: nan


def test_steps_jsonl_rows_rebuild_the_same_totals():
    rng = random.Random(2)
    steps = [_step(i, rng) for i in range(300)]
    live, rebuilt = StepAggregator(), StepAggregator()
    for s in steps:
        live.add(s)
        rebuilt.add_row({**vars(s), "session": 3})  # a steps.jsonl row (extra keys ignored)
    assert live.summary() == rebuilt.summary()


def test_memory_is_constant_in_the_number_of_steps():
    import tracemalloc

    rng = random.Random(3)
    agg = StepAggregator()
    agg.add(_step(0, rng))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20_000):
        agg.add(_step(i, rng))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 50_000, grown
