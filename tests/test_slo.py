"""Per-kind latency targets (scheduler.slo, engine/core/slo.py) with fake step outputs and a fake clock (vLLM's
scheduler-test pattern): a step lasts what a known cost model says for its shape, so inter-token gaps are exact."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from orthrus_rag.config import SchedulerConfig, SloConfig
from orthrus_rag.engine.core.step_cost import StepCostModel
from tests.fake_steps import FakeEngine, make_request

# the "true" cost of a step: 20 ms + 1 ms a decoder token + 0.25 ms an encoder token
BASE, PER_TOKEN, PER_ENCODER_TOKEN = 0.02, 0.001, 0.00025


def _clock() -> StepCostModel:
    model = StepCostModel()
    model.theta = np.array([BASE, PER_TOKEN, 0.0, PER_ENCODER_TOKEN, 0.0, 0.0, 0.0])
    return model


def _engine(slo: SloConfig | None, budget: int = 512, sized: bool = True, seqs: int = 64) -> FakeEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_chunk_tokens=256, max_num_seqs=seqs, policy="orthrus",
                          slo=slo or SloConfig())
    # the scheduler sees the same model the clock runs on (the real one learns it from measured steps)
    return FakeEngine(cfg, num_blocks=8192, block_size=16, cost_model=_clock() if sized else None, clock=_clock())


def _gaps(eng: FakeEngine, prefix: str = "g") -> list[float]:
    return [b - a for rid, times in eng.token_times.items() if rid.startswith(prefix)
            for a, b in itertools.pairwise(times)]


def _flood(kind: str, n: int = 1000) -> list:
    """`n` long embeddings queued at once, and generations arriving every 15 steps while they drain."""
    rng = np.random.default_rng(0)
    arrivals = [(0, make_request(f"e{i}", kind, int(rng.integers(200, 257) if kind == "encoder"
                                                    else rng.integers(300, 512))), None) for i in range(n)]
    arrivals += [(15 * i, make_request(f"g{i}", "generate", int(rng.integers(20, 60)), int(rng.integers(8, 33))),
                  None) for i in range(40)]
    return arrivals


@pytest.mark.parametrize("kind", ["embed", "encoder"])
def test_a_thousand_long_embeddings_never_push_a_decode_past_its_inter_token_target(kind):
    target = 0.1
    eng = _engine(SloConfig(itl_s=target))
    eng.run(_flood(kind))
    gaps = _gaps(eng)
    assert len(gaps) > 500 and max(gaps) <= target + 1e-9, max(gaps)
    assert all(r.is_finished for r in eng.requests)  # the embeddings still all finish
    # the same flood without the target: 512-token steps, a decode waits ~0.5 s a token
    plain = _engine(None, sized=False)
    plain.run(_flood(kind))
    assert max(_gaps(plain)) > 3 * target
    # ... and the target costs little throughput: steps without decodes stay whole, and the smaller steps beside
    # decodes pay only the fixed part more often (measured here: +2% embed, +1% encoder)
    assert eng.now <= 1.05 * plain.now, (eng.now, plain.now)


def test_an_encoder_input_that_can_never_fit_beside_the_decodes_still_runs():
    # 20 ms + 4 decodes leave 26 ms of a 50 ms target; a 512-token encoder input costs 128 ms on its own
    eng = _engine(SloConfig(itl_s=0.05))
    arrivals = [(0, make_request(f"g{i}", "generate", 8, 60), None) for i in range(4)]
    arrivals += [(2, make_request("big", "encoder", 512), None), (2, make_request("small", "encoder", 64), None)]
    eng.run(arrivals)
    assert eng.finished_at["big"] < eng.finished_at["g0"]  # not held back until the generations end


def test_with_no_target_at_risk_the_schedule_is_todays():
    """Work-conserving: generous targets change no step of a mixed workload."""
    rng = np.random.default_rng(3)

    def workload() -> list:
        out = []
        for i in range(120):
            kind = ["embed", "generate", "encoder"][int(rng.integers(0, 3))]
            out.append((int(rng.integers(0, 60)), make_request(f"r{i}", kind, int(rng.integers(5, 300)),
                                                               int(rng.integers(1, 20))), None))
        return out

    arrivals = workload()
    generous = _engine(SloConfig(itl_s=100.0, generate_p95_s=1e6, embed_p95_s=1e6))
    today = _engine(None, sized=False)
    generous.run([(t, make_request(r.req_id, _kind(r), r.num_prompt_tokens, _max(r)), a) for t, r, a in arrivals])
    today.run(arrivals)
    assert generous.chunks == today.chunks and generous.finished_at == today.finished_at


def _kind(r) -> str:
    return "encoder" if r.on_encoder else r.kind.value


def _max(r) -> int:
    return r.sampling_params.max_tokens if r.sampling_params else 1


def test_a_generation_at_risk_fills_first_beside_an_embedding_backlog():
    def prompt_tokens(slo: SloConfig | None) -> int:
        eng = _engine(slo, sized=False)
        for i in range(40):
            eng.add(make_request(f"e{i}", "embed", 500))
        eng.step()
        eng.add(make_request("g", "generate", 400, 4))
        eng.now += 1.0  # the prompt has waited 1 s
        out = eng.step()
        return sum(s.num_new_tokens for s in out.scheduled if s.req.req_id == "g"), out

    plain, out = prompt_tokens(None)
    assert plain <= 0.1 * 512 + 1 and not out.generate_at_risk  # min_share: the embeddings' backlog dominates
    at_risk, out = prompt_tokens(SloConfig(generate_p95_s=1.0))  # waited 1 s >= 0.5 x 1 s
    assert at_risk == 256 and out.generate_at_risk and not out.embed_at_risk  # its whole chunk (256), first
    calm, out = prompt_tokens(SloConfig(generate_p95_s=10.0))  # 1 s < 0.5 x 10 s: not at risk, today's split
    assert calm == plain and not out.generate_at_risk


def test_an_embedding_at_risk_fills_first_beside_a_prompt_backlog():
    eng = _engine(SloConfig(embed_p95_s=0.2), sized=False)
    for i in range(30):
        eng.add(make_request(f"p{i}", "generate", 500, 2))
    eng.step()
    eng.add(make_request("e", "embed", 300))
    eng.now += 0.15  # 0.15 s >= 0.5 x 0.2 s
    out = eng.step()
    assert out.embed_at_risk and sum(s.num_new_tokens for s in out.scheduled if s.req.req_id == "e") == 256


def test_an_embedding_target_bounds_every_step_so_an_arrival_waits_at_most_two():
    """A prompt backlog (no decodes yet) would take whole 512-token steps (~0.53 s each); with `embed_p95_s` every
    step is held to half the target, and each embedding that arrives mid-step finishes within the target."""
    def run(slo: SloConfig | None) -> FakeEngine:
        eng = _engine(slo, sized=slo is not None)
        arrivals = [(0, make_request(f"p{i}", "generate", 500, 2), None) for i in range(20)]
        arrivals += [(3 * i + 1, make_request(f"e{i}", "embed", 40), None) for i in range(10)]
        eng.run(arrivals)
        return eng

    target = 0.2
    bounded, plain = run(SloConfig(embed_p95_s=target)), run(None)
    late = [r.finished_time - r.arrival_time for r in bounded.requests if r.req_id.startswith("e")]
    assert len(late) == 10 and max(late) <= target + 1e-9, late
    # one that arrives just before a step is at risk in it (the step's bound counts as waiting): served at once
    assert max(late) <= target / 2 + 1e-9, late
    assert max(r.finished_time - r.arrival_time for r in plain.requests if r.req_id.startswith("e")) > 2 * target
    assert all(r.is_finished for r in bounded.requests)  # the prompts still all finish
    # a loose target (above two whole steps) never binds: the same schedule as without it
    loose = run(SloConfig(embed_p95_s=100.0))
    assert loose.chunks == plain.chunks


def _decodes_and_queries(slo: SloConfig, query_tokens: int = 48) -> FakeEngine:
    """40 generations decoding (60 ms of a step on the clock) and a 48-token query embedding every 10 steps."""
    eng = _engine(slo)
    arrivals = [(0, make_request(f"g{i}", "generate", 8, 120), None) for i in range(40)]
    arrivals += [(10 * i + 5, make_request(f"e{i}", "embed", query_tokens), None) for i in range(10)]
    eng.run(arrivals)
    return eng


def test_decodes_yield_a_step_so_an_embedding_at_risk_fits_its_bound():
    """At 1:9 embed:generate the decodes in flight alone nearly fill the bound (half of `embed_p95_s`), so without
    yielding an embedding runs `min_step_tokens` (32) a step over two steps and misses its target; with it, some
    decodes sit out one step and it finishes in one."""
    target = 0.16  # a bound of 80 ms: 40 decodes (60 ms) leave 20 ms, the 32-token floor makes a step 92 ms
    on, off = (_decodes_and_queries(SloConfig(embed_p95_s=target, yield_decodes=y)) for y in (True, False))

    def latencies(eng: FakeEngine) -> list[float]:
        return [r.finished_time - r.arrival_time for r in eng.requests if r.req_id.startswith("e")]

    assert max(latencies(off)) > target  # two steps: 92 + 76 ms
    assert len(latencies(on)) == 10 and max(latencies(on)) <= target / 2 + 1e-9, latencies(on)
    assert off.num_yielded == 0 and 10 <= on.num_yielded <= 10 * 40
    # the generations pay a step here and there: their last token comes at most 2% later, and a decode's gap is at
    # most two steps (the contract checks in FakeEngine.step: no decode yields two steps running)
    last = {eng: max(r.finished_time for r in eng.requests if r.req_id.startswith("g")) for eng in (on, off)}
    assert last[on] <= 1.02 * last[off], last
    assert max(_gaps(on)) <= 2 * 0.092 + 1e-9


def test_an_auto_embedding_target_schedules_as_the_fixed_target_it_predicts():
    """`embed_p95_s=auto` is `auto_multiple` x the cost model's time of a step holding one embedding alone: with
    32-token queries (the length assumed before any is seen, so the mean stays put) and a multiple that makes it
    0.16 s, every step is the one the fixed 0.16 s target schedules, decodes yielding included."""
    from orthrus_rag.engine.core.slo import AUTO_FIRST_TOKENS

    n = int(AUTO_FIRST_TOKENS)
    unloaded = BASE + PER_TOKEN * n  # the clock has no attention term
    auto = _decodes_and_queries(SloConfig(embed_p95_s="auto", auto_multiple=0.16 / unloaded), query_tokens=n)
    fixed = _decodes_and_queries(SloConfig(embed_p95_s=0.16), query_tokens=n)
    assert auto.scheduler.targets.embed_target() == pytest.approx(0.16)
    assert auto.chunks == fixed.chunks and auto.num_yielded == fixed.num_yielded > 0
    assert [r.finished_time for r in auto.requests] == pytest.approx([r.finished_time for r in fixed.requests])


@pytest.mark.parametrize("kind, per_token", [("embed", PER_TOKEN), ("encoder", PER_ENCODER_TOKEN)])
def test_an_auto_embedding_target_follows_the_embeddings_it_sees(kind, per_token):
    """The unloaded latency is predicted for the running mean of the embeddings' lengths, on the backbone or the
    separate encoder as they arrive, and the target moves with it; bulk embeddings (an ingest) do not count."""
    eng = _engine(SloConfig(embed_p95_s="auto"))
    targets = eng.scheduler.targets
    assert targets.embed_target() == pytest.approx(8.0 * (BASE + PER_TOKEN * 32))  # none seen: 32 on the backbone
    for i in range(200):
        eng.add(make_request(f"e{i}", kind, 160))
    assert targets.embed_tokens == pytest.approx(160, abs=1)
    assert targets.embed_target() == pytest.approx(8.0 * (BASE + per_token * 160), rel=0.01)
    bulk = make_request("ingest", kind, 4000)
    bulk.pooling_params.priority = 1
    eng.add(bulk)
    assert targets.embed_tokens == pytest.approx(160, abs=1)


def test_a_decode_never_yields_past_its_inter_token_target():
    """With `itl_s` as well, a decode yields only where two bounded steps keep its gap within the target."""
    tight = _decodes_and_queries(SloConfig(embed_p95_s=0.16, itl_s=0.1))  # 2 x 80 ms > 0.1 s: none may yield
    assert tight.num_yielded == 0 and max(_gaps(tight)) <= 0.1 + 1e-9
    loose = _decodes_and_queries(SloConfig(embed_p95_s=0.16, itl_s=0.2))
    assert loose.num_yielded > 0 and max(_gaps(loose)) <= 0.2 + 1e-9


def test_no_decode_yields_when_it_would_not_make_the_embedding_fit():
    """An embedding flood (1,000 long inputs, each over a whole bound) never has decodes sit out: yielding would
    not make one fit, and it would halve the decodes' rate for as long as the flood lasts."""
    eng = _engine(SloConfig(embed_p95_s=0.2))
    eng.run(_flood("embed", 200))
    assert eng.num_yielded == 0 and all(r.is_finished for r in eng.requests)


def test_the_step_bound_is_the_tighter_target_that_applies():
    from orthrus_rag.engine.core.slo import LatencyTargets

    both = LatencyTargets(SloConfig(itl_s=0.05, embed_p95_s=0.3))
    assert both.step_time_bound(with_decodes=True) == 0.05 and both.step_time_bound(with_decodes=False) == 0.15
    assert LatencyTargets(SloConfig(itl_s=0.05)).step_time_bound(with_decodes=False) is None
    assert LatencyTargets(SloConfig(generate_p95_s=2.0)).step_time_bound(with_decodes=True) is None


@pytest.mark.parametrize("bad, message", [
    ({"itl_s": 0}, "slo.itl_s must be a positive"),
    ({"embed_p95_s": -1.0}, "slo.embed_p95_s must be a positive"),
    ({"embed_p95_s": "fast"}, "slo.embed_p95_s must be a positive number of seconds or 'auto', got 'fast'"),
    ({"embed_p95_s": "auto", "auto_multiple": 1.0}, "slo.auto_multiple must be above 1"),
    ({"risk_fraction": 1.5}, "slo.risk_fraction must be in"),
])
def test_bad_targets_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(slo=bad)


def test_targets_belong_to_the_orthrus_policy_and_need_the_cost_model():
    with pytest.raises(ValueError, match="orthrus policy"):
        SchedulerConfig(policy="hetero-fcfs", slo={"generate_p95_s": 2.0})
    with pytest.raises(ValueError, match="cost_budget=false"):
        SchedulerConfig(cost_budget=False, slo={"itl_s": 0.1})
    with pytest.raises(ValueError, match="cost_budget=false"):
        SchedulerConfig(cost_budget=False, slo={"embed_p95_s": 0.5})


def test_prometheus_counts_gaps_and_steps_at_risk():
    from types import SimpleNamespace

    from orthrus_rag.entrypoints.openai.metrics import ServerMetrics
    from orthrus_rag.outputs import StepStats

    metrics = ServerMetrics(SimpleNamespace(observe_steps=lambda observer: None))
    metrics.observe_step(StepStats(0, 0, 0, 3, 0, 3, 0, 3, 0, 1, generate_at_risk=True, time_capped=True,
                                   decode_gaps=[0.01, 0.05, 0.3]))
    metrics.observe_step(StepStats(1, 8, 0, 0, 0, 1, 0, 1, 0, 1, embed_at_risk=True, num_yielded_decodes=5))
    text = metrics.render().decode()
    assert "orthrus_inter_token_latency_seconds_count 3.0" in text
    assert 'orthrus_inter_token_latency_seconds_bucket{le="0.06"} 2.0' in text
    assert 'orthrus_slo_at_risk_steps_total{kind="generate"} 1.0' in text
    assert 'orthrus_slo_at_risk_steps_total{kind="embed"} 1.0' in text
    assert "orthrus_slo_time_capped_steps_total 1.0" in text
    assert "orthrus_slo_yielded_decodes_total 5.0" in text


def test_targets_are_cli_keys_and_a_bad_one_is_named_by_its_key():
    from orthrus_rag.config.build import engine_config_from
    from orthrus_rag.entrypoints.checks import validate
    from tests.test_app_config import _compose

    cfg = _compose("scheduler.slo.itl_s=0.08", "scheduler.slo.generate_p95_s=3")
    assert engine_config_from(cfg).scheduler.slo == SloConfig(itl_s=0.08, generate_p95_s=3.0)
    with pytest.raises(ValueError, match=r"scheduler: slo.itl_s must be a positive number of seconds, got -1"):
        validate(_compose("scheduler.slo.itl_s=-1"))


@pytest.mark.parametrize("value, want", [("1", 1), ("0.13", 0.13), ("auto", "auto"), ("null", None)])
def test_the_embedding_target_composes_from_the_command_line(value, want):
    """`scheduler.slo.embed_p95_s=...` through OmegaConf's schema: a whole number of seconds, a fraction, auto or
    none (a number inside a Union is not widened to float there)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(SloConfig), OmegaConf.from_dotlist([f"embed_p95_s={value}"]))
    slo = SloConfig(**OmegaConf.to_container(cfg))
    assert slo.embed_p95_s == want
