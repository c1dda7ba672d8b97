"""The client seam: `EngineClient` and its errors (protocol.py), which pipelines, retrievers, the server,
LangChain, Ray and the benchmarks call through, and its implementations here: `DeploymentClient` (the two-process
deployments and benchmark peers) and `RemoteClient` (a running server, over HTTP). The in-process one is
`orthrus_rag.engine.async_engine.AsyncEngine`; `open_client` opens any system a benchmark compares."""

from orthrus_rag.engine.clients.protocol import (ClientFailed, EngineClient, EngineQueueFull,  # noqa: I001
                                                 EngineShutdown, EngineUnavailable, RequestAborted, RequestFailed)
from orthrus_rag.engine.clients.remote import RemoteClient
from orthrus_rag.engine.clients.deployment_client import DeploymentClient, start_deployment
from orthrus_rag.engine.clients.systems import SYSTEMS, open_client

__all__ = ["SYSTEMS", "ClientFailed", "DeploymentClient", "EngineClient", "EngineQueueFull", "EngineShutdown",
           "EngineUnavailable", "RemoteClient", "RequestAborted", "RequestFailed", "open_client",
           "start_deployment"]
