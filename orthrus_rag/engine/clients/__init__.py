"""The client seam: `EngineClient` (protocol.py), which pipelines, retrievers, the server and LangChain call through,
and its implementations here: `DeploymentClient` (the two-process deployments and benchmark peers, over the
submit/poll `ServingClient` of client.py) and `RemoteClient` (a running server, over HTTP); `EngineClientDriver`
turns any of them back into a `ServingClient` for the benchmarks' load drivers. The in-process one is
`orthrus_rag.engine.async_engine.AsyncEngine`. The process baselines themselves live in `orthrus_rag.engine.deploy`."""

from orthrus_rag.engine.clients.protocol import EngineClient  # noqa: I001
from orthrus_rag.engine.clients.client import SYSTEMS, InProcessClient, ServingClient, make_client
from orthrus_rag.engine.clients.remote import RemoteClient
from orthrus_rag.engine.clients.driver import EngineClientDriver
from orthrus_rag.engine.clients.deployment_client import (ClientFailed, DeploymentClient, RequestFailed,
                                                          start_deployment)

__all__ = ["SYSTEMS", "ClientFailed", "DeploymentClient", "EngineClient", "EngineClientDriver", "InProcessClient",
           "RemoteClient", "RequestFailed", "ServingClient", "make_client", "start_deployment"]
