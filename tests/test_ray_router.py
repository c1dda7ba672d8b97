"""The Ray Serve request router's rule, without a cluster: least outstanding tokens first, the replicas' reports
plus what the router sent since (so a burst spreads), and a call's token estimate."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from orthrus_rag.entrypoints.ray.router import CHARS_PER_TOKEN, LeastWorkRouter, estimate_tokens
from orthrus_rag.params import PoolingParams, SamplingParams


def test_token_estimates():
    text = "x" * 40
    assert estimate_tokens((text, SamplingParams(max_tokens=10))) == 40 // CHARS_PER_TOKEN + 1 + 10
    assert estimate_tokens(([1, 2, 3], SamplingParams(max_tokens=5))) == 3 + 5  # token ids count as they are
    assert estimate_tokens(([text, text], PoolingParams())) == 2 * (40 // CHARS_PER_TOKEN + 1)  # embed_many
    assert estimate_tokens(()) == 1


def _replica(name: str, outstanding: int) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats={"outstanding_tokens": outstanding})


def _router() -> LeastWorkRouter:
    router = LeastWorkRouter.__new__(LeastWorkRouter)  # NOTE: the rule alone; Ray builds it with its deployment
    router.initialize_state()
    return router


def test_least_outstanding_tokens_first_and_a_burst_spreads():
    router, a, b = _router(), _replica("a", 100), _replica("b", 40)
    request = SimpleNamespace(args=("y" * 100, SamplingParams(max_tokens=64)))  # ~90 tokens
    ranks = asyncio.run(router.choose_replicas([a, b], request))
    assert [r[0].replica_id for r in ranks] == ["b", "a"]  # fewer tokens outstanding, not fewer requests
    # b is charged the request until its next report, so the next one goes to a
    assert asyncio.run(router.choose_replicas([a, b], request))[0][0].replica_id == "a"
    b.routing_stats = {"outstanding_tokens": 0}  # a new report replaces the router's own estimate
    assert asyncio.run(router.choose_replicas([a, b], request))[0][0].replica_id == "b"
