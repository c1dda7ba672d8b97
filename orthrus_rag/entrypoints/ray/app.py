"""The Ray Serve application: `deploy.replicas` `EngineReplica`s behind an OpenAI-compatible ingress (the same
FastAPI app, routes, errors, streaming, API key and metrics as `orthrus-rag serve`), routed by least outstanding
work (router.py). `ray.init(address=...)` joins an existing cluster; with no address a local Ray starts."""

from __future__ import annotations

import logging
import math
from typing import Any

from orthrus_rag.config.app import KEEP_ALIVE_S
from orthrus_rag.entrypoints.ray.client import RETRIES, RayServeClient
from orthrus_rag.entrypoints.ray.replica import EngineReplica

logger = logging.getLogger(__name__)

APP_NAME = "orthrus"
REPLICA = "EngineReplica"


class OpenAIIngress:
    """The ingress replica: the OpenAI app over a `RayServeClient` of the engine replicas' handle."""

    def __init__(self, replicas: Any, model: str, served_model_name: str | None, api_key: str | None,
                 default_max_tokens: int, max_in_flight: int, expected_replicas: int | None = None,
                 retries: int = RETRIES) -> None:
        self.replicas = replicas  # a DeploymentHandle (Ray passes the bound EngineReplica as one)
        self.model, self.served_model_name, self.api_key = model, served_model_name, api_key
        self.default_max_tokens, self.max_in_flight = default_max_tokens, max_in_flight
        self.expected_replicas, self.retries = expected_replicas, retries

    async def __serve_build_asgi_app__(self) -> Any:
        from orthrus_rag.engine.clients.deployment_client import load_tokenizer
        from orthrus_rag.entrypoints.openai.api import build_app

        info = await self.replicas.info.remote()
        client = RayServeClient(self.replicas, load_tokenizer(self.model), info["embedding_space"],
                                self.max_in_flight, expected_replicas=self.expected_replicas, retries=self.retries,
                                reranker_names=info.get("reranker_names", ()))
        return build_app(client, self.served_model_name, self.api_key, self.default_max_tokens)


def replica_deployment(engine_config: Any, replicas: int, cpus_per_replica: float, max_in_flight: int,
                       autoscaling: dict[str, Any] | None = None, gpus_per_replica: float = 0.0) -> Any:
    """The bound engine replicas (`autoscaling`: Ray Serve's autoscaling_config, instead of a fixed count)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from orthrus_rag.entrypoints.ray.router import LeastWorkRouter

    count: dict[str, Any] = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}
    deployment = serve.deployment(
        EngineReplica, name=REPLICA, ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        max_ongoing_requests=max_in_flight, health_check_period_s=2, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(request_router_class=LeastWorkRouter,
                                                  request_routing_stats_period_s=1),
        **count)
    return deployment.bind(engine_config, max_in_flight)


def _replica_options(cfg: Any) -> dict[str, Any]:
    """`replica_deployment`'s arguments from the composed config: `deploy.replicas` (or autoscaling between
    `deploy.min_replicas` and `max_replicas`), `deploy.num_threads` threads and CPUs each (default 1)."""
    from dataclasses import replace

    from orthrus_rag.config.build import engine_config_from

    d = cfg.deploy
    threads = d.num_threads or 1
    autoscaling = None if d.min_replicas is None else {
        "min_replicas": d.min_replicas, "max_replicas": d.max_replicas, "initial_replicas": d.replicas,
        "target_ongoing_requests": d.target_ongoing_requests, "upscale_delay_s": d.upscale_delay_s,
        "downscale_delay_s": d.downscale_delay_s}
    return dict(engine_config=replace(engine_config_from(cfg), num_threads=threads), replicas=d.replicas,
                cpus_per_replica=threads, max_in_flight=d.max_in_flight, autoscaling=autoscaling,
                gpus_per_replica=d.gpus_per_replica)


def replicas_of(cfg: Any) -> Any:
    """The engine replicas alone (what a run deploys: it calls them through their handle, no ingress)."""
    return replica_deployment(**_replica_options(cfg))


def application_of(cfg: Any, api_key: str | None = None) -> Any:
    """What `orthrus-rag serve deploy=ray` deploys: the replicas behind the OpenAI ingress."""
    s = cfg.serve
    return build_application(**_replica_options(cfg), served_model_name=s.served_model_name, api_key=api_key,
                             default_max_tokens=s.default_max_tokens, retries=cfg.deploy.retries)


def build_application(engine_config: Any, replicas: int = 1, cpus_per_replica: float = 1.0,
                      max_in_flight: int = 256, served_model_name: str | None = None, api_key: str | None = None,
                      default_max_tokens: int = 512, autoscaling: dict[str, Any] | None = None,
                      gpus_per_replica: float = 0.0, retries: int = RETRIES) -> Any:
    from ray import serve

    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="OpenAIIngress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max_in_flight)
    return ingress.bind(replica_deployment(engine_config, replicas, cpus_per_replica, max_in_flight, autoscaling,
                                           gpus_per_replica),
                        engine_config.model.name, served_model_name, api_key, default_max_tokens, max_in_flight,
                        (autoscaling or {}).get("min_replicas", replicas), retries)


def _init_ray(address: str | None, num_cpus: int | None) -> bool:
    """Join `address`, or start a local Ray (`num_cpus`); False if Ray was already up in this process."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, num_cpus=num_cpus if address is None else None, include_dashboard=False,
             log_to_driver=False)
    return True


def stop() -> None:
    """Delete the application and its board (Ray and Serve stay up for whatever else runs there)."""
    from ray import serve

    from orthrus_rag.entrypoints.ray.board import remove_board

    serve.delete(APP_NAME)
    remove_board()


def start(application: Any, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
          num_cpus: int | None = None, keep_alive_s: float | None = None) -> str:
    """Deploy `application` behind HTTP (starting or joining Ray) and return the OpenAI base URL.
    `keep_alive_s`: the HTTP proxy's idle keep-alive (None: the in-process server's, KEEP_ALIVE_S)."""
    from ray import serve

    _init_ray(address, num_cpus)
    # NOTE: Ray's proxy also defaults to 5 s, the clients' own expiry (config/app.py KEEP_ALIVE_S says why not)
    serve.start(http_options={"host": host, "port": port,
                              "keep_alive_timeout_s": int(math.ceil(keep_alive_s or KEEP_ALIVE_S))})
    serve.run(application, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}/v1"


def ray_client(application: Any, address: str | None = None, num_cpus: int | None = None,
               max_in_flight: int = 8192, retries: int = RETRIES) -> "RayServeClient":
    """Deploy `application` (the replicas, `replicas_of`) with no HTTP route and return a `RayServeClient` over
    their handle (a run's client: no HTTP hop). Closing it deletes the application, and stops Ray if this call
    started it."""
    from ray import serve

    from orthrus_rag.engine.clients.deployment_client import load_tokenizer

    started = _init_ray(address, num_cpus)
    serve.run(application, name=APP_NAME, route_prefix=None)
    handle = serve.get_deployment_handle(REPLICA, app_name=APP_NAME)
    info = handle.info.remote().result()
    space = info["embedding_space"]
    return RayServeClient(handle, load_tokenizer(space.model), space, max_in_flight,
                          on_close=lambda: _shutdown(started), retries=retries,
                          reranker_names=info.get("reranker_names", ()))


def _shutdown(stop_ray: bool) -> None:
    import ray
    from ray import serve

    from orthrus_rag.entrypoints.ray.board import remove_board

    serve.delete(APP_NAME)
    remove_board()
    if stop_ray:
        serve.shutdown()
        ray.shutdown()
