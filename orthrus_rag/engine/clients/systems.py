"""The serving systems of one engine config that a benchmark compares, each opened as an `EngineClient`: an
in-process engine under one scheduling policy (`orthrus`, `qlen-priority`, `hetero-fcfs`, `unified-homo`) or a
two-process deployment (`dedicated`, `disagg-pd`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.clients.deployment_client import start_deployment
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.engine.core.policies import POLICIES
from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS
from orthrus_rag.engine.deploy.spec import build_engine_for

SYSTEMS = (*POLICIES, *DEPLOYMENTS)


def open_client(system: str, config: EngineConfig, threads: int | Sequence[int] | None = None,
                max_in_flight: int = 1024) -> EngineClient:
    """`system` (one of SYSTEMS) built from `config` (an in-process system replaces its policy). `threads`: torch
    threads of the in-process engine (default 2), or per worker of a two-process deployment (default 1 each)."""
    if system in POLICIES:
        from orthrus_rag.engine.async_engine import AsyncEngine  # NOTE: it imports this package's protocol

        num_threads = 2 if threads is None else (threads if isinstance(threads, int) else sum(threads))
        policy = replace(config, scheduler=replace(config.scheduler, policy=system))
        return AsyncEngine(build_engine_for(policy, num_threads), max_in_flight=max_in_flight)
    if system in DEPLOYMENTS:
        per_worker = (1, 1) if threads is None else ((threads, threads) if isinstance(threads, int)
                                                     else tuple(threads))
        return start_deployment(system, config, per_worker)
    raise ValueError(f"unknown system {system!r}; expected one of {', '.join(SYSTEMS)}")
