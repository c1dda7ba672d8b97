"""NaN and infinity never reach a step, and a step that fails anyway does not poison the synchronous `run`."""

from __future__ import annotations

import math

import pytest

from orthrus_rag import PoolingParams, SamplingParams


@pytest.mark.parametrize("kw,name", [({"temperature": math.nan}, "temperature"),
                                     ({"temperature": math.inf}, "temperature"),
                                     ({"top_p": math.nan}, "top_p"), ({"top_p": -math.inf}, "top_p")])
def test_non_finite_sampling_values_are_refused(kw, name):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**kw)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_pooling_weights_are_refused(bad):
    with pytest.raises(ValueError, match="pooling weights must be finite"):
        PoolingParams(pooling="weighted_mean", weights=[1.0, bad, 2.0])


def test_a_failed_step_does_not_poison_run(engine, monkeypatch):
    def boom(sched):  # noqa: ANN001, ANN202
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine.runner, "execute", boom)
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.run(prompts=["Hello"], sampling_params=SamplingParams(max_tokens=2), texts=["a text"])
    monkeypatch.undo()
    # the failed call's requests are gone and their blocks free: the next call runs as if nothing happened
    assert not engine.has_unfinished() and not engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    out = engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
    assert out[0].finish_reason in ("stop", "length") and out[0].token_ids
