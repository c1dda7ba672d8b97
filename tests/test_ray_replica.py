"""`EngineReplica.record_routing_stats`, what the request router ranks replicas by (test_ray_router.py), read off a
real scheduler driven by fake runner outputs (tests/fake_steps.py), without Ray or a model: it counts the tokens
still to run, so it rises as requests arrive and falls by what each step runs, back to 0 when all are done."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from orthrus_rag.config import SchedulerConfig  # noqa: E402
from orthrus_rag.entrypoints.ray.replica import EngineReplica  # noqa: E402
from tests.fake_steps import FakeEngine, make_request  # noqa: E402


class _InFlight:
    """The AsyncEngine's count of submitted, unanswered requests: here every unfinished request of the engine."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    @property
    def num_in_flight(self) -> int:
        return len(self.engine.scheduler.requests)


def _replica() -> tuple[EngineReplica, FakeEngine]:
    engine = FakeEngine(SchedulerConfig(max_num_batched_tokens=16, max_chunk_tokens=16, max_num_seqs=8),
                        num_blocks=64, block_size=4)  # NOTE: blocks enough that nothing is preempted
    replica = EngineReplica.__new__(EngineReplica)  # NOTE: the figures alone; Ray builds it with a model
    replica.engine, replica.aengine = engine, _InFlight(engine)
    return replica, engine


def test_an_idle_replica_reports_no_work() -> None:
    replica, _ = _replica()
    assert replica.record_routing_stats() == {"outstanding_tokens": 0, "pending": 0}


def test_outstanding_tokens_rise_with_each_request_by_its_work() -> None:
    """A prompt's tokens plus its generation budget; an embedding's tokens: work, not a request count."""
    replica, engine = _replica()
    engine.add(make_request("g1", "generate", 20, max_tokens=10))
    assert replica.record_routing_stats() == {"outstanding_tokens": 30, "pending": 1}
    engine.add(make_request("e1", "embed", 30))
    assert replica.record_routing_stats() == {"outstanding_tokens": 60, "pending": 2}
    engine.add(make_request("g2", "generate", 5, max_tokens=50))
    assert replica.record_routing_stats() == {"outstanding_tokens": 115, "pending": 3}


def test_outstanding_tokens_fall_by_what_each_step_runs() -> None:
    replica, engine = _replica()
    for req in (make_request("g1", "generate", 20, max_tokens=6), make_request("e1", "embed", 30),
                make_request("g2", "generate", 3, max_tokens=1)):
        engine.add(req)
    before = replica.record_routing_stats()["outstanding_tokens"]
    steps = 0
    while engine.scheduler.has_unfinished():
        unfinished = [r for r in engine.requests if not r.is_finished]
        out = engine.step()
        steps += 1
        ended = sum(1 for r in unfinished if r.is_finished and not r.is_embed)
        now = replica.record_routing_stats()
        # NOTE: a finishing generation also drops its last sampled token, which no step ever runs
        assert before - now["outstanding_tokens"] == out.num_batched_tokens + ended, (steps, before, now)
        assert now["pending"] == len(engine.scheduler.requests)
        before = now["outstanding_tokens"]
        assert steps < 100, "the fake engine did not finish"
    assert steps > 3  # prompts in chunks, then decodes: the figure was read mid-flight, not only at the ends
    assert replica.record_routing_stats() == {"outstanding_tokens": 0, "pending": 0}
