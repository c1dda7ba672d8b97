"""The cost-aware step budget (engine/core/step_cost.py) with a fake cost model: never above the cap, a kind alone
gets whole steps, each kind progresses every few steps; the online fit and the start-up calibration."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_rag.config import SchedulerConfig
from orthrus_rag.engine.executor.calibration import calibrate
from orthrus_rag.engine.executor.runner import RunnerOutput
from orthrus_rag.engine.core.step_cost import StepCostModel, StepShape
from tests.fake_steps import FakeEngine, make_request

CAP = 128


def _fake_cost(base: float = 0.02, per_token: float = 0.001) -> StepCostModel:
    model = StepCostModel()
    model.theta = np.array([base, per_token, 0.0, 0.0, 0.0, 0.0, 0.0])
    return model


def _engine(margin: float = 1.0, target: float | None = None, min_tokens: int = 8,
            cost: StepCostModel | None = None) -> FakeEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=CAP, max_chunk_tokens=64, max_num_seqs=64, policy="orthrus",
                          step_time_margin=margin, step_time_target=target, min_step_tokens=min_tokens)
    return FakeEngine(cfg, num_blocks=2048, block_size=16, cost_model=cost or _fake_cost())


def _decoding(eng: FakeEngine, num: int = 4) -> FakeEngine:
    """`eng` with `num` generations past their prompts: the next step starts with `num` decodes."""
    for i in range(num):
        eng.add(make_request(f"g{i}", "generate", 8, 40))
    while not all(r.is_decoding for r in eng.requests):
        eng.step()
    return eng


def test_decodes_get_room_for_their_margin_only():
    eng = _decoding(_engine(margin=1.0))
    for i in range(6):
        eng.add(make_request(f"e{i}", "embed", 100))
    out = eng.step()
    decodes = sum(1 for s in out.scheduled if not s.req.is_embed)
    # 4 decodes cost 20 + 4 = 24 ms; twice that leaves 24 ms, i.e. 24 tokens at 1 ms each
    assert decodes == 4 and out.budget_used == 4 + 24 and eng.scheduler.step_cap == 28


def test_an_absolute_target_and_the_progress_floor():
    eng = _decoding(_engine(target=0.05))  # 50 ms: 20 + 4 for the decodes leaves 26 tokens
    eng.add(make_request("e", "embed", 200))
    assert eng.step().budget_used == 4 + 26
    # a target the decodes alone exceed: the floor still runs work
    slow = _decoding(_engine(target=0.001, min_tokens=8))
    slow.add(make_request("e", "embed", 200))
    assert slow.step().budget_used == 4 + 8


def test_a_kind_alone_gets_whole_steps():
    eng = _engine(margin=0.1)
    for i in range(3):
        eng.add(make_request(f"e{i}", "embed", 100))
    assert eng.step().budget_used == CAP  # no decodes: the cap, not the margin
    eng2 = _engine(margin=0.1)
    eng2.add(make_request("p", "generate", 300, 2))
    assert eng2.step().budget_used == 64  # one prompt, chunk cap 64


@settings(max_examples=40, deadline=None)
@given(margin=st.floats(0.0, 3.0), num_gen=st.integers(1, 12), num_emb=st.integers(1, 12),
       seed=st.integers(0, 1000))
def test_never_above_the_cap_and_every_kind_progresses(margin, num_gen, num_emb, seed):
    rng = np.random.default_rng(seed)
    eng = _engine(margin=margin, cost=_fake_cost(float(rng.uniform(0.005, 0.05)), float(rng.uniform(1e-4, 3e-3))))
    for i in range(num_gen):
        eng.add(make_request(f"g{i}", "generate", int(rng.integers(1, 80)), int(rng.integers(1, 30))))
    for i in range(num_emb):
        eng.add(make_request(f"e{i}", "embed", int(rng.integers(1, 200))))
    last_progress = {True: 0, False: 0}
    while any(not r.is_finished for r in eng.requests):
        out = eng.step()  # check_schedule: within max_num_batched_tokens and within this step's cap
        assert out.budget_used <= CAP
        for embed in (True, False):
            pending = eng.scheduler.pending(embed) or (not embed and any(r.is_decoding for r in eng.scheduler.running))
            if any(s.req.is_embed == embed for s in out.scheduled) or not pending:
                last_progress[embed] = eng.num_steps
            assert eng.num_steps - last_progress[embed] <= 4, f"{'embed' if embed else 'generate'} starved"
        assert eng.num_steps < 5000


def test_online_fit_recovers_a_linear_cost():
    model = StepCostModel()
    rng = np.random.default_rng(0)
    for _ in range(600):
        tokens = int(rng.integers(1, 512))
        shape = StepShape(tokens, int(rng.integers(0, 200_000)), int(rng.integers(0, 64)),
                          int(rng.integers(0, tokens + 1)), int(rng.integers(0, 9)), int(rng.integers(0, tokens + 1)))
        truth = (0.030 + 0.0008 * shape.num_tokens + 2e-5 * shape.attention_pairs / 1000
                 + 3e-4 * shape.num_encoder_tokens + 1e-4 * shape.num_adapter_rows + 2e-3 * shape.num_adapters
                 + 5e-4 * shape.num_sampled_rows)
        model.observe(shape, truth * float(rng.uniform(0.98, 1.02)))
    np.testing.assert_allclose(model.theta, [0.030, 0.0008, 2e-5, 3e-4, 1e-4, 2e-3, 5e-4], rtol=0.1, atol=2e-6)
    assert model.tokens_within(StepShape(10, 0), 0.030 + 0.0008 * 60, 0.0) in range(48, 52)


def test_nonsense_step_times_are_ignored():
    model = StepCostModel()
    before = model.theta.copy()
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        model.observe(StepShape(8, 0), bad)
    assert np.array_equal(model.theta, before) and model.num_observed == 0


def test_calibration_is_bounded_in_time():
    class SlowRunner:
        calls = 0

        def execute(self, sched):
            SlowRunner.calls += 1
            time.sleep(0.15)
            return RunnerOutput(seconds=0.15)

    start = time.perf_counter()
    calibrate(SlowRunner(), StepCostModel(), max_tokens=256, max_seconds=0.2)
    assert time.perf_counter() - start < 0.2 + 2 * 0.15 + 0.1
    assert SlowRunner.calls <= 3


def test_a_steps_shape_counts_the_rows_that_sample():
    """Every decode and a prompt's last chunk produce a token (the LM head and the sampler run for them); a prompt's
    earlier chunk and an embedding chunk do not."""
    from orthrus_rag.engine.core.request import Request, RequestKind
    from orthrus_rag.engine.core.step_output import ScheduledRequest, SchedulerOutput
    from orthrus_rag.params import PoolingParams, SamplingParams

    def req(kind: RequestKind, n: int, computed: int) -> Request:
        r = Request(f"{kind.value}-{n}-{computed}", kind, [1] * n,
                    sampling_params=SamplingParams() if kind is RequestKind.GENERATE else None,
                    pooling_params=PoolingParams() if kind is RequestKind.EMBED else None)
        r.num_computed_tokens = computed
        return r

    gen, emb = RequestKind.GENERATE, RequestKind.EMBED
    out = SchedulerOutput(scheduled=[ScheduledRequest(req(gen, 41, 40), 1), ScheduledRequest(req(gen, 90, 40), 50),
                                     ScheduledRequest(req(gen, 90, 0), 40), ScheduledRequest(req(emb, 30, 0), 30)])
    shape = out.shape()
    assert (shape.num_tokens, shape.num_sampled_rows) == (121, 2)
    model = StepCostModel()
    model.theta = np.array([0.01, 0.001, 0.0, 0.0, 0.0, 0.0, 0.002])
    assert abs(model.predict(shape) - (0.01 + 0.121 + 0.004)) < 1e-9


def test_a_scheduled_step_carries_the_models_prediction():
    """Each step the cost model sizes carries its predicted seconds (engine stats and benchmark step logs show it
    beside the measured time); the baselines' token budgets carry none."""
    eng = _decoding(_engine())
    eng.add(make_request("p", "generate", 300))
    out = eng.step()
    assert out.predicted_s is not None and out.predicted_s > 0
    plain = FakeEngine(SchedulerConfig(max_num_batched_tokens=CAP, policy="hetero-fcfs"), num_blocks=256,
                       block_size=16, cost_model=_fake_cost())
    plain.add(make_request("q", "generate", 40))
    assert plain.step().predicted_s is None
