"""The `EngineClient` a command goes through, from the composed config: `deploy.mode` `engine` (one co-scheduled
engine, an `AsyncEngine`), a two-process deployment of it, or engine replicas on Ray Serve (entrypoints/ray/)."""

from __future__ import annotations

import logging
from typing import Any

from orthrus_rag.app_config import build_engine, engine_config_from

logger = logging.getLogger(__name__)


def build_client(cfg: Any):  # -> EngineClient
    """The client `run`, `index` and `serve` use."""
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.engine.clients import start_deployment

    if cfg.deploy.mode == "engine":
        return AsyncEngine(build_engine(cfg), max_in_flight=cfg.deploy.max_in_flight)
    if cfg.deploy.mode == "ray":
        from orthrus_rag.entrypoints.ray.app import ray_client, replicas_of

        d = cfg.deploy
        return ray_client(replicas_of(cfg), d.ray_address, d.ray_num_cpus, d.max_in_flight, d.retries)
    threads = tuple(cfg.deploy.threads) if cfg.deploy.threads else (1, 1)
    logger.info("starting the %s deployment (threads %s)", cfg.deploy.mode, threads)
    return start_deployment(cfg.deploy.mode, engine_config_from(cfg), threads)
