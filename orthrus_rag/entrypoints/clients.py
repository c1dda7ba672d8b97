"""The `EngineClient` a command goes through, from the composed config: `deploy.mode` `engine` (one co-scheduled
engine, an `AsyncEngine`), a two-process deployment of it, or engine replicas on Ray Serve (entrypoints/ray/)."""

from __future__ import annotations

import logging
from typing import Any

from orthrus_rag.config.build import engine_config_from

logger = logging.getLogger(__name__)


def build_client(cfg: Any):  # -> EngineClient
    """The client `run`, `index` and `serve` use (weights loaded)."""
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.clients import start_deployment
    from orthrus_rag.engine.engine import Engine

    d = cfg.deploy
    if d.mode == "engine":
        return AsyncEngine(Engine.from_config(engine_config_from(cfg)), max_in_flight=d.max_in_flight)
    if d.mode == "ray":
        from orthrus_rag.entrypoints.ray.app import ray_client, replicas_of

        return ray_client(replicas_of(cfg), d.ray_address, d.ray_num_cpus, d.max_in_flight, d.retries)
    threads = tuple(d.threads) if d.threads else (1, 1)
    logger.info("starting the %s deployment (threads %s)", d.mode, threads)
    return start_deployment(d.mode, engine_config_from(cfg), threads)
